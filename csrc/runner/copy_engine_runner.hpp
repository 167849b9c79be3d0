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

#include "runner/allgather_runner.hpp"
#include "runner/group_failure.hpp"
#include "transport/copy_engine_transport.hpp"
#include "work/gpu_completion.hpp"

namespace sdma {

class CopyEngineRunner : public AllgatherRunner {
 public:
  CopyEngineRunner(std::unique_ptr<CopyEngineTransport> transport, int device);
  ~CopyEngineRunner() override;

  std::string refusal(const PlannedAllgather& planned) override;
  // asyncOp=false enqueues on the caller's current stream (NCCL's semantics); asyncOp=true on internal streams
  // that first wait for the caller's stream. Never blocks the CPU.
  c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, bool asyncOp, const CollectiveInfo& info) override;
  size_t stagingBytes() const override {
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
  GroupFailure failure_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace sdma
