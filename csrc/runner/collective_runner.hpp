// What the backend asks of a device's collective runner, and how it gets one. A runner owns a transport, the
// threads that watch it and the per-group serials, and runs the schedules of the collectives that only move bytes:
// the all-gathers (allgather_inputs.hpp) and the exchanges (exchange_inputs.hpp), in the group's one call order. The
// backend never sees which device's runner it holds.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/util/Exception.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collective/allgather_inputs.hpp"
#include "collective/collective_info.hpp"
#include "collective/collective_path.hpp"
#include "collective/direct_allgather.hpp"
#include "collective/exchange_inputs.hpp"
#include "collective/node_layout.hpp"
#include "collective/rank_list.hpp"
#include "transport/arrival_mailbox.hpp"
#include "transport/peer_rendezvous.hpp"
#include "transport/staging_geometry.hpp"

namespace sdma {

// How the direct path's pairs have settled on a rank, one count per peer per collective: each pushing its own
// bytes, or one of them late, the later one then moving both directions.
struct DirectPairCounts {
  uint64_t eachPushingOwn = 0;
  uint64_t oneMovingBoth = 0;

  DirectPairCounts since(const DirectPairCounts& earlier) const {
    return {eachPushingOwn - earlier.eachPushingOwn, oneMovingBoth - earlier.oneMovingBoth};
  }
};

// The tensors of a collective a runner tracks: the Work returns `outputs`; the copies touch `keepAlive`.
struct Operands {
  at::Device device = at::kCPU;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keepAlive;
};
template <typename Planned>
Operands operandsOf(Planned& planned) {
  return {planned.device, std::move(planned.outputs), std::move(planned.keepAlive)};
}

class CollectiveRunner {
 public:
  virtual ~CollectiveRunner() = default;

  // The DMA path (or a variant of it) when this collective can run here, else the inner backend and why.
  virtual CollectivePath pathFor(const PlannedAllgather& planned) = 0;
  // Enqueues the collective on the path pathFor() chose for it, on this thread, just before; never blocks on the
  // peers. Consumes planned's tensors.
  virtual c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, const CollectivePath& path, bool asyncOp,
                                             const CollectiveInfo& info) = 0;
  // The same for an exchange. Its DMA path copies between the ranks' own buffers (docs/design.md, "Exchange"); where
  // the group cannot (no direct path, capture, a group over nodes), the inner backend and why, alike on every member.
  virtual CollectivePath pathFor(const PlannedExchange& planned) = 0;
  virtual c10::intrusive_ptr<c10d::Work> run(PlannedExchange& planned, bool asyncOp, const CollectiveInfo& info) = 0;
  // Device or shared memory this runner holds outside the caching allocator (staging, the direct path's bounce area).
  virtual size_t stagingBytes() const = 0;
  // Bytes of the peers' memory mapped into this process (the direct path), which the peers cannot give back.
  virtual size_t peerMappedBytes() const {
    return 0;
  }
  // How the direct path's pairs have settled on this rank; zero without it.
  virtual DirectPairCounts directPairs() const {
    return {};
  }
};

// What a runner of the hierarchical path (docs/multinode.md) knows beyond its node: the group's layout over nodes,
// who every member is, and the inner backend over this rank's rail (the ranks with its local index on every node),
// which carries the bytes between nodes.
struct HierarchicalSetup {
  NodeLayout layout;
  int groupRank = 0;
  std::vector<MemberIdentity> members;     // by group rank
  c10::intrusive_ptr<c10d::Backend> rail;  // gloo for CPU tensors, NCCL for CUDA tensors

  int node() const {
    return layout.nodeOf(groupRank);
  }
  int localIndex() const {
    return layout.localIndexOf(groupRank);
  }
  // For the rail step's constructor: the schedule addresses the node transport (rank `transportRank` of
  // `transportSize`) by local index and calls the rail backend, so a setup that does not describe that transport, or
  // has no rail backend, is refused with the numbers rather than found later as a crash.
  void checkDescribes(int transportRank, int transportSize) const {
    TORCH_CHECK(rail,
                "torch_sdma: the hierarchical all-gather has no inner backend for its rail (a bug in torch_sdma)");
    TORCH_CHECK(transportRank == localIndex() && transportSize == layout.ranksPerNode(),
                "torch_sdma: the node transport is rank ", transportRank, " of ", transportSize, ", but group rank ",
                groupRank, " is local index ", localIndex(), " of a node of ", layout.ranksPerNode(),
                " (a bug in torch_sdma)");
  }
  // When the runner goes, after its last collective: NCCL's communicators are destroyed in order rather than found
  // still alive by the backend's destructor, or aborted when a collective of the group failed (one may be stuck in
  // them). A failure here only leaves them to that destructor.
  void closeRail(bool groupFailed) const noexcept {
    try {
      if (groupFailed) {
        rail->abort();
      } else {
        rail->shutdown();
      }
    } catch (const std::exception&) {
    }
  }
  // "rail [1, 3] (gloo)", for messages.
  std::string railName() const {
    return "rail " + rankList(layout.rail(localIndex())) + " (" + rail->getBackendName() + ")";
  }
};

// The direct path of CUDA all-gathers (docs/design.md, "Direct").
struct DirectPathOptions {
  bool enabled = false;                   // TORCH_SDMA_DIRECT: all_gather_into_tensor takes it
  std::chrono::microseconds peerWait{0};  // TORCH_SDMA_DIRECT_PEER_WAIT_US: see CopyEngineDirect
  int peerLanes = 1;                      // TORCH_SDMA_PEER_LANES: see CopyEngineRunner::enqueueArrived
};

// Copy engines, for CUDA tensors (copy_engine_runner.cpp; a build without CUDA says why not).
// Collective, at group creation: "" when the group's CUDA all-gathers can take the copy engines, else why not.
std::string copyEnginePathProblem(c10d::Store& store, int rank, int size);
// Whether this process's CUDA caching allocator is set to make expandable segments, which peers cannot map (the
// setting as c10 parsed it, in a build without CUDA too): the direct path is then not on by default.
bool cachingAllocatorUsesExpandableSegments();
// Collective, at the group's first eligible CUDA all-gather: null, with the reason in *whyNot, when the
// transport cannot connect (every member then agrees). The direct path is on only where every member asked for it.
// `geometry`: the cap; the runner sizes staging to what the group needs, up to it.
std::unique_ptr<CollectiveRunner> connectCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int size, int device, const StagingGeometry& geometry,
                                                          const DirectPathOptions& direct, std::string* whyNot);

// Shared memory, for CPU tensors (shared_memory_runner.cpp).
std::string sharedMemoryPathProblem(c10d::Store& store, int rank, int size);
std::unique_ptr<CollectiveRunner> connectSharedMemoryRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, const StagingGeometry& geometry, bool direct,
                                                            const std::string& groupName, std::string* whyNot);

// The hierarchical path: collective over the group, each node connecting its transport over `nodeStore` (a store of
// its own per node) at `nodeGeometry` (the node's size), with the rail backend in `setup` between nodes.
std::unique_ptr<CollectiveRunner> connectHierarchicalCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>& nodeStore,
                                                                      int device, const StagingGeometry& nodeGeometry,
                                                                      HierarchicalSetup setup, std::string* whyNot);
std::unique_ptr<CollectiveRunner> connectHierarchicalSharedMemoryRunner(
    const c10::intrusive_ptr<c10d::Store>& nodeStore, const StagingGeometry& nodeGeometry, HierarchicalSetup setup,
    std::string* whyNot);

}  // namespace sdma
