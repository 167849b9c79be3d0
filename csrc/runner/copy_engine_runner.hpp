// Runs the all-gather schedules on copy-engine transports: picks the streams the two lanes use, orders them against
// the caller's stream with events, and watches every eager collective in flight so that a missing peer becomes an
// error (naming it) within the timeout and the GPU streams stuck on it are released.
//
// Staging is sized to what the group has needed so far, not to the cap (TORCH_SDMA_STAGING_BYTES): a larger message
// connects a larger transport, and the old one lives until its last collective completes. Many groups over the same
// GPUs (Megatron, DeviceMesh, HSDP) that all-gather little then hold little.
//
// Collectives captured into a CUDA graph (all-gathers and exchanges) run the captured schedules on a transport of
// their own, sized to the cap once: a graph keeps the addresses it was captured with, and may be replayed while eager
// collectives run.
//
// With TORCH_SDMA_DIRECT, an eager all_gather_into_tensor copies between the ranks' own buffers instead
// (copy_engine_direct.hpp, collective/direct_allgather.hpp); the watchdog watches it the same way.
//
// In a group that spans nodes (docs/multinode.md) the transport spans this rank's node, and the hierarchical
// schedule runs with NCCL on this rank's rail between nodes (gpu_rail_allgather.hpp), on a third stream. The
// watchdog then sees the node's ranks only: a rank missing on another node shows as a rail gather that never ends,
// which the rail's NCCL watchdog reports (and ends, as for any NCCL collective).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "runner/call_order.hpp"
#include "runner/captured_lanes.hpp"
#include "runner/collective_runner.hpp"
#include "runner/copy_engine_direct.hpp"
#include "runner/gpu_rail_allgather.hpp"
#include "runner/group_failure.hpp"
#include "runner/guarded_thread.hpp"
#include "transport/copy_engine_transport.hpp"
#include "transport/group_fault_board.hpp"
#include "transport/group_region.hpp"
#include "work/gpu_completion.hpp"

