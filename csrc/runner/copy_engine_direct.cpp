#include "runner/copy_engine_direct.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <mutex>

#include "collective/relayed_broadcast.hpp"
#include "collective/staging_allgather.hpp"
#include "transport/freed_allocations.hpp"
#include "transport/peer_rendezvous.hpp"

namespace sdma {
namespace {

// Collectives a rank's CPU may run ahead of a peer's on the direct path before it waits for it.
constexpr int kMailboxDepth = 1024;
// Once per process: the caching allocator reports every segment it gives back, so that peers drop their mappings of
// it. Without the report (an allocator that cannot be watched) a free is seen when its address is exported again,
// or by a periodic check, and mappings stay bounded by count (PeerSegmentMap::kMaxMappingsPerPeer).
void watchCachingAllocatorFrees() {
  static std::once_flag once;
  std::call_once(once, [] {
    using c10::cuda::CUDACachingAllocator::TraceEntry;
    try {
      c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker([](const TraceEntry& e) {
        if (e.action_ == TraceEntry::SEGMENT_FREE) {
          noteAllocationFreed(static_cast<uint64_t>(e.addr_));
        }
      });
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: the CUDA allocator cannot be watched (" << e.what()
                   << "); peers unmap this process's freed memory later";
    }
  });
}

}  // namespace

CopyEngineDirect::CopyEngineDirect(const c10::intrusive_ptr<c10d::Store>& groupStore, int rank, int size, int device,
                                   const std::vector<MemberIdentity>& members, const DirectPathOptions& options)
    : store_(groupStore),
      rank_(rank),
      size_(size),
      device_(device),
      members_(members),
      options_(options),
      peerSegments_(device, pidsOf(members)) {
  c10d::PrefixStore store("direct/", groupStore);
  const bool withRanges = size <= kMaxExchangeRanks;
  mailboxRegion_ = GroupRegion(store, "mailbox", rank, size, ArrivalMailbox::bytesFor(size, kMailboxDepth, withRanges),
                               "the direct path's arrival mailbox");
  mailbox_ = std::make_unique<ArrivalMailbox>(mailboxRegion_.data(), rank, size, kMailboxDepth, withRanges);
  retiredRegion_ = GroupRegion(store, "retired", rank, size, RetiredSegmentLog::bytesFor(size),
                               "the direct path's retired-allocation log");
  retired_ = std::make_unique<RetiredSegmentLog>(retiredRegion_.data(), rank, size);
  // Only the flags are used: a slot per chunk of a relayed broadcast, each of a page.
  c10d::PrefixStore flagStore("direct/ce/", groupStore);
  transport_ = CopyEngineTransport::connect(flagStore, rank, size, device,
                                            StagingGeometry::fit(size, kRelayMaxChunks, kPageBytes, 0), members);
  watchCachingAllocatorFrees();
}

CopyEngineDirect::~CopyEngineDirect() = default;

size_t CopyEngineDirect::heldBytes() const {
  return bounce_ ? bounce_->bytes() : 0;
}

void CopyEngineDirect::retireFreedAllocations() {
  std::vector<RetiredSegment> mine;
  exporter_.collectFreed(&mine);
  for (const auto& s : mine) {
    retired_->publish(s);
  }
}

void CopyEngineDirect::forgetPeersFreedAllocations() {
  std::vector<RetiredSegment> theirs;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) {
      continue;
    }
    theirs.clear();
    if (!retired_->readNew(q, &theirs)) {
      peerSegments_.forgetUnheld(q);
    }
    for (const auto& s : theirs) {
      peerSegments_.forget(q, s);
    }
  }
}

const std::shared_ptr<BounceArea>& CopyEngineDirect::bounceOf(size_t bytes) {
  if (!bounce_ || bounce_->bytes() < bytes) {
    bounce_.reset();  // collectives in flight still hold it; a new one is not added to it
    bounce_ = std::make_shared<BounceArea>(device_, bytes);
  }
  return bounce_;
}

