// Runs the all-gather schedules on the shared-memory transport: records a collective's operations on the caller's
// thread and hands them to one worker thread per group, which executes collectives in call order.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "runner/allgather_runner.hpp"
#include "runner/group_failure.hpp"
#include "transport/host_shm_transport.hpp"
#include "work/host_work.hpp"

namespace sdma {

class SharedMemoryRunner : public AllgatherRunner {
 public:
  explicit SharedMemoryRunner(std::unique_ptr<HostShmTransport> transport);
  ~SharedMemoryRunner() override;

  std::string refusal(const PlannedAllgather&) override {
    return "";
  }
  c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, bool asyncOp, const CollectiveInfo& info) override;
  size_t stagingBytes() const override {
    return transport_->geometry().bytes();
  }

 private:
  struct Job {
    std::vector<HostShmTransport::Op> ops;
    c10::intrusive_ptr<HostWork> work;
  };
  void workerLoop();

  std::unique_ptr<HostShmTransport> transport_;
  uint32_t serial_ = 0;        // staging chunks
  uint64_t directSerial_ = 0;  // collectives on the direct path
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  GroupFailure failure_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace sdma
