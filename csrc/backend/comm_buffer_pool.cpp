#include "backend/comm_buffer_pool.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#if __has_include(<ATen/cuda/MemPool.h>)
#include <ATen/cuda/MemPool.h>
#endif

#include <thread>
#include <type_traits>

#include "gpu/gpu_api.hpp"
#include "transport/shareable_allocations.hpp"

namespace sdma {
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

#if __has_include(<ATen/cuda/MemPool.h>)
using MemPool = at::cuda::MemPool;
#else
using MemPool = c10::cuda::MemPool;
#endif

// One for the process, never destroyed: the caching allocator may free a pool's segments through it at any time,
// even after the backend that made the pool is gone.
const std::shared_ptr<alloc::CUDAAllocator>& shareableSegments() {
  static auto* allocator =
      new std::shared_ptr<alloc::CUDAAllocator>(torch::cuda::CUDAPluggableAllocator::createCustomAllocator(
          [](size_t bytes, int device, cudaStream_t) -> void* {
            gpu::SharedAllocation a;
            const std::string error = gpu::allocateShareable(device, bytes, &a);
            TORCH_CHECK(error.empty(), "torch_sdma: allocating ", bytes,
                        " bytes of shareable memory for communication buffers failed: ", error);
            rememberShareable(a);
            return a.ptr;
          },
          [](void* ptr, size_t, int device, cudaStream_t) {
            // cudaFree waits for the device; unmapping does not, and work on any stream may still use the segment.
            gpu::syncDevice(device);
            gpu::SharedAllocation a;
            if (forgetShareable(ptr, &a)) {
              gpu::freeShareable(&a);
            }
          }));
  return *allocator;
}

// torch 2.9's MemPool takes the allocator by raw pointer, later versions by shared_ptr.
std::unique_ptr<MemPool> poolOver(const std::shared_ptr<alloc::CUDAAllocator>& allocator) {
  if constexpr (std::is_constructible_v<MemPool, std::shared_ptr<alloc::CUDAAllocator>>) {
    return std::make_unique<MemPool>(allocator);
  } else {
    return std::make_unique<MemPool>(allocator.get());
  }
}

}  // namespace

struct CommBufferPool::Pool {
  std::unique_ptr<MemPool> pool;
};

CommBufferPool::CommBufferPool(int device) : device_(device), pool_(std::make_unique<Pool>()) {
  c10::cuda::CUDAGuard guard(device_);
  pool_->pool = poolOver(shareableSegments());
}

CommBufferPool::~CommBufferPool() = default;

at::Tensor CommBufferPool::allocate(int64_t numel, const at::TensorOptions& options) {
  c10::cuda::CUDAGuard guard(device_);
  const auto id = pool_->pool->id();
  const auto thread = std::this_thread::get_id();
  // As torch.cuda.use_mem_pool does: this thread's allocations go to the pool until the end, and the pool's use count
  // taken by the beginning is given back.
  alloc::beginAllocateToPool(device_, id, [thread](cudaStream_t) { return std::this_thread::get_id() == thread; });
  struct End {
    int device;
    c10::MempoolId_t id;
    ~End() {
      alloc::endAllocateToPool(device, id);
      alloc::releasePool(device, id);
    }
  } end{device_, id};
  return at::empty({numel}, options.device(at::Device(at::kCUDA, device_)));
}

}  // namespace sdma