std::chrono::microseconds CopyEngineDirect::peerWaitFor(size_t bytesPerRank) const {
  const auto saves = std::chrono::microseconds(bytesPerRank * static_cast<size_t>(size_ - 1) / kCopyEngineBytesPerUs);
  return std::min(options_.peerWait, saves);
}

CopyEngineDirect::Arrival CopyEngineDirect::arrive(const AllgatherPlan& plan, std::chrono::milliseconds timeout) {
  retireFreedAllocations();
  const size_t n = plan.bytesPerRank;
  const char* input = plan.input.front().ptr;
  Arrival a;
  BufferPost post;
  post.bytes = n;
  a.posted = {input, plan.outputBase};
  const bool outputMappable = exporter_.exportRange(plan.outputBase, n * size_, &post.outputSegment);
  // In place (how FSDP2 and ZeRO-3 call it) the input lies in the output's allocation: one export serves both.
  const bool inPlace = plan.input.size() == 1 && input >= plan.outputBase && input + n <= plan.outputBase + n * size_;
  bool inputMappable = false;
  if (inPlace) {
    inputMappable = outputMappable;
    post.inputSegment = post.outputSegment;
  } else {
    inputMappable = plan.input.size() == 1 && exporter_.exportRange(input, n, &post.inputSegment);
  }
  if (!inputMappable || !outputMappable) {
    const auto& bounce = bounceOf(n * size_);
    a.holds.push_back(bounce);
    // Exported like the pool's memory, so that the peers' mappings of an outgrown bounce area are retired too.
    ExportedSegment bounceSegment;
    TORCH_CHECK(exporter_.exportRange(bounce->data(), bounce->bytes(), &bounceSegment),
                "torch_sdma: the direct path's bounce area is not in the registry of shareable memory");
    if (!outputMappable) {
      a.posted.outputBase = bounce->data();
      post.outputSegment = bounceSegment;
    }
    if (!inputMappable) {
      a.posted.input = bounce->data() + static_cast<size_t>(rank_) * n;
      post.inputSegment = bounceSegment;
    }
  }
  post.input = reinterpret_cast<uint64_t>(a.posted.input);
  post.output = reinterpret_cast<uint64_t>(a.posted.outputBase);

  const auto settled = this->post(a, post, n, timeout);
  // Every peer whose post this rank read agrees on the size, or nothing is enqueued: checked before any mapping.
  for (int q = 0; q < size_; ++q) {
    const ArrivalMailbox::PeerArrival& peer = settled[q];
    if (q != rank_ && peer.pairing != Pairing::kPeerCameLate && peer.post.bytes != n) {
      throw SizeMismatch(q, peer.post.bytes, n);
    }
  }
  a.peers.resize(size_);
  for (int q = 0; q < size_; ++q) {
    const ArrivalMailbox::PeerArrival& peer = settled[q];
    a.peers[q].pairing = peer.pairing;
    if (q == rank_) {
      continue;
    }
    if (peer.pairing == Pairing::kPeerCameLate) {
      continue;
    }
    a.peers[q].outputBase =
        reinterpret_cast<uint64_t>(peerSegments_.locate(q, peer.post.outputSegment, peer.post.output, &a.holds));
    if (peer.pairing == Pairing::kThisCameLate) {
      a.peers[q].input =
          reinterpret_cast<uint64_t>(peerSegments_.locate(q, peer.post.inputSegment, peer.post.input, &a.holds));
    }
  }
  return a;
}

}  // namespace sdma