namespace sdma {

class CopyEngineRunner : public CollectiveRunner {
 public:
  // `members`: every member's identity, from a reachability check that said "" to all. `cap`: the largest staging.
  CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
                   std::vector<MemberIdentity> members, const StagingGeometry& cap, const DirectPathOptions& direct);
  // Hierarchical: rank, size and members are those of this rank's node.
  CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int device, std::vector<MemberIdentity> nodeMembers,
                   const StagingGeometry& cap, HierarchicalSetup setup);
  ~CopyEngineRunner() override;

  CollectivePath pathFor(const PlannedAllgather& planned) override;
  // asyncOp=false enqueues on the caller's current stream (NCCL's semantics); asyncOp=true on internal streams
  // that first wait for the caller's stream. Never blocks the CPU on the GPU.
  c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, const CollectivePath& path, bool asyncOp,
                                     const CollectiveInfo& info) override;
  CollectivePath pathFor(const PlannedExchange& planned) override;
  // Eager, the direct schedule on the direct path's flags and serials (docs/design.md, "Exchange"); under capture, the
  // captured exchange on the captured transport ("Captured").
  c10::intrusive_ptr<c10d::Work> run(PlannedExchange& planned, bool asyncOp, const CollectiveInfo& info) override;
  size_t stagingBytes() const override;
  size_t peerMappedBytes() const override;
  DirectPairCounts directPairs() const override;

 private:
  CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
                   std::vector<MemberIdentity> members, const StagingGeometry& cap,
                   std::shared_ptr<const HierarchicalSetup> hierarchy, const DirectPathOptions& direct);
  // Whether an eager exchange is a broadcast relayed through the ranks (the same on every rank: size and ranks).
  bool relayed(const PlannedExchange& planned) const;

  // Never the Work itself: see gpu_completion.hpp.
  struct InFlight {
    std::shared_ptr<GpuCompletion> completion;
    std::shared_ptr<CopyEngineTransport> transport;  // keeps a transport that was outgrown alive until done
    std::shared_ptr<GpuRailAllgather> rail;          // and the gather buffers that go with it (hierarchical)
    CollectiveInfo info;                             // for the failure message
    uint32_t firstSerial;                            // chunk serials as the flags carry them
    uint32_t lastSerial;
    // The direct path: the mailbox's serial (0 elsewhere), by which the watchdog reads who reached the collective
    // from what each peer posted. What the peers posted on the group's call board is read through `info`.
    uint64_t directSerial = 0;
    std::chrono::steady_clock::time_point enqueuedAt;
    uint32_t endedSerial = 0;                  // what its Drain lane writes into endedHost_ once it ended
    std::vector<std::shared_ptr<void>> holds;  // the direct path's mappings of peers' buffers and its bounce area

    std::chrono::steady_clock::time_point deadline() const {
      return enqueuedAt + info.timeout;
    }
  };

  // Whether `call` ended: its number in endedHost_ first, so that no driver call is made before it did.
  bool ended(const InFlight& call) const;
  // Collective (every member makes the same call for the same message): a transport whose segments hold the
  // chunks `plan` is cut into at the cap's geometry, connecting a larger one when the current one is too small.
  CopyEngineTransport& stagingFor(const AllgatherPlan& plan);
  // Whether stagingFor(plan) connects a transport, and the segment it needs.
  bool stagingMustGrow(const AllgatherPlan& plan) const;
  size_t segmentBytesFor(const AllgatherPlan& plan) const;
  // The chunks `plan` is cut into on `transport`, by the flat or the hierarchical schedule.
  size_t chunksOf(const AllgatherPlan& plan, const CopyEngineTransport& transport) const;
  // "group rank 3" for a member of the transport (a rank of this node, when hierarchical).
  int groupRankOf(int member) const;
  // The store of the next connection of the group's transports, whose keys are fresh.
  c10::intrusive_ptr<c10d::Store> nextConnectionStore();
  std::unique_ptr<CopyEngineTransport> connectTransport(const StagingGeometry& geometry);
  c10::intrusive_ptr<c10d::Work> enqueueCaptured(PlannedAllgather& planned, const CollectiveInfo& info,
                                                 gpu::Stream caller);
  // The transport of captured collectives, connected by the group's first (every member's together).
  CopyEngineTransport& capturedTransport();
  // Runs `schedule` on the captured transport on the captured lanes (captured_lanes.hpp); the Work of a captured
  // collective.
  c10::intrusive_ptr<c10d::Work> enqueueOnCapturedLanes(gpu::Stream caller, bool pipelined, const CollectiveInfo& info,
                                                        at::Device device, std::vector<at::Tensor> outputs,
                                                        const std::function<void(CopyEngineTransport&)>& schedule);
  // The captured exchange (copy_engine_captured_exchange.cpp); called with enqueueMutex_ held.
  c10::intrusive_ptr<c10d::Work> enqueueCapturedExchange(PlannedExchange& planned, const CollectiveInfo& info,
                                                         gpu::Stream caller);
  // Every member posts what it sends and expects of each peer through the group's store and reads every other's:
  // where a pair disagrees, every member refuses the call in the same words, before anything is enqueued.
  void refuseCapturedPairsThatDisagree(const ExchangePlan& plan, const CollectiveInfo& info);
  // The direct path; called with enqueueMutex_ held.
  c10::intrusive_ptr<c10d::Work> enqueueDirect(PlannedAllgather& planned, bool asyncOp, const CollectiveInfo& info,
                                               gpu::Stream caller);
  // The direct path's state, connected by the group's first direct collective (every member's together).
  CopyEngineDirect& directPath();
  // `arrive()`'s arrival; where it throws, the call is refused and the group fails, `keepAlive` kept for good (a
  // peer that read this rank's post may copy with those buffers).
  template <typename Arrive>
  CopyEngineDirect::Arrival arriveOrRefuse(std::vector<at::Tensor>& keepAlive, const CollectiveInfo& info,
                                           Arrive&& arrive);
  // Records `reason` on the call board too, where the peers' waits read it, and refuses the call.
  [[noreturn]] void refuseOnBoard(const CollectiveInfo& info, const std::string& reason);
  // Enqueues `schedule(transport, serial)` for an arrival on the direct path, its pushes on as many peer lanes as
  // `peerLanes` and the hardware queues allow (one: the push stream), and tracks it.
  template <typename Schedule>
  c10::intrusive_ptr<c10d::Work> enqueueArrived(CopyEngineDirect::Arrival& arrival, Operands operands, bool asyncOp,
                                                const CollectiveInfo& info, gpu::Stream caller, int peerLanes,
                                                Schedule&& schedule);
  // Throws where the group failed, here or on a peer (which fails it here too).
  void refuseIfFailed(const CollectiveInfo& info);
  // "group rank 1 (pid 123) exited" for the first member whose process is gone, or "".
  std::string exitedPeer() const;
  // "group rank 1 failed the group: <its reason>".
  std::string peerFailure(int q) const;
  // Orders the lanes after the caller's stream (`drain` is the caller's stream for a synchronous call), and the Drain
  // lane after the group's previous eager collective where that one ended on another stream (call_order.hpp).
  void forkFromCaller(gpu::Stream caller, gpu::Stream push, gpu::Stream drain);
  // The Work of a collective enqueued on the drain lane, watched until it is done.
  c10::intrusive_ptr<c10d::Work> track(Operands planned, bool asyncOp, gpu::Stream drain, InFlight inFlight,
                                       std::unique_lock<std::mutex>& lock);

  void watchdogLoop();
  // Why `stuck` failed, naming the peers that never reached it.
  std::string describeFailure(const InFlight& stuck, const std::string& cause);
  // Fails the group (docs/design.md, "Failures"), with mutex_ held: refuses every later call, sets an error on every
  // call in flight (their tensors stay until their lanes run out), then publishes the failure to the peers.
  void failGroupLocked(const std::string& reason);
  // A failed group's watchdog step, with mutex_ held (released around GPU calls): drops the calls whose lanes ran
  // out, releases the waits on peers whose process is gone, and, once every lane ran out, writes the release values
  // into every failed peer. True once nothing is left to do.
  bool progressAfterFailure(std::unique_lock<std::mutex>& lock);
  // Every transport of the group with the last serial this rank enqueued on it; enqueueMutex_ or a stopped enqueue.
  std::vector<std::pair<std::shared_ptr<CopyEngineTransport>, uint32_t>> transportsToRelease() const;
  // A peer that posted another call for the collective on the group's call board, named with both ("" if none).
  std::string sizeMismatchOf(const InFlight& inFlight) const;
  // A call that connects memory (staging that grows, the first captured or direct call) meets its peers there, so it
  // first waits for every peer's post on the call board and throws, with nothing enqueued, where one posted another
  // call (call_board.hpp). Called without mutex_: the watchdog goes on meanwhile.
  void meetPeersBeforeConnecting(const CollectiveInfo& info);
  // Records `reason` as the group's failure and throws it: for a call refused before anything was enqueued.
  [[noreturn]] void refuseCall(const std::string& reason);
  // The watchdog itself failed: every collective in flight fails with its message; nothing touches the GPU.
  void abandonInFlight(const std::string& why);
  // Waits for the calls in flight, and after a failure for the release, each within the group's timeout; false
  // where something may still run on this group's memory.
  bool drainOnShutdown();

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const int device_;
  const std::vector<MemberIdentity> members_;
  const StagingGeometry cap_;
  const bool injectWatchdogFault_;
  const std::shared_ptr<const HierarchicalSetup> hierarchy_;  // null: the flat schedule
  const DirectPathOptions directOptions_;
  int connections_ = 0;  // store keys of each connection are fresh

  std::shared_ptr<CopyEngineTransport> staging_;   // eager collectives; guarded by mutex_
  std::shared_ptr<GpuRailAllgather> railStaging_;  // the gathers between nodes on staging_ (hierarchical)
  // Captured collectives; every graph that captured one holds it too, so that it outlives the group while a graph
  // that may replay it lives.
  std::shared_ptr<CopyEngineTransport> captured_;
  // Captured exchanges so far, which name the store keys of their pair check; guarded by enqueueMutex_.
  uint64_t capturedExchanges_ = 0;
  std::unique_ptr<CopyEngineDirect> direct_;  // the direct path, from its first all-gather; guarded by mutex_
  gpu::Stream pushStream_ = nullptr;
  gpu::Stream drainStream_ = nullptr;
  // The direct path's peer lanes (CopyEngineTransport::bindLanes), made at its first collective where
  // TORCH_SDMA_PEER_LANES asks for more than one: a rank's copies to different peers then run on different engines.
  std::vector<gpu::Stream> peerLanes_;
  gpu::Stream networkStream_ = nullptr;  // the gathers between nodes (hierarchical)
  gpu::Event callerReady_ = nullptr;
  gpu::Event pushDone_ = nullptr;
  std::unique_ptr<CapturedLanes> capturedLanes_;
  std::shared_ptr<EventPool> endEvents_ = std::make_shared<EventPool>();
  // Each eager call's Drain lane writes its number here once it ended (pinned host memory, gpu::mallocMappedHost): the
  // watchdog reads it with a plain load, as no driver call of its may wait behind another thread's blocking read of a
  // call's output (a copy into pageable memory holds the other threads' driver calls until it returns). Null where
  // the driver has no stream memory operations: the end events alone then.
  uint32_t* endedHost_ = nullptr;
  void* endedDevice_ = nullptr;
  uint32_t endedSerial_ = 0;  // the last call's number; guarded by mutex_
  uint64_t chunks_ = 0;       // chunks enqueued on staging_ (the last one's serial); guarded by mutex_
  // The eager collectives' order across streams: where the last one ended, and its completion, whose end event a
  // Drain lane on another stream waits for (held here so that its event is not reused meanwhile); guarded by mutex_
  CallOrder<gpu::Stream> callOrder_;
  std::shared_ptr<GpuCompletion> previous_;

  // Serializes enqueues (the state above: staging_, chunks_, the call order); held through
  // waits on peers' CPUs, which mutex_ never is, so that the watchdog is never stalled by them.
  std::mutex enqueueMutex_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InFlight> inFlight_;
  GroupFailure failure_;
  std::chrono::milliseconds timeout_{0};  // the group's, from its latest call
  // After a failure: how each member stands (host memory the members map), the failed calls whose lanes have not
  // run out yet (their tensors kept), and, per peer, whether its process is gone or this rank released it.
  GroupRegion faultBoardRegion_;
  std::unique_ptr<GroupFaultBoard> faultBoard_;
  std::deque<InFlight> failed_;
  std::vector<bool> peerGone_;
  std::vector<bool> peerReleased_;
  bool released_ = false;
  bool watchdogGone_ = false;  // it failed: nobody releases the peers, and a destroy keeps the group's memory
  bool stop_ = false;
  GuardedThread watchdog_;
};

}  // namespace sdma
