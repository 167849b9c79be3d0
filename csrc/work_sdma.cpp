#include "work_sdma.hpp"

#include <thread>

#ifdef TORCH_SDMA_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace sdma {

WorkSDMA::WorkSDMA(const CollectiveInfo& info, std::vector<at::Tensor> outputs, std::vector<at::Tensor> keepAlive)
    : Work(info.rank, info.opType),
      info_(info),
      device_(at::kCPU),
      outputs_(std::move(outputs)),
      keepAlive_(std::move(keepAlive)),
      deadline_(std::chrono::steady_clock::now() + info.timeout) {
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

WorkSDMA::WorkSDMA(const CollectiveInfo& info, at::Device device, std::vector<at::Tensor> outputs,
                   std::shared_ptr<GpuCompletion> gpu)
    : Work(info.rank, info.opType),
      info_(info),
      device_(device),
      outputs_(std::move(outputs)),
      // The watchdog times GPU work from its own enqueue record, so that it never has to hold the Work.
      deadline_(std::chrono::steady_clock::time_point::max()),
      gpu_(std::move(gpu)) {
  // Its future is made on demand (most callers never ask for one).
}

void WorkSDMA::releaseKeptTensors() {
  // Dropped outside mutex_: freeing a tensor may need the GIL, which a Python caller of this work can hold
  // while it waits for mutex_.
  std::vector<at::Tensor> dropped;
  std::lock_guard<std::mutex> lock(mutex_);
  dropped.swap(keepAlive_);
}

void WorkSDMA::complete(std::exception_ptr error) {
  releaseKeptTensors();
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
  finish(error);
}

bool WorkSDMA::isCompleted() {
#ifdef TORCH_SDMA_CUDA
  if (gpu_) {
    return gpu_->error() || gpu_->pollDone();
  }
#endif
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ || exception_;
}

bool WorkSDMA::isSuccess() const {
  return !exception();
}

std::exception_ptr WorkSDMA::exception() const {
#ifdef TORCH_SDMA_CUDA
  if (gpu_) {
    return gpu_->error();
  }
#endif
  std::lock_guard<std::mutex> lock(mutex_);
  return exception_;
}

std::vector<at::Tensor> WorkSDMA::result() {
  return outputs_;
}

void WorkSDMA::rethrowIfFailed() const {
  if (std::exception_ptr e = exception()) {
    std::rethrow_exception(e);
  }
}

void WorkSDMA::synchronize() {
  // CPU work: nothing to order (and Work::wait calls this with mutex_ held).
  if (!gpu_) {
    return;
  }
  rethrowIfFailed();
#ifdef TORCH_SDMA_CUDA
  auto current = c10::cuda::getCurrentCUDAStream(device_.index());
  gpu::streamWaitEvent(current.stream(), gpu_->endEvent());
  gpu_->releaseTensors();
#endif
}

bool WorkSDMA::wait(std::chrono::milliseconds timeout) {
  if (!gpu_) {
    return Work::wait(timeout);
  }
  if (timeout != kNoTimeout) {
    // An explicit timeout asks for a CPU-side wait, as with WorkNCCL.
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!isCompleted()) {
      TORCH_CHECK(std::chrono::steady_clock::now() < until, "torch_sdma: ", description(),
                  " did not complete within the wait() timeout of ", timeout.count(), " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  synchronize();
  return true;
}

void WorkSDMA::blockCurrentStream() {
  if (gpu_) {
    synchronize();
  } else {
    Work::wait(kNoTimeout);
  }
}

c10::intrusive_ptr<c10::ivalue::Future> WorkSDMA::getFuture() {
#ifdef TORCH_SDMA_CUDA
  if (!gpu_) {
    return future_;
  }
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (!future_) {
    // The CUDA-aware future records its event on the current stream at markCompleted: use a stream that waits
    // for the copies, so DDP comm hooks and then() callbacks are ordered after them without blocking the CPU.
    auto stream = c10::cuda::getStreamFromPool(false, device_.index());
    gpu::streamWaitEvent(stream.stream(), gpu_->endEvent());
    c10::cuda::CUDAStreamGuard guard(stream);
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device_});
    future_->markCompleted(c10::IValue(outputs_));
  }
#endif
  return future_;
}

uint64_t WorkSDMA::getSequencenumber() const {
  return info_.seq;
}

}  // namespace sdma
