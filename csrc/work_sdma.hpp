// The Work handle of an sdma all-gather.
//
// GPU: completion is an event recorded after the last copy (held in a GpuCompletion the watchdog shares); wait()
// makes the caller's current stream wait on it and returns at once (never blocks the CPU), like WorkNCCL. CPU: the
// host transport's worker completes it; wait() blocks until then, like gloo's work. Either way, tensors the copies
// touch are held until the copies are known to be finished, so the caching allocator cannot hand their memory out
// early.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collective_info.hpp"
#include "gpu_completion.hpp"

namespace sdma {

class WorkSDMA : public c10d::Work {
 public:
  // CPU: the host worker calls complete() once the copies ran.
  WorkSDMA(const CollectiveInfo& info, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive);
  // GPU: done when `gpu` says so.
  WorkSDMA(const CollectiveInfo& info, at::Device device, std::vector<at::Tensor> outputs,
           std::shared_ptr<GpuCompletion> gpu);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

  // CPU side: marks the work finished; `error` null means success.
  void complete(std::exception_ptr error);

  std::string description() const {
    return info_.describe();
  }
  // CPU work only: when the host transport gives up waiting for peers.
  std::chrono::steady_clock::time_point deadline() const {
    return deadline_;
  }

 private:
  void rethrowIfFailed() const;
  void releaseKeptTensors();

  const CollectiveInfo info_;
  const at::Device device_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> keepAlive_;  // CPU work; GPU work keeps its tensors in gpu_
  const std::chrono::steady_clock::time_point deadline_;
  const std::shared_ptr<GpuCompletion> gpu_;  // null for CPU work
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace sdma
