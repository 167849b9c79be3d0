#include "runner/copy_engine_direct.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Exception.h>

#include "transport/host_shared_memory.hpp"

namespace sdma {
namespace {

// Collectives a rank's CPU may run ahead of a peer's on the direct path before it waits for it.
constexpr int kMailboxDepth = 1024;

std::vector<int> pidsOf(const std::vector<MemberIdentity>& members) {
  std::vector<int> pids;
  for (const auto& m : members) {
    pids.push_back(m.pid);
  }
  return pids;
}

}  // namespace

CopyEngineDirect::CopyEngineDirect(const c10::intrusive_ptr<c10d::Store>& groupStore, int rank, int size, int device,
                                   const std::vector<MemberIdentity>& members)
    : rank_(rank), size_(size), device_(device), peerSegments_(device, pidsOf(members)) {
  // One slot of one page: only the flags are used.
  StagingGeometry g = StagingGeometry::fit(size, 1, kPageBytes, 0);
  c10d::PrefixStore store("direct/", groupStore);
  flags_ = CopyEngineTransport::connect(store, rank, size, device, g, members);
  mailboxBytes_ = ArrivalMailbox::bytesFor(size, kMailboxDepth);
  std::string why;
  mailboxMemory_ = mapGroupRegion(store, "mailbox", rank, size, mailboxBytes_, &why);
  TORCH_CHECK(mailboxMemory_, "torch_sdma: the direct path's arrival mailbox could not be shared: ", why);
  mailbox_ = std::make_unique<ArrivalMailbox>(mailboxMemory_, rank, size, kMailboxDepth);
}

CopyEngineDirect::~CopyEngineDirect() {
  mailbox_.reset();
  unmapSegment(mailboxMemory_, mailboxBytes_);
}

const std::shared_ptr<BounceArea>& CopyEngineDirect::bounceOf(size_t bytes) {
  if (!bounce_ || bounce_->bytes() < bytes) {
    bounce_.reset();  // collectives in flight still hold it; a new one is not added to it
    bounce_ = std::make_shared<BounceArea>(device_, bytes);
  }
  return bounce_;
}

CopyEngineDirect::Arrival CopyEngineDirect::arrive(const AllgatherPlan& plan, std::chrono::milliseconds timeout) {
  const size_t n = plan.bytesPerRank;
  const char* input = plan.input.front().ptr;
  Arrival a;
  BufferPost post;
  post.bytes = n;
  a.posted = {input, plan.outputBase};
  const bool inputMappable = plan.input.size() == 1 && exporter_.exportRange(input, n, &post.inputSegment);
  const bool outputMappable = exporter_.exportRange(plan.outputBase, n * size_, &post.outputSegment);
  if (!inputMappable || !outputMappable) {
    const auto& bounce = bounceOf(n * size_);
    a.holds.push_back(bounce);
    if (!outputMappable) {
      a.posted.outputBase = bounce->data();
      post.outputSegment = bounce->segment();
    }
    if (!inputMappable) {
      a.posted.input = bounce->data() + static_cast<size_t>(rank_) * n;
      post.inputSegment = bounce->segment();
    }
  }
  post.input = reinterpret_cast<uint64_t>(a.posted.input);
  post.output = reinterpret_cast<uint64_t>(a.posted.outputBase);

  a.serial = static_cast<uint32_t>(++serial_);
  const auto seen = mailbox_->arrive(serial_, post, timeout);
  a.peers.resize(size_);
  for (int q = 0; q < size_; ++q) {
    if (!seen[q]) {
      continue;
    }
    TORCH_CHECK(seen[q]->bytes == n, "torch_sdma: group rank ", q, " all-gathers ", seen[q]->bytes,
                " bytes per rank in the same direct all-gather where this rank all-gathers ", n);
    a.peers[q].posted = true;
    a.peers[q].input =
        reinterpret_cast<uint64_t>(peerSegments_.locate(q, seen[q]->inputSegment, seen[q]->input, &a.holds));
    a.peers[q].outputBase =
        reinterpret_cast<uint64_t>(peerSegments_.locate(q, seen[q]->outputSegment, seen[q]->output, &a.holds));
  }
  return a;
}

}  // namespace sdma
