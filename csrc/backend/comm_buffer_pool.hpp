// The backend's communication buffers (Backend::allocateTensor, what FSDP2 asks for after
// set_allocate_memory_from_process_group_for_comm): a caching-allocator MemPool whose segments are VMM memory
// exported as file descriptors, so that the direct path's peers map them at full NVLink speed (legacy IPC, which
// plain cudaMalloc segments need, pushed at ~75% of it into staging on H200). The caching allocator keeps its stream
// semantics for these tensors; only the memory under them differs.
#pragma once

#include <ATen/ATen.h>

#include <memory>

namespace sdma {

class CommBufferPool {
 public:
  explicit CommBufferPool(int device);
  ~CommBufferPool();
  CommBufferPool(const CommBufferPool&) = delete;
  CommBufferPool& operator=(const CommBufferPool&) = delete;

  // A 1-D tensor of `numel` elements from the pool (at::empty's contents: uninitialised).
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options);
  int device() const {
    return device_;
  }

 private:
  struct Pool;
  const int device_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace sdma
