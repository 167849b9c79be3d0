// The `sdma` c10d backend: all-gathers over DMA transports, every other collective handed to an inner backend
// (NCCL/RCCL for CUDA tensors, gloo for CPU tensors) created by the Python registration over its own
// sub-store. One object may serve both devices (backend string "sdma"), so every method dispatches on the
// device of its tensors. A group whose members span nodes runs the hierarchical all-gather (docs/multinode.md):
// the DMA transport inside each node, an inner backend per rail between nodes.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <bitset>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/collective_trace.hpp"
#include "backend/delegated_watch.hpp"
#ifdef TORCH_SDMA_CUDA
#include "backend/comm_buffer_pool.hpp"
#endif
#include "backend/inner_backend_factory.hpp"
#include "backend/sdma_options.hpp"
#include "backend/self_exchange.hpp"
#include "collective/allgather_inputs.hpp"
#include "collective/collective_info.hpp"
#include "collective/collective_path.hpp"
#include "collective/exchange_inputs.hpp"
#include "collective/node_layout.hpp"
#include "runner/collective_runner.hpp"
#include "runner/p2p_runner.hpp"
#include "transport/call_board.hpp"
#include "transport/group_region.hpp"
#include "transport/group_timeout_store.hpp"
#include "transport/peer_rendezvous.hpp"
#include "work/batched_p2p_work.hpp"

namespace sdma {

class ProcessGroupSDMA : public c10d::Backend {
 public:
  // `cudaUnavailable`: why `innerCuda` is null ("" when it is not), for the error of a CUDA collective.
  // `railBackends`: makes the inner backends of the rails when the group spans nodes (null: such a group's
  // all-gathers go to the inner backend).
  ProcessGroupSDMA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, SdmaOptions options,
                   c10::intrusive_ptr<c10d::Backend> innerCpu, c10::intrusive_ptr<c10d::Backend> innerCuda,
                   std::string cudaUnavailable = "", InnerBackendFactory railBackends = nullptr);
  ~ProcessGroupSDMA() override;

  const std::string getBackendName() const override {
    return "sdma";
  }
  c10::intrusive_ptr<Options> getBackendOptions() override;

  // All-gather: the DMA path when eligible.
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;

  // Everything else: the inner backend of the tensors' device.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions(), bool waitAllRanks = false) override;