namespace sdma {

std::vector<ArrivalMailbox::PeerArrival> CopyEngineDirect::post(Arrival& a, const BufferPost& post,
                                                                size_t peerWaitBytes, std::chrono::milliseconds timeout,
                                                                const std::vector<PairRanges>* ranges) {
  a.transport = transport_;
  a.serial = ++serial_;
  auto settled = mailbox_->arrive(serial_, post, timeout, peerWaitFor(peerWaitBytes), options_.peerWait, ranges);
  forgetPeersFreedAllocations();
  return settled;
}

void CopyEngineDirect::arriveRefused(uint64_t directions, std::chrono::milliseconds timeout) {
  Arrival a;
  BufferPost refused;
  refused.bytes = kRefusedPost | directions;
  const std::vector<PairRanges> none(static_cast<size_t>(size_));
  (void)post(a, refused, 0, timeout, &none);
}

CopyEngineDirect::Arrival CopyEngineDirect::arriveExchange(const ExchangePlan& plan,
                                                           std::chrono::milliseconds timeout) {
  retireFreedAllocations();
  Arrival a;
  BufferPost post;
  a.posted = {plan.input, plan.output};
  const bool inputMappable =
      plan.inputBytes == 0 || (plan.input && exporter_.exportRange(plan.input, plan.inputBytes, &post.inputSegment));
  const bool outputMappable =
      plan.outputBytes == 0 ||
      (plan.output && exporter_.exportRange(plan.output, plan.outputBytes, &post.outputSegment));
  if (!inputMappable || !outputMappable) {
    // One bounce area: the input region, then the output region, each where it is needed.
    const uint64_t inputAt = 0;
    const uint64_t outputAt = inputMappable ? 0 : roundUp(static_cast<size_t>(plan.inputBytes), kPageBytes);
    const auto& bounce = bounceOf(outputAt + (outputMappable ? 0 : plan.outputBytes));
    a.holds.push_back(bounce);
    ExportedSegment bounceSegment;
    TORCH_CHECK(exporter_.exportRange(bounce->data(), bounce->bytes(), &bounceSegment),
                "torch_sdma: the direct path's bounce area is not in the registry of shareable memory");
    if (!inputMappable) {
      a.posted.input = bounce->data() + inputAt;
      post.inputSegment = bounceSegment;
    }
    if (!outputMappable) {
      a.posted.outputBase = bounce->data() + outputAt;
      post.outputSegment = bounceSegment;
    }
  }
  post.input = reinterpret_cast<uint64_t>(a.posted.input);
  post.output = reinterpret_cast<uint64_t>(a.posted.outputBase);
  post.bytes = plan.outputBytes;
  const std::vector<PairRanges> mine = pairRangesOf(plan);
  const auto settled =
      this->post(a, post, std::max(plan.inputBytes, plan.outputBytes) / std::max(size_ - 1, 1), timeout, &mine);
  // Every pair whose post this rank read agrees, or nothing is enqueued: checked before any mapping.
  for (int q = 0; q < size_; ++q) {
    const ArrivalMailbox::PeerArrival& peer = settled[q];
    if (q == rank_ || peer.pairing == Pairing::kPeerCameLate) {
      continue;
    }
    if ((peer.post.bytes & kRefusedPost) != 0) {
      throw PeerRefusedPost(q, a.serial, peer.post.bytes & ~kRefusedPost);
    }
    const std::string differs = pairDisagreement(rank_, q, plan.sendTo[q].bytes, plan.recvFrom[q].bytes,
                                                 peer.ranges.sends.bytes, peer.ranges.expects.bytes);
    if (!differs.empty()) {
      throw RangeMismatch(differs);
    }
  }
  a.peers.resize(size_);
  a.ranges.resize(size_);
  for (int q = 0; q < size_; ++q) {
    const ArrivalMailbox::PeerArrival& peer = settled[q];
    a.peers[q].pairing = peer.pairing;
    a.ranges[q] = peer.ranges;
    if (q == rank_ || peer.pairing == Pairing::kPeerCameLate) {
      continue;
    }
    // A forwarding peer of a relayed broadcast sends from its output, which this rank pulls from where it came late
    // to the pair.
    const bool pullsFromInput = plan.relayRoot < 0 || q == plan.relayRoot;
    const bool pulls = pullsFrom(plan, rank_, q, peer.pairing);
    if (pushesTo(plan, q, peer.pairing) || (pulls && !pullsFromInput)) {
      a.peers[q].outputBase =
          reinterpret_cast<uint64_t>(peerSegments_.locate(q, peer.post.outputSegment, peer.post.output, &a.holds));
    }
    if (pulls && pullsFromInput) {
      a.peers[q].input =
          reinterpret_cast<uint64_t>(peerSegments_.locate(q, peer.post.inputSegment, peer.post.input, &a.holds));
    }
  }
  return a;
}

}  // namespace sdma
