#include "transport/copy_engine_transport.hpp"

#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <cstring>
#include <thread>

namespace sdma {
namespace {

// Why this rank cannot push into every peer's memory, or "".
std::string reachabilityProblem(const std::vector<MemberIdentity>& members, int rank, int device) {
  const std::string otherHost = memberOnAnotherHost(members, rank);
  if (!otherHost.empty()) {
    return otherHost;
  }
  for (size_t q = 0; q < members.size(); ++q) {
    if (static_cast<int>(q) == rank) {
      continue;
    }
    const int peerDevice = gpu::deviceByPciBusId(members[q].gpuBusId);
    if (peerDevice < 0) {
      return "the GPU of group rank " + std::to_string(q) + " (" + members[q].gpuBusId +
             ") is not visible in this process (CUDA_VISIBLE_DEVICES)";
    }
    if (!gpu::canAccessPeer(device, peerDevice)) {
      return "no P2P access from GPU " + members[rank].gpuBusId + " to GPU " + members[q].gpuBusId;
    }
  }
  return gpu::streamMemOpsUnavailableReason();
}

}  // namespace

std::string CopyEngineTransport::checkGroupReachable(c10d::Store& store, const std::string& key, int rank, int size,
                                                     int device, std::vector<MemberIdentity>* members) {
  const auto all = exchangeIdentities(store, key + "/info", rank, size, gpu::pciBusId(device));
  if (members) {
    *members = all;
  }
  return agreeOnPath(store, key + "/verdict", rank, size, reachabilityProblem(all, rank, device));
}

std::unique_ptr<CopyEngineTransport> CopyEngineTransport::connect(c10d::Store& store, int rank, int size, int device,
                                                                  const StagingGeometry& geometry,
                                                                  const std::vector<MemberIdentity>& members) {
  std::unique_ptr<CopyEngineTransport> t(new CopyEngineTransport(rank, size, device, geometry));
  t->peerPids_ = pidsOf(members);
  const size_t bytes = t->flagBytes_ + geometry.bytes();
  if (!t->mapWithVmm(store, bytes)) {
    t->mapWithLegacyIpc(store, bytes);
  }

  // Precomputed per (flag, slot), so the per-call path does no address arithmetic beyond indexing.
  const int slots = geometry.slots;
  t->waitWords_.assign(kFlagKinds * slots, {});
  t->signalWords_.assign(kFlagKinds * slots, {});
  for (Flag f : {Flag::Ready, Flag::Credit, Flag::Arrived, Flag::Done}) {
    for (int slot = 0; slot < slots; ++slot) {
      const int key = static_cast<int>(f) * slots + slot;
      for (int peer : t->pushOrder_) {
        auto* localFlags = reinterpret_cast<uint32_t*>(t->base_);
        auto* peerFlags = reinterpret_cast<uint32_t*>(t->peerBase_[peer]);
        t->waitWords_[key].push_back(localFlags + t->flagIndex(f, peer, slot));
        t->signalWords_[key].push_back(peerFlags + t->flagIndex(f, rank, slot));
      }
    }
  }
  return t;
}

CopyEngineTransport::CopyEngineTransport(int rank, int size, int device, const StagingGeometry& geometry)
    : rank_(rank), size_(size), device_(device), geometry_(geometry), peerBase_(size, nullptr), peerPids_(size, 0) {
  for (int k = 1; k < size; ++k) {
    pushOrder_.push_back((rank + k) % size);
  }
  // A word of every flag kind for every (source, slot).
  const size_t words = kFlagKinds * static_cast<size_t>(size) * geometry.slots;
  flagBytes_ = roundUp(words * sizeof(uint32_t), kPageBytes);
  service_ = gpu::createStream();
  laneJoin_ = gpu::createEvent();
  laneFork_ = gpu::createEvent();
}

void CopyEngineTransport::initFlags(char* flags) {
  gpu::memsetSync(flags, 0, flagBytes_, service_);
}

bool CopyEngineTransport::mapWithVmm(c10d::Store& store, size_t bytes) {
  std::vector<gpu::SharedAllocation> maps(size_);
  std::string error = gpu::allocateShareable(device_, bytes, &maps[rank_]);
  if (error.empty()) {
    initFlags(static_cast<char*>(maps[rank_].ptr));
  }
  auto releaseAll = [&] {
    for (auto& m : maps) {
      gpu::freeShareable(&m);
    }
  };
  if (!agreeOnPath(store, "ce/vmm/allocated", rank_, size_, error).empty()) {
    releaseAll();
    return false;
  }
  const auto fds = exchangeWithGroup(store, "ce/vmm/fd", rank_, size_, std::to_string(maps[rank_].fd));
  for (int q = 0; q < size_ && error.empty(); ++q) {
    if (q == rank_) {
      continue;
    }
    const int fd = duplicateDescriptorOf(peerPids_[q], std::stoi(fds[q]), &error);
    if (fd >= 0) {
      error = gpu::importShareable(device_, fd, bytes, &maps[q]);
    }
  }
  const bool everyoneMapped = agreeOnPath(store, "ce/vmm/imported", rank_, size_, error).empty();
  // Every peer holds its own reference now (or gave up): the exported descriptor is no longer needed.
  close(maps[rank_].fd);
  maps[rank_].fd = -1;
  if (!everyoneMapped) {
    LOG(WARNING) << "torch_sdma: mapping staging memory as VMM failed (" << error
                 << "); falling back to legacy CUDA IPC, which pushes more slowly";
    releaseAll();
    return false;
  }
  vmm_ = true;
  vmmMappings_ = std::move(maps);
  for (int q = 0; q < size_; ++q) {
    peerBase_[q] = static_cast<char*>(vmmMappings_[q].ptr);
  }
  base_ = peerBase_[rank_];
  return true;
}

void CopyEngineTransport::mapWithLegacyIpc(c10d::Store& store, size_t bytes) {
  base_ = static_cast<char*>(gpu::mallocDevice(bytes));
  initFlags(base_);
  const gpu::IpcHandle own = gpu::exportIpc(base_);
  const auto handles = exchangeWithGroup(store, "ce/ipc", rank_, size_, std::string(own.bytes, gpu::kIpcHandleBytes));
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) {
      peerBase_[q] = base_;
      continue;
    }
    gpu::IpcHandle h;
    memcpy(h.bytes, handles[q].data(), gpu::kIpcHandleBytes);
    peerBase_[q] = static_cast<char*>(gpu::importIpc(h));
  }
}

