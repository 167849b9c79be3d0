// Runs the all-gather schedules on the shared-memory transport: records a collective's operations on the caller's
// thread and hands them to one worker thread per group, which executes collectives in call order. Under
// TORCH_SDMA_TEST_SYNC_ON_CALLER a synchronous one runs on the caller's thread instead, still in call order
// (call_ticket.hpp). In a group that
// spans nodes the transport spans this rank's node and the hierarchical schedule runs, its gathers between nodes on
// the same worker (host_rail_allgather.hpp).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runner/call_ticket.hpp"
#include "runner/collective_runner.hpp"
#include "runner/group_failure.hpp"
#include "runner/guarded_thread.hpp"
#include "runner/host_rail_allgather.hpp"
#include "transport/host_shm_transport.hpp"
#include "work/host_work.hpp"

namespace sdma {

class SharedMemoryRunner : public CollectiveRunner {
 public:
  // `allgatherDirect`: all_gather_into_tensor takes the direct path (TORCH_SDMA_DIRECT for CPU tensors), where the
  // transport has one; the exchanges take it wherever it has one.
  SharedMemoryRunner(std::unique_ptr<HostShmTransport> transport, bool allgatherDirect);
  // Hierarchical: `transport` spans this rank's node.
  SharedMemoryRunner(std::unique_ptr<HostShmTransport> transport, HierarchicalSetup setup);
  ~SharedMemoryRunner() override;

  CollectivePath pathFor(const PlannedAllgather&) override {
    return rail_ ? CollectivePath::dma("hierarchical") : CollectivePath::dma();
  }
  c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, const CollectivePath& path, bool asyncOp,
                                     const CollectiveInfo& info) override;
  CollectivePath pathFor(const PlannedExchange& planned) override;
  c10::intrusive_ptr<c10d::Work> run(PlannedExchange& planned, bool asyncOp, const CollectiveInfo& info) override;
  size_t stagingBytes() const override {
    return transport_->geometry().bytes();
  }

 private:
  struct Job {
    std::vector<HostShmTransport::Op> ops;
    c10::intrusive_ptr<HostWork> work;
    uint64_t ticket;
    // The direct path: peers copy into and out of this rank's own buffers, by the addresses it posted.
    bool postedBuffers = false;
    // The group's call board, and what this rank posted there for the call (the worker's waits give up once a peer
    // posted another call: call_board.hpp).
    CallBoard* board = nullptr;
    uint64_t seq = 0;
    CallPost post;
    // An exchange: its waits also give up on a peer that failed this call or an earlier one (see runInTurn).
    bool exchange = false;
    // The direct exchange's mailbox serial and this rank's pair ranges: a peer that failed this call because its
    // pair disagreed posted its side there, so this rank can name the pair and sizes too, not only the peer.
    uint64_t mailboxSerial = 0;
    std::vector<PairRanges> pairs;
  };
  // Queues the operations recorded since the last job as `work`'s job, in call order (or runs them here, see above).
  c10::intrusive_ptr<c10d::Work> enqueue(c10::intrusive_ptr<HostWork> work, bool postedBuffers, bool asyncOp,
                                         const CollectiveInfo& info, bool exchange = false, uint64_t mailboxSerial = 0,
                                         std::vector<PairRanges> pairs = {});
  // What a peer that failed `job` posted about its pair with this rank, where it disagrees with this rank's side
  // (pairDisagreement's words), else "".
  std::string pairDisagreementOf(const Job& job, int peer) const;
  void workerLoop();
  // Runs `job` on the calling thread once its turn came (`lock` held; held again on return), and completes its work.
  void runInTurn(Job& job, std::unique_lock<std::mutex>& lock);
  // The worker itself failed: the collective it ran and every queued one fail with its message.
  void abandonQueued(const std::string& why);

  std::unique_ptr<HostShmTransport> transport_;
  std::unique_ptr<HostRailAllgather> rail_;  // hierarchical only
  uint64_t chunks_ = 0;                      // staging chunks
  uint64_t directSerial_ = 0;                // collectives on the direct path
  const bool allgatherDirect_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  c10::intrusive_ptr<HostWork> running_;  // the one the worker holds, so that abandonQueued can fail it too
  GroupFailure failure_;
  CallTickets order_;
  bool stop_ = false;
  const bool injectWorkerFault_;
  const bool syncOnCaller_;  // TORCH_SDMA_TEST_SYNC_ON_CALLER
  GuardedThread worker_;
};

}  // namespace sdma
