// Runs the all-gather schedule on the shared-memory transport: records a collective's operations on the
// caller's thread and hands them to one worker thread per group, which executes collectives in call order.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "allgather_schedule.hpp"
#include "collective_info.hpp"
#include "host_shm_transport.hpp"
#include "work_sdma.hpp"

namespace sdma {

class HostAllgatherRunner {
 public:
  explicit HostAllgatherRunner(std::unique_ptr<HostShmTransport> transport);
  ~HostAllgatherRunner();

  c10::intrusive_ptr<WorkSDMA> run(const AllgatherPlan& plan, const CollectiveInfo& info,
                                   std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive);

  size_t stagingBytes() const {
    return transport_->geometry().bytes();
  }

 private:
  struct Job {
    std::vector<HostShmTransport::Op> ops;
    c10::intrusive_ptr<WorkSDMA> work;
  };
  void workerLoop();

  std::unique_ptr<HostShmTransport> transport_;
  uint32_t serial_ = 0;        // staging chunks
  uint64_t directSerial_ = 0;  // collectives on the direct path
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  std::string brokenReason_;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace sdma