CopyEngineTransport::~CopyEngineTransport() {
  if (vmm_) {
    for (auto& m : vmmMappings_) {
      gpu::freeShareable(&m);
    }
  } else {
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) {
        gpu::closeIpc(peerBase_[q]);
      }
    }
    gpu::freeDevice(base_);
  }
  gpu::destroyEvent(laneJoin_);
  gpu::destroyEvent(laneFork_);
  gpu::destroyStream(service_);
}

size_t CopyEngineTransport::flagIndex(Flag flag, int src, int slot) const {
  return (static_cast<size_t>(flag) * size_ + src) * geometry_.slots + slot;
}

char* CopyEngineTransport::localSegment(int slot, int srcRank) {
  return base_ + flagBytes_ + geometry_.segmentOffset(slot, srcRank, rank_);
}

char* CopyEngineTransport::packSegment(int slot) {
  return base_ + flagBytes_ + geometry_.packSegmentOffset(slot);
}

void CopyEngineTransport::bindLanes(gpu::Stream push, gpu::Stream drain, const gpu::Stream* peerLanes,
                                    int peerLaneCount) {
  flush();
  lanes_[0] = push;
  lanes_[1] = drain;
  peerLanes_.assign(peerLanes, peerLanes + (peerLanes ? peerLaneCount : 0));
  peerLaneForked_.assign(peerLanes_.size(), 0);
  peerPending_.resize(peerLanes_.size());
  forkCurrent_ = false;
  pushUnjoined_ = false;  // the runner ordered both lanes after the same point of the caller's stream
}

std::vector<gpu::FlagOp>& CopyEngineTransport::pendingFor(Lane lane) {
  // Lanes that share a stream share one list, so their flag operations reach the stream in program order.
  return pendingFlags_[lanes_[0] == lanes_[1] ? 0 : static_cast<int>(lane)];
}

int CopyEngineTransport::peerLaneOf(int peer) const {
  const int distance = (peer - rank_ + size_) % size_;
  return (distance - 1) % static_cast<int>(peerLanes_.size());
}

std::vector<gpu::FlagOp>& CopyEngineTransport::pendingFor(Lane lane, int peer) {
  if (lane == Lane::Push && !peerLanes_.empty()) {
    const int i = peerLaneOf(peer);
    laneStream(lane, peer);  // forked before anything is collected for it, so that it follows the Push lane so far
    return peerPending_[i];
  }
  return pendingFor(lane);
}

