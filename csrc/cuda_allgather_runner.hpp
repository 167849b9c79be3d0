// Runs the all-gather schedule on the copy-engine transport: picks the streams the two lanes use, orders them
// against the caller's stream with events, and watches every collective in flight so that a missing peer
// becomes an error (naming it) within the timeout and the GPU streams stuck on it are released.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "allgather_schedule.hpp"
#include "collective_info.hpp"
#include "copy_engine_transport.hpp"
#include "gpu_completion.hpp"
#include "work_sdma.hpp"

namespace sdma {

class CudaAllgatherRunner {
 public:
  CudaAllgatherRunner(std::unique_ptr<CopyEngineTransport> transport, int device);
  ~CudaAllgatherRunner();

  // asyncOp=false enqueues on the caller's current stream (NCCL's semantics); asyncOp=true on internal streams
  // that first wait for the caller's stream. Never blocks the CPU.
  c10::intrusive_ptr<WorkSDMA> run(const AllgatherPlan& plan, bool asyncOp, const CollectiveInfo& info,
                                   std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive);

  size_t stagingBytes() const {
    return transport_->geometry().bytes();
  }

 private:
  // Never the Work itself: see gpu_completion.hpp.
  struct InFlight {
    std::shared_ptr<GpuCompletion> completion;
    CollectiveInfo info;  // for the failure message
    uint32_t firstSerial;
    uint32_t lastSerial;
    std::chrono::steady_clock::time_point enqueuedAt;

    std::chrono::steady_clock::time_point deadline() const {
      return enqueuedAt + info.timeout;
    }
  };

  void watchdogLoop();
  // Names the peers that never reached (or stalled in) the stuck collective, releases the streams, fails all.
  void failInFlight(const InFlight& stuck, const std::string& cause);
  void drainOnShutdown();

  std::unique_ptr<CopyEngineTransport> transport_;
  const int device_;
  gpu::Stream pushStream_ = nullptr;
  gpu::Stream drainStream_ = nullptr;
  gpu::Event callerReady_ = nullptr;
  gpu::Event pushDone_ = nullptr;
  std::shared_ptr<EventPool> endEvents_ = std::make_shared<EventPool>();
  uint32_t serial_ = 0;  // last chunk serial enqueued; guarded by mutex_

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InFlight> inFlight_;
  std::string brokenReason_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace sdma