  // Control.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  bool supportsCoalescing() const override {
    return true;
  }
  bool supportsSplitting() const override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void eagerConnectSingleDevice(at::Device device) override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;
  // Communication buffers (FSDP2's set_allocate_memory_from_process_group_for_comm) from a pool the direct path's
  // peers map at full speed (comm_buffer_pool.hpp); offered where the direct path is on (TORCH_SDMA_DIRECT).
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;

  // For the Python side.
  const SdmaOptions& options() const {
    return options_;
  }
  std::map<std::string, std::pair<int64_t, int64_t>> stats() const;
  // shutdown() ran (destroy_process_group): the group runs nothing more.
  bool destroyed() const {
    return destroyed_;
  }
  void resetStats();
  CollectivePath pathFor(c10::DeviceType device) const;
  // The path key the exchange `op` ("broadcast", ...) last took on `device`; "unknown" before its first call.
  std::string opPath(c10::DeviceType device, const std::string& op) const;
  // The path predicted when the group was created (for its log line); Unknown if the group does not serve
  // that device.
  CollectivePath creationVerdict(c10::DeviceType device) const;
  int64_t stagingBytesInUse() const;
  int64_t peerMappedBytes() const;
  // How the direct path's pairs settled on this rank since the last resetStats().
  DirectPairCounts directPairs() const;
  // "2 nodes x 2 ranks (rails [0,2],[1,3])" when the members span several nodes, else "".
  std::string nodeLayoutDescription() const;
  // TORCH_SDMA_MIN_BYTES as the collectives of this group apply it (sdma_options.hpp: automatic by group size).
  int64_t collectiveMinBytes(bool cuda) const;

 private:
  // One device's side of the DMA path: the verdict at creation, the path decided at the first eligible
  // all-gather (identically on every rank), and the runner once connected.
  struct DevicePath {
    CollectivePath atCreation;
    CollectivePath decided;
    std::unique_ptr<CollectiveRunner> runner;
    std::unique_ptr<P2pRunner> p2p;  // from the device's first point-to-point operation on the DMA path
    std::string connectFailure;      // why connecting failed (a peer never came): later all-gathers are refused
  };
  DevicePath& devicePath(const at::Device& device) {
    return device.is_cuda() ? cudaPath_ : hostPath_;
  }
  // A runner's byte count (stagingBytes, peerMappedBytes) summed over both devices.
  int64_t sumOverRunners(size_t (CollectiveRunner::*bytes)() const) const;

  // The one shape of every all-gather form: decide the path, then run the DMA schedule or call the inner backend.
  // The all-gather's post on the call board: the collective, its device and route, its bytes per rank.
  CallPost callPostOf(const CollectiveNames& names, const PlannedAllgather& planned) const;
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> allgatherCollective(const CollectiveNames& names, c10d::OpType opType,
                                                     PlannedAllgather planned, const TracedCollective& traced,
                                                     const c10d::AllgatherOptions& opts, InnerCall&& innerCall);
  // The one shape of every exchange (exchange_collectives.cpp): the route every rank takes alike, then the runner's
  // direct schedule or the inner backend.
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> exchangeCollective(const CollectiveNames& names, c10d::OpType opType,
                                                    PlannedExchange planned, const TracedCollective& traced,
                                                    bool asyncOp, std::chrono::milliseconds timeout,
                                                    InnerCall&& innerCall);
  // From what every rank passes alike: the inner backend and why, or the DMA path (the runner may still say no).
  CollectivePath exchangeRoute(const PlannedExchange& planned, CallOp op) const;
  // Whether the exchange `planned`, on `path`, is one NCCL runs as sends and receives with a direction (to or from a
  // peer) that no earlier one used (innerCudaDirectionsUsed_), or a broadcast, which NCCL runs as a collective, of
  // the group's first on NCCL (connectsInnerCollective): NCCL connects it inside the call, on this CPU, waiting there
  // for the peers. Its directions (a broadcast's kind) are marked once its inner call returned.
  bool connectsInnerDirections(const PlannedExchange& planned, const CollectivePath& path) const;
  void markInnerDirectionsUsed(const PlannedExchange& planned);
  // Whether a delegated collective `op` on `inner` is NCCL's first of its kind in this group (innerCudaOpsUsed_): a
  // peer that refused it or made another would hold this rank in NCCL's connect, where no watcher sees it, so such a
  // call meets every peer's post first. Marked once its inner call returned.
  bool connectsInnerCollective(CallOp op, const c10::intrusive_ptr<c10d::Backend>& inner) const;
  void markInnerCollectiveRan(CallOp op);
  // TORCH_SDMA_DELEGATE names the op (all_to_all covers both forms).
  bool delegatedByKnob(CallOp op) const;
  bool delegatedByName(const std::string& name) const;
  // Point-to-point (p2p_collectives.cpp): the route both members of the pair take alike, then the pair's steps on the
  // device's P2pRunner (inside a coalescing block: collected, and run as one batch at its end) or the inner backend.
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> pointToPoint(const CollectiveNames& names, const TracedCollective& traced,
                                              const std::vector<at::Tensor>& tensors, int peer, bool isSend, int tag,
                                              InnerCall&& innerCall);
  // What pointToPoint does with the op, where an error raises at once.
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> issueP2p(const CollectiveNames& names, const TracedCollective& traced,
                                          const std::vector<at::Tensor>& tensors, int peer, bool isSend, int tag,
                                          InnerCall&& innerCall);
  // The inner backend's send, recv or recvAnysource, counted as delegated.
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> delegateP2p(const CollectiveNames& names, const TracedCollective& traced,
                                             const std::vector<at::Tensor>& tensors, InnerCall&& innerCall);
  // From the group's settings and the bytes alone; the pair's connect may still say the inner backend.
  CollectivePath p2pRoute(const at::Tensor& tensor) const;
  // Connects the pair at its first operation (collective over the pair), then its path, alike on both members.
  CollectivePath connectP2pPair(const at::Device& device, int peer, const char* op);
  // stats() under "<op>:dma:direct" (the inner route counts as delegated), and group_path(op=).
  void recordP2pPath(const char* op, const at::Device& device, const CollectivePath& path, int64_t bytes);
  c10::intrusive_ptr<c10d::Work> runP2p(const std::vector<P2pOp>& ops, const char* op, c10d::OpType opType);
  // Throws a ValueError "torch_sdma: <op>: <words>" for ops this rank refuses on its own arguments, after each pair of
  // theirs on the DMA path took its serial as refused (P2pRunner::refuse). Inside a coalescing block it only records
  // the refusal and returns: the block's end refuses every op of the batch and raises it (failP2pBatch).
  void refuseP2p(std::vector<P2pOp> ops, const char* op, const std::string& words);
  // Each CPU op of `ops` on the DMA path takes its pair's serial as refused, for `why`.
  void postP2pRefusals(const std::vector<P2pOp>& ops, const char* op, const std::string& why);
  // The end of a block one of whose ops failed as it was issued: nothing of the batch runs, its pairs' serials are
  // taken as refused, the inner backend's block ends too, and the first failure is raised.
  [[noreturn]] void failP2pBatch();
  void beginP2pBatch();
  // The batch's Work (null where it held no operation on the DMA path).
  c10::intrusive_ptr<c10d::Work> endP2pBatch();
  // The one shape of every delegated collective.
  template <typename InnerCall>
  c10::intrusive_ptr<c10d::Work> delegate(const CollectiveNames& names, const TracedCollective& traced, int64_t bytes,
                                          InnerCall&& innerCall);

  c10::intrusive_ptr<c10d::Backend>& innerFor(const at::Device& device, const char* op);
  c10::intrusive_ptr<c10d::Backend>& innerFor(const std::vector<at::Tensor>& tensors, const char* op);
  // Throws a ValueError naming `op` once the group was shut down (destroy_process_group).
  void refuseIfDestroyed(const char* op) const;
  // Connects the device's transport on first use (after meeting every peer on the call board).
  CollectivePath choosePath(const PlannedAllgather& planned, const CollectiveInfo& info);
  void connect(const at::Device& device);
  // Collective, at creation: the path the device's all-gathers will take, for the group's log line.
  CollectivePath predictPath(bool cuda);
  bool spansNodes() const {
    return layout_.nodeCount() > 1;
  }
  // Hierarchical: this rank's node's own store (one per device), and the runner over the node and this rank's rail.
  c10::intrusive_ptr<c10d::Store> nodeStore(bool cuda) const;
  std::unique_ptr<CollectiveRunner> connectHierarchical(const at::Device& device, std::string* whyNot);
