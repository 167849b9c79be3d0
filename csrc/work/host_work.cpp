#include "work/host_work.hpp"

#include "work/interpreter_exit.hpp"

namespace sdma {

HostWork::HostWork(const CollectiveInfo& info, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive)
    : SdmaWork(info, std::move(outputs)),
      keepAlive_(std::move(keepAlive)),
      deadline_(std::chrono::steady_clock::now() + info.timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void HostWork::releaseKeptTensors() {
  // Dropped outside mutex_: freeing a tensor may need the GIL, which a Python caller of this work can hold
  // while it waits for mutex_.
  std::vector<at::Tensor> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(keepAlive_);
  }
  if (!dropped.empty()) {
    InterpreterExit::drop(dropped);
  }
}

void HostWork::completeFuture(const std::exception_ptr& error) {
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

void HostWork::complete(std::exception_ptr error) {
  {
    InterpreterExit::DropScope scope;
    if (scope.open()) {
      releaseKeptTensors();
      completeFuture(error);
    } else {
      // Held by this lock, nobody can take the future and add a callback before it completes.
      std::lock_guard<std::mutex> lock(futureMutex_);
      if (!futureHandedOut_) {
        completeFuture(error);
      }
    }
  }
  finish(error);
}

void HostWork::blockCurrentStream() {
  Work::wait(kNoTimeout);
}

c10::intrusive_ptr<c10::ivalue::Future> HostWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  futureHandedOut_ = true;
  return future_;
}

}  // namespace sdma
