#include "gpu_completion.hpp"

namespace sdma {

GpuCompletion::GpuCompletion(gpu::Event end, std::vector<at::Tensor> keepAlive)
    : end_(end), keepAlive_(std::move(keepAlive)) {}

GpuCompletion::~GpuCompletion() {
  gpu::destroyEvent(end_);
}

bool GpuCompletion::pollDone() {
  if (!done_.load(std::memory_order_acquire) && gpu::eventDone(end_)) {
    releaseTensors();
    done_.store(true, std::memory_order_release);
  }
  return done_.load(std::memory_order_acquire);
}

void GpuCompletion::releaseTensors() {
  // Destroyed outside mutex_: freeing a tensor may need the GIL, which a Python caller of error() can hold.
  std::vector<at::Tensor> dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  dropped.swap(keepAlive_);
}

void GpuCompletion::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
  }
  releaseTensors();
}

std::exception_ptr GpuCompletion::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace sdma