#ifdef TORCH_SDMA_CUDA
  std::unique_ptr<CommBufferPool> commBuffers_;  // from the first allocateTensor (a build without CUDA has none)
#endif
  // The call board (call_board.hpp). Collective, at creation: every member maps it (a node's members theirs).
  void createCallBoard();
  // Takes the next sequence number for a collective that posts `post` on the board.
  CollectiveInfo describeCall(const char* op, c10d::OpType opType, std::chrono::milliseconds timeout,
                              const CallPost& post);
  // Posts the call; with `awaitPeers` waits for every peer's post too. Throws, naming both calls, where a peer posted
  // another; the group then makes no further collectives.
  void postCall(const CollectiveInfo& info, bool awaitPeers);
  // After postCall: waits for every peer's post of the call, with postCall's errors.
  void awaitPostedPeers(const CollectiveInfo& info);
  void meetPeersOnBoard(const CollectiveInfo& info, bool post, bool awaitPeers);
  // Runs a collective's `call`. Where it throws before the call took its sequence number (this rank refused it on
  // its own arguments), the refusal takes the number: it is posted on the call board, so that the peers' call of
  // that number fails naming this rank instead of meeting this rank's next call; then the error goes on.
  // A template, not a std::function: every collective passes through it, and a lambda with its captures would cost
  // each call an allocation.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> refusalTakesItsNumber(CallOp op, Call&& call) {
    const uint64_t before = seq_;
    try {
      return call();
    } catch (const std::exception& e) {
      if (seq_ == before) {  // otherwise the call posted itself (its own failure is on the board)
        postRefusal(op, e);
      }
      throw;
    }
  }
  // Posts the refusal `e` of a call of `op` that took no sequence number, in its place.
  void postRefusal(CallOp op, const std::exception& e);
  // Where the peers' calls learn why a rank refused its call `seq` (the group's store).
  std::string refusalKey(uint64_t seq, int groupRank) const;
  // Throws once a collective of this group differed across ranks (or the board could not go on).
  void refuseIfCallsDiffered(const CollectiveInfo& info) const;
  // Why a wait on the board must end ("" to go on): a member exited, or the group failed meanwhile.
  std::string boardStopReason() const;
  // The inner backend's work of a delegated collective, watched on the board until every peer went past it.
  c10::intrusive_ptr<c10d::Work> watchDelegated(const CollectiveInfo& info,
                                                const c10::intrusive_ptr<c10d::Backend>& inner,
                                                c10::intrusive_ptr<c10d::Work> work);
  void onDelegatedDiffering(const DelegatedWatch::Call& call, const std::string& words);
  StagingGeometry geometry(const at::Device& device) const;
  DirectPathOptions directPathOptions() const;
  DirectPairCounts runnerDirectPairs() const;
  void recordPath(const std::string& key, int64_t bytes);
  // An exchange's path: stats under "<op>:<path>", and the op's last path on the device (opPath()).
  void recordOpPath(const char* op, const at::Device& device, const std::string& key, int64_t bytes);
  c10::intrusive_ptr<c10d::Work> trackCoalesced(c10::intrusive_ptr<c10d::Work> work);

  const c10::intrusive_ptr<GroupTimeoutStore> sdmaStore_;  // our own keys, apart from the inner backends'
  SdmaOptions options_;
  c10::intrusive_ptr<c10d::Backend> innerCpu_;
  c10::intrusive_ptr<c10d::Backend> innerCuda_;
  const std::string cudaUnavailable_;
  const InnerBackendFactory railBackends_;
  const TracedGroup traceGroup_;
  // Every member's identity and the nodes they form, from one exchange at creation (empty when disabled).
  std::vector<MemberIdentity> members_;
  NodeLayout layout_;
  uint64_t seq_ = 0;     // collectives: the call board's sequence number
  uint64_t p2pSeq_ = 0;  // point-to-point calls, for the trace (only two ranks make each)
  SelfExchange self_;
  bool destroyed_ = false;  // shutdown() ran

  // Before the runners and the watcher, which read it: they go first. Null with TORCH_SDMA_DISABLE, or where the
  // members' host memory could not be shared.
  GroupRegion boardRegion_;
  std::unique_ptr<CallBoard> board_;                // also holds why the group makes no further collectives (failure())
  std::unique_ptr<DelegatedWatch> delegatedWatch_;  // from the first delegated collective a peer has not yet passed

  DevicePath cudaPath_;
  DevicePath hostPath_;
  // Per peer: a delegated CUDA exchange of this rank already sent to it (bit 0), received from it (bit 1). NCCL
  // connects such a direction at its first use, on the caller's CPU, and waits there for the peer.
  std::vector<uint8_t> innerCudaDirectionsUsed_;
  // The delegated collectives NCCL already ran for this group, by op. Its first call creates the communicator and a
  // collective connects its channels at its first use, both on the caller's CPU, waiting there for every peer.
  std::bitset<static_cast<size_t>(CallOp::kCount)> innerCudaOpsUsed_;

  bool coalescing_ = false;
  std::vector<P2pOp> p2pBatch_;                       // a coalescing block's point-to-point on the DMA path
  std::shared_ptr<P2pBatchOutcome> p2pBatchOutcome_;  // what its operations' Works stand for
  // The first op of the open block that failed as it was issued, raised at the block's end: torch's
  // _coalescing_manager ends no block whose op raised, and leaves the group collecting the next all-gathers for a call
  // that never comes. `p2pBatchRefusal_`: where it was refused on its arguments (refuseP2p), the words.
  std::exception_ptr p2pBatchFailure_;
  std::string p2pBatchRefusal_;
  c10::DeviceIndex p2pDevice_ = -1;                             // the GPU of this group's CUDA point-to-point
  std::vector<c10::intrusive_ptr<c10d::Work>> coalescedWorks_;  // ours and gloo's, for endCoalescing

  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> splits_;

  mutable std::mutex statsMutex_;
  std::map<std::string, std::pair<int64_t, int64_t>> stats_;  // path key -> (calls, bytes)
  std::map<std::string, std::string> lastOpPath_[2];          // by device (CPU, CUDA): op -> its last path key
  DirectPairCounts pairsAtReset_;                             // the runner's tally when stats were last reset
};

}  // namespace sdma
