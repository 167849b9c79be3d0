// Transport over GPU copy engines: staging areas in device memory, mapped into every member once per group (VMM
// memory shared as file descriptors; legacy CUDA IPC where that is refused); data moves with cudaMemcpyAsync (a
// DMA engine, no SM); flags are stream memory operations: a write into the peer's flag word, a wait on local
// memory.
//
// Enqueue cost is the per-call cost users see, so flag operations are not issued one by one: a lane collects
// them and hands them to the driver as one batch right before its next copy (or at flush()).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gpu/gpu_api.hpp"
#include "transport/peer_rendezvous.hpp"
#include "transport/transport.hpp"

namespace sdma {

class CopyEngineTransport : public Transport, public DirectTransport {
 public:
  // Collective: "" when every member can push into every other member's GPU memory by P2P on this host, else
  // why not (the same answer on every member). `members` receives every member's identity.
  static std::string checkGroupReachable(c10d::Store& store, const std::string& key, int rank, int size, int device,
                                         std::vector<MemberIdentity>* members = nullptr);
  // Collective: every member of the group calls it together, after checkGroupReachable said "" to all. Allocates
  // this rank's staging and flags for `geometry` and maps every member's (VMM memory shared as file descriptors;
  // legacy CUDA IPC where some member cannot). Keys are taken under `store`, which must be fresh per connection.
  // Every flag starts at 0, before any peer can write one.
  static std::unique_ptr<CopyEngineTransport> connect(c10d::Store& store, int rank, int size, int device,
                                                      const StagingGeometry& geometry,
                                                      const std::vector<MemberIdentity>& members);
  ~CopyEngineTransport() override;

  int rank() const override {
    return rank_;
  }
  const StagingGeometry& geometry() const override {
    return geometry_;
  }
  char* localSegment(int slot, int srcRank) override;
  char* packSegment(int slot) override;
  void copyLocal(Lane lane, void* dst, const void* src, size_t bytes) override;
  void pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) override;
  void pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) override;
  void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void resetOwnFlags(Lane lane, Flag flag, int slot) override;
  // The direct path's operations: `peerDst` / `peerSrc` are this process's mappings of the peer's buffers
  // (PeerSegmentMap).
  DirectTransport* direct() override {
    return this;
  }
  void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) override;
  void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) override;
  void signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override;
  void waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override;
  void waitPeerOnLaneOf(Lane lane, int lanePeer, int peer, Flag flag, int slot, uint32_t value) override;
  void joinLane(Lane into, Lane from) override;
  // The streams the next collective's lanes run on (they may be the same stream), and its `peerLaneCount` peer lanes
  // at `peerLanes` (none: every Push operation on `push`). A Push operation that names a peer runs on the peer lane of
  // that peer's distance from this rank, peerLanes[(distance - 1) % peerLaneCount], which forks from `push` at its
  // first use and after each joinLane(Push, Drain), and joins into the Drain lane at joinLane(Drain, Push): different
  // peers' copies may run at once, on as many copy engines, while each peer's stay in order. The runner binds the same
  // peer lanes for every call of a group, so one peer's operations of consecutive calls stay in order too.
  void bindLanes(gpu::Stream push, gpu::Stream drain, const gpu::Stream* peerLanes = nullptr, int peerLaneCount = 0);
  // Writes `value` into `word`, pinned host memory this rank's device writes through stream memory operations, on
  // `lane` after everything enqueued on it so far: collected with the lane's flag operations, issued in their batch.
  void writeAfter(Lane lane, uint32_t* word, uint32_t value);
  // Issues the flag operations still collected on either lane; call after scheduling a collective.
  void flush();
  // The lane's stream, with the flag operations collected on it issued, so that what is enqueued on the stream next
  // (an event of the hierarchical schedule's gathers) comes after them.
  gpu::Stream laneStream(Lane lane);

  // The release of a failed group (docs/design.md, "Failures"), synchronous on a private stream. Sets every flag word
  // `peer` waits on from this rank, in the peer's memory, to `value`: only once both have failed and this rank's
  // lanes have run out.
  void releasePeer(int peer, uint32_t value);
  // Sets every flag word this rank waits on from `peer` to `value`: only for a peer whose process is gone. Synchronous,
  // through a context of its own where the flags are VMM memory, so that it lands while the lanes wait on those words.
  void releaseWaitsOnGonePeer(int peer, uint32_t value);

 private:
  CopyEngineTransport(int rank, int size, int device, const StagingGeometry& geometry);
  // Collective. Returns false, having released what it took, when some member could not do it.
  bool mapWithVmm(c10d::Store& store, size_t bytes);
  // Collective; the fallback when VMM was refused (it throws, rather than return, if even this fails).
  void mapWithLegacyIpc(c10d::Store& store, size_t bytes);
  // Zeroes every flag word of this rank's, before the peers know the memory.
  void initFlags(char* flags);
  size_t flagIndex(Flag flag, int src, int slot) const;
  // Every flag word from `src` in the flags at `flags` (this rank's or a peer's) set to `value`, synchronously: on the
  // service stream, or from beside the primary context (gpu::copyFromHostBesideStreams; this rank's VMM flags only).
  void writeFlagsFrom(char* flags, int src, uint32_t value, bool besideStreams);
  std::vector<gpu::FlagOp>& pendingFor(Lane lane);
  // The lane's stream with its collected flag operations issued, for the transport's own fork and join points.
  gpu::Stream issuePending(Lane lane);
  gpu::Stream issuePeerPending(size_t peerLane);
  // The flag operations collected for `peer` on `lane`: its peer lane's where the Push lane has peer lanes.
  std::vector<gpu::FlagOp>& pendingFor(Lane lane, int peer);
  // The stream an operation naming `peer` runs on, with its collected flag operations issued; forks the peer lane
  // from the Push lane first where this collective has not used it since the last fork point.
  gpu::Stream laneStream(Lane lane, int peer);
  int peerLaneOf(int peer) const;

  const int rank_;
  const int size_;
  const int device_;
  const StagingGeometry geometry_;
  size_t flagBytes_ = 0;
  char* base_ = nullptr;  // own allocation: flags, then staging
  std::vector<char*> peerBase_;
  bool vmm_ = false;
  std::vector<gpu::SharedAllocation> vmmMappings_;  // [rank_] is our own allocation
  std::vector<int> peerPids_;
  std::vector<int> pushOrder_;  // (rank + k) % size, so that peers are not all hit by the same sender at once
  // Per (flag, slot): this rank's flag words to wait on, and the peers' words to signal.
  std::vector<std::vector<uint32_t*>> waitWords_;
  std::vector<std::vector<uint32_t*>> signalWords_;
  gpu::Stream lanes_[2] = {nullptr, nullptr};
  std::vector<gpu::FlagOp> pendingFlags_[2];
  gpu::Stream service_ = nullptr;
  gpu::Event laneJoin_ = nullptr;
  // The peer lanes bound for this collective: streams, whether each has forked from the Push lane since the last
  // fork point, and each one's collected flag operations.
  std::vector<gpu::Stream> peerLanes_;
  std::vector<char> peerLaneForked_;
  std::vector<std::vector<gpu::FlagOp>> peerPending_;
  gpu::Event laneFork_ = nullptr;
  bool forkCurrent_ = false;   // laneFork_ was recorded after everything enqueued on the Push stream so far
  bool pushUnjoined_ = false;  // the Push stream holds work of this collective that the Drain lane does not follow
};

}  // namespace sdma