gpu::Stream CopyEngineTransport::issuePending(Lane lane) {
  auto& pending = pendingFor(lane);
  gpu::Stream s = lanes_[static_cast<int>(lane)];
  if (!pending.empty()) {
    if (lanes_[0] != lanes_[1]) {
      // The other lane's signals collected so far go first: where the two streams share a hardware queue, a wait of
      // this lane's queued ahead of them could wait for a peer that waits for them (a staging chunk's Ready, collected
      // on the Push lane until its next copy, and the Drain lane's wait for the peer's Ready of the same chunk).
      auto& theirs = pendingFor(lane == Lane::Push ? Lane::Drain : Lane::Push);
      size_t n = 0;
      while (n < theirs.size() && theirs[n].write) {
        ++n;
      }
      if (n > 0) {
        gpu::flagOps(lanes_[lane == Lane::Push ? 1 : 0], theirs.data(), static_cast<int>(n));
        theirs.erase(theirs.begin(), theirs.begin() + static_cast<std::ptrdiff_t>(n));
      }
    }
    gpu::flagOps(s, pending.data(), static_cast<int>(pending.size()));
    pending.clear();
  }
  return s;
}

gpu::Stream CopyEngineTransport::laneStream(Lane lane) {
  gpu::Stream s = issuePending(lane);
  if (s == lanes_[0]) {
    // What the caller enqueues next on the Push stream is in no fork of a peer lane yet.
    forkCurrent_ = false;
    pushUnjoined_ = true;
  }
  return s;
}

gpu::Stream CopyEngineTransport::laneStream(Lane lane, int peer) {
  // Signals collected on the Drain lane (a collective's Arrived) reach the GPU before a push's waits: where the
  // streams share a hardware queue, a wait queued ahead of the signal the peer waits for would hold both ranks.
  if (lane == Lane::Push && lanes_[0] != lanes_[1]) {
    issuePending(Lane::Drain);
  }
  if (lane != Lane::Push || peerLanes_.empty()) {
    return laneStream(lane);
  }
  const int i = peerLaneOf(peer);
  if (!peerLaneForked_[i]) {
    if (!forkCurrent_) {
      gpu::recordEvent(laneFork_, issuePending(Lane::Push));
      forkCurrent_ = true;
      pushUnjoined_ = false;  // the peer lanes carry it, and the Drain lane joins them
    }
    gpu::streamWaitEvent(peerLanes_[i], laneFork_);
    peerLaneForked_[i] = 1;
  }
  return issuePeerPending(i);
}

gpu::Stream CopyEngineTransport::issuePeerPending(size_t i) {
  auto& pending = peerPending_[i];
  if (!pending.empty()) {
    gpu::flagOps(peerLanes_[i], pending.data(), static_cast<int>(pending.size()));
    pending.clear();
  }
  return peerLanes_[i];
}

void CopyEngineTransport::writeAfter(Lane lane, uint32_t* word, uint32_t value) {
  pendingFor(lane).push_back({true, word, value});
}

void CopyEngineTransport::flush() {
  issuePending(Lane::Push);
  issuePending(Lane::Drain);
  for (size_t i = 0; i < peerPending_.size(); ++i) {
    issuePeerPending(i);
  }
}

void CopyEngineTransport::copyLocal(Lane lane, void* dst, const void* src, size_t bytes) {
  gpu::copyAsync(dst, src, bytes, laneStream(lane));
}

void CopyEngineTransport::pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) {
  gpu::Stream s = laneStream(lane);
  for (int peer : pushOrder_) {
    gpu::copyAsync(peerBase_[peer] + flagBytes_ + geometry_.segmentOffset(slot, rank_, peer) + at, src, bytes, s);
  }
}

void CopyEngineTransport::pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) {
  gpu::copyAsync(peerBase_[peer] + flagBytes_ + geometry_.segmentOffset(slot, rank_, peer) + at, src, bytes,
                 laneStream(lane, peer));
}

void CopyEngineTransport::signalPeers(Lane lane, Flag flag, int slot, uint32_t value) {
  // A direct write into the peer's flag word: the stream runs it only after the lane's earlier copies are done,
  // with a memory barrier, so the peer that sees the value also sees the data.
  auto& pending = pendingFor(lane);
  for (uint32_t* dst : signalWords_[static_cast<int>(flag) * geometry_.slots + slot]) {
    pending.push_back({true, dst, value});
  }
}

void CopyEngineTransport::waitPeers(Lane lane, Flag flag, int slot, uint32_t value) {
  auto& pending = pendingFor(lane);
  for (uint32_t* word : waitWords_[static_cast<int>(flag) * geometry_.slots + slot]) {
    pending.push_back({false, word, value});
  }
}

