// What the watchdog tracks of a GPU all-gather in flight: the event after its last copy, the tensors that must
// outlive the copies, and its error if it failed.
//
// Shared by the Work and the watchdog so that the watchdog never holds the Work: a caller that drops its Work frees
// the output tensors at once, in its own thread, as with WorkNCCL. (When the watchdog held the Work, every output
// stayed alive until the GPU reached it; FSDP2's CPU runs layers ahead of the GPU, and its peak memory grew by
// about seven all-gather buffers.)
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "gpu/gpu_api.hpp"

namespace sdma {

// End events for reuse: creating one per all-gather is a driver call on the caller's thread, in the enqueue
// path whose CPU cost is measured against NCCL's. Shared by the runner and every completion, so an event comes back
// even when the Work outlives its group.
class EventPool {
 public:
  EventPool() = default;
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  gpu::Event take();
  void giveBack(gpu::Event event);

 private:
  std::mutex mutex_;
  std::vector<gpu::Event> free_;
};

class GpuCompletion {
 public:
  // Owns `end` until it returns it to `pool`. `keepAlive`: tensors the copies touch that nothing else keeps alive
  // for long enough (async calls); empty when the caller's stream already orders the allocator.
  // `captured`: recorded inside a CUDA graph capture, so it never fires on its own (only replays run the copies);
  // the CPU counts it complete at once and only a stream inside the same capture waits for it.
  // `enqueued` false: a thread of the runner's records `end` later (markEnqueued), once the call's peers let it post;
  // until then the call is not complete and a wait on it blocks the CPU (waitEnqueued).
  GpuCompletion(gpu::Event end, std::shared_ptr<EventPool> pool, std::vector<at::Tensor> keepAlive,
                bool captured = false, bool enqueued = true);
  ~GpuCompletion();
  GpuCompletion(const GpuCompletion&) = delete;
  GpuCompletion& operator=(const GpuCompletion&) = delete;

  gpu::Event endEvent() const {
    return end_;
  }
  bool captured() const {
    return captured_;
  }
  // Never blocks: true once the end event fired; the kept tensors are dropped then.
  bool pollDone();
  // The end event is recorded after the call's last copy: streams may wait on it from now on.
  void markEnqueued();
  bool enqueued() const {
    return enqueued_.load(std::memory_order_acquire);
  }
  // Blocks until markEnqueued() or an error; returns the error, if any.
  std::exception_ptr waitEnqueued();
  // The caller's stream now waits for the copies: memory it frees from here on is reused after them.
  void releaseTensors();

  // `releaseTensors` false: the copies may still be running, so the kept tensors are never freed.
  void fail(std::exception_ptr error, bool releaseTensors = true);
  // The call failed while its copies may still run: wait() and isCompleted() report `error` from now on, and the kept
  // tensors stay until the end event fires (pollDone).
  void setError(std::exception_ptr error);
  std::exception_ptr error() const;

 private:
  const gpu::Event end_;
  const std::shared_ptr<EventPool> pool_;
  const bool captured_;
  std::atomic<bool> done_{false};
  std::atomic<bool> enqueued_;
  mutable std::mutex mutex_;
  std::condition_variable settled_;  // enqueued or failed
  std::vector<at::Tensor> keepAlive_;
  std::exception_ptr error_;
};

}  // namespace sdma
