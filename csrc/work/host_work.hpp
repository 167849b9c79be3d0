// The Work of an all-gather of CPU tensors: the host runner's worker completes it once the copies ran; wait()
// blocks until then, like gloo's. Tensors the copies touch are held until then.
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>

#include "work/sdma_work.hpp"

namespace sdma {

class HostWork : public SdmaWork {
 public:
  HostWork(const CollectiveInfo& info, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive);

  // isCompleted, exception and wait are Work's own: finish() sets completed_ and exception_ together.
  void synchronize() override {}  // nothing to order (and Work::wait calls it with mutex_ held)
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Marks the work finished; `error` null means success.
  void complete(std::exception_ptr error);
  // The tensors the copies touch, handed over (a failed direct call keeps them for the life of the process).
  std::vector<at::Tensor> takeKeptTensors() {
    return std::move(keepAlive_);
  }
  // When the host transport gives up waiting for peers.
  std::chrono::steady_clock::time_point deadline() const {
    return deadline_;
  }

 private:
  void releaseKeptTensors();

  std::vector<at::Tensor> keepAlive_;
  const std::chrono::steady_clock::time_point deadline_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace sdma