void CopyEngineTransport::resetOwnFlags(Lane lane, Flag flag, int slot) {
  auto& pending = pendingFor(lane);
  for (uint32_t* word : waitWords_[static_cast<int>(flag) * geometry_.slots + slot]) {
    pending.push_back({true, word, 0});
  }
}

void CopyEngineTransport::copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) {
  gpu::copyAsync(reinterpret_cast<void*>(peerDst), src, bytes, laneStream(lane, peer));
}

void CopyEngineTransport::copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) {
  gpu::copyAsync(dst, reinterpret_cast<const void*>(peerSrc), bytes, laneStream(lane, peer));
}

void CopyEngineTransport::signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) {
  pendingFor(lane, peer)
      .push_back({true, reinterpret_cast<uint32_t*>(peerBase_[peer]) + flagIndex(flag, rank_, slot), value});
}

void CopyEngineTransport::waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) {
  waitPeerOnLaneOf(lane, peer, peer, flag, slot, value);
}

void CopyEngineTransport::waitPeerOnLaneOf(Lane lane, int lanePeer, int peer, Flag flag, int slot, uint32_t value) {
  pendingFor(lane, lanePeer)
      .push_back({false, reinterpret_cast<uint32_t*>(base_) + flagIndex(flag, peer, slot), value});
}

void CopyEngineTransport::joinLane(Lane into, Lane from) {
  if (into == Lane::Drain) {
    // Every peer lane this collective forked (each wait takes the event as last recorded, so one event serves every
    // lane in turn), then the Push stream, unless the peer lanes carry all it did.
    for (size_t i = 0; i < peerLanes_.size(); ++i) {
      if (peerLaneForked_[i]) {
        gpu::recordEvent(laneJoin_, issuePeerPending(i));
        gpu::streamWaitEvent(issuePending(Lane::Drain), laneJoin_);
      }
    }
    if (!peerLanes_.empty() && !pushUnjoined_) {
      return;
    }
  } else {
    // Every peer lane forks again at its next use, from the Push stream as it stands after this join.
    std::fill(peerLaneForked_.begin(), peerLaneForked_.end(), 0);
    forkCurrent_ = false;
  }
  if (lanes_[0] == lanes_[1]) {
    return;  // one stream runs both lanes in order
  }
  gpu::recordEvent(laneJoin_, issuePending(from));
  gpu::streamWaitEvent(issuePending(into), laneJoin_);
  if (into == Lane::Drain) {
    pushUnjoined_ = false;
  }
}

void CopyEngineTransport::writeFlagsFrom(char* flags, int src, uint32_t value, bool besideStreams) {
  // A flag kind's words for one source are its slots, side by side.
  const std::vector<uint32_t> values(geometry_.slots, value);
  const size_t bytes = values.size() * sizeof(uint32_t);
  for (int kind = 0; kind < kFlagKinds; ++kind) {
    char* words = flags + flagIndex(static_cast<Flag>(kind), src, 0) * sizeof(uint32_t);
    if (besideStreams) {
      gpu::copyFromHostBesideStreams(device_, words, values.data(), bytes);
    } else {
      gpu::copyFromHostAsync(words, values.data(), bytes, service_);
    }
  }
  if (!besideStreams) {
    gpu::syncStream(service_);
  }
}

void CopyEngineTransport::releasePeer(int peer, uint32_t value) {
  writeFlagsFrom(peerBase_[peer], rank_, value, /*besideStreams=*/false);
}

void CopyEngineTransport::releaseWaitsOnGonePeer(int peer, uint32_t value) {
  // This rank's lanes may wait on these very words, and the service stream may share their hardware queue: then a
  // copy on it runs only after the wait it should satisfy. A copy from beside the primary context lands regardless,
  // where the flags are VMM memory; into cudaMalloc memory (legacy IPC) only the service stream's can.
  if (vmm_) {
    try {
      writeFlagsFrom(base_, peer, value, /*besideStreams=*/true);
      return;
    } catch (const c10::Error& e) {
      LOG(WARNING) << "torch_sdma: passing the waits on gone rank " << peer
                   << " from beside the primary context failed; passing them on the service stream, which may share "
                      "a hardware queue with them: "
                   << e.what_without_backtrace();
    }
  }
  writeFlagsFrom(base_, peer, value, /*besideStreams=*/false);
}

}  // namespace sdma
