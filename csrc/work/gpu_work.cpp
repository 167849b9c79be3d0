#include "work/gpu_work.hpp"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <thread>

namespace sdma {

GpuWork::GpuWork(const CollectiveInfo& info, at::Device device, std::vector<at::Tensor> outputs,
                 std::shared_ptr<GpuCompletion> completion)
    : SdmaWork(info, std::move(outputs)), device_(device), completion_(std::move(completion)) {}

bool GpuWork::isCompleted() {
  return completion_->error() || completion_->pollDone();
}

std::exception_ptr GpuWork::exception() const {
  return completion_->error();
}

void GpuWork::synchronize() {
  if (std::exception_ptr e = exception()) {
    std::rethrow_exception(e);
  }
  if (!completion_->enqueued()) {
    // Posted by the runner's thread once the peers let it (a pair not connected yet, or a full ring of posts): no
    // event to wait on before then. Bounded by the group's timeout, past which the call fails.
    if (std::exception_ptr e = completion_->waitEnqueued()) {
      std::rethrow_exception(e);
    }
  }
  auto current = c10::cuda::getCurrentCUDAStream(device_.index());
  // A captured collective's event exists only inside its graph; outside the capture the graph orders itself.
  if (!completion_->captured() || gpu::streamCapturing(current.stream())) {
    gpu::streamWaitEvent(current.stream(), completion_->endEvent());
  }
  completion_->releaseTensors();
}

bool GpuWork::wait(std::chrono::milliseconds timeout) {
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

void GpuWork::blockCurrentStream() {
  synchronize();
}

namespace {

// The CUDA-aware future records its event on the current stream at markCompleted: a stream of this file's own per
// device, which waits for the copies first, so DDP comm hooks and then() callbacks are ordered after them without
// blocking the CPU. Not torch's stream pool: the pool is made at its first use, and making it waits for the work
// queued on the GPU (a second's spin ahead held a first getFuture() for that second), where making one stream does
// not. The lock keeps a future's wait and its event together: another future's wait between them would delay it.
struct FutureStreams {
  std::mutex mutex;
  std::map<c10::DeviceIndex, gpu::Stream> byDevice;  // made once, kept for the process's life
};

FutureStreams& futureStreams() {
  static auto* streams = new FutureStreams();  // never destroyed: a future may complete during interpreter exit
  return *streams;
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> GpuWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (!future_) {
    auto& streams = futureStreams();
    std::lock_guard<std::mutex> streamsLock(streams.mutex);
    c10::cuda::CUDAGuard deviceGuard(device_);
    auto [it, made] = streams.byDevice.try_emplace(device_.index(), nullptr);
    if (made) {
      it->second = gpu::createStream();
    }
    if (std::exception_ptr e = completion_->waitEnqueued()) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                         std::vector<c10::Device>{device_});
      future_->setError(e);
      return future_;
    }
    gpu::streamWaitEvent(it->second, completion_->endEvent());
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(it->second), device_.index()));
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       std::vector<c10::Device>{device_});
    future_->markCompleted(c10::IValue(outputs_));
  }
  return future_;
}

}  // namespace sdma
