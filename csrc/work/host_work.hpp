// The Work of an all-gather of CPU tensors: the host runner's worker completes it once the copies ran; wait()
// blocks until then, like gloo's. Tensors the copies touch are held until then. Once the interpreter exits, the
// worker lets go of nothing and runs no callback (interpreter_exit.hpp).
#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <mutex>

#include "work/sdma_work.hpp"

namespace sdma {

class HostWork : public SdmaWork {
 public:
  HostWork(const CollectiveInfo& info, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive);

  // isCompleted, exception and wait are Work's own: finish() sets completed_ and exception_ together.
  void synchronize() override {}  // nothing to order (and Work::wait calls it with mutex_ held)
  void blockCurrentStream() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // Marks the work finished; `error` null means success. Once the interpreter exits the kept tensors stay, and the
  // future completes only if nobody was handed it (then nobody can have added a callback).
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
  void completeFuture(const std::exception_ptr& error);

  std::vector<at::Tensor> keepAlive_;
  const std::chrono::steady_clock::time_point deadline_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex futureMutex_;
  bool futureHandedOut_ = false;  // getFuture() ran: a callback, maybe Python, may wait on the future
};

}  // namespace sdma
