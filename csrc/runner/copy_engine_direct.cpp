#include "runner/copy_engine_direct.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <mutex>

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
  mailboxRegion_ = GroupRegion(store, "mailbox", rank, size, ArrivalMailbox::bytesFor(size, kMailboxDepth),
                               "the direct path's arrival mailbox");
  mailbox_ = std::make_unique<ArrivalMailbox>(mailboxRegion_.data(), rank, size, kMailboxDepth);
  retiredRegion_ = GroupRegion(store, "retired", rank, size, RetiredSegmentLog::bytesFor(size),
                               "the direct path's retired-allocation log");
  retired_ = std::make_unique<RetiredSegmentLog>(retiredRegion_.data(), rank, size);
  // One page of one slot: only the flags are used.
  c10d::PrefixStore flagStore("direct/ce/", groupStore);
  transport_ = CopyEngineTransport::connect(flagStore, rank, size, device, StagingGeometry::fit(size, 1, kPageBytes, 0),
                                            members);
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

  a.transport = transport_;
  a.serial = ++serial_;
  const auto settled = mailbox_->arrive(serial_, post, timeout, peerWaitFor(n), options_.peerWait);
  forgetPeersFreedAllocations();
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
