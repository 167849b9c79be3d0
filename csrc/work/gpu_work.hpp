// The Work of an all-gather of CUDA tensors, like WorkNCCL: done when the event recorded after its last copy fired
// (held in a GpuCompletion the watchdog shares); wait() makes the caller's current stream wait on that event and
// returns at once, never blocking the CPU on the GPU. Only a point-to-point op that its runner's thread posts later
// (its pair not connected yet, or its ring of posts full) blocks wait() until it is enqueued or failed.
#pragma once

#include <ATen/core/ivalue.h>

#include <memory>
#include <mutex>

#include "work/gpu_completion.hpp"
#include "work/sdma_work.hpp"

namespace sdma {

class GpuWork : public SdmaWork {
 public:
  GpuWork(const CollectiveInfo& info, at::Device device, std::vector<at::Tensor> outputs,
          std::shared_ptr<GpuCompletion> completion);

  bool isCompleted() override;
  std::exception_ptr exception() const override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  const at::Device device_;
  const std::shared_ptr<GpuCompletion> completion_;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on demand: most callers never ask for one
};

}  // namespace sdma
