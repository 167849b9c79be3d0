#include "work/gpu_completion.hpp"

#include "work/interpreter_exit.hpp"

namespace sdma {

EventPool::~EventPool() {
  for (gpu::Event e : free_) {
    gpu::destroyEvent(e);
  }
}

gpu::Event EventPool::take() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!free_.empty()) {
      gpu::Event e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  return gpu::createEvent();
}

void EventPool::giveBack(gpu::Event event) {
  // Safe to record again at once: a stream that waits on it captured the record it waited for.
  std::lock_guard<std::mutex> lock(mutex_);
  free_.push_back(event);
}

GpuCompletion::GpuCompletion(gpu::Event end, std::shared_ptr<EventPool> pool, std::vector<at::Tensor> keepAlive,
                             bool captured, bool enqueued)
    : end_(end),
      pool_(std::move(pool)),
      captured_(captured),
      done_(captured),
      enqueued_(enqueued),
      keepAlive_(std::move(keepAlive)) {}

GpuCompletion::~GpuCompletion() {
  pool_->giveBack(end_);
  // Normally released already; the watchdog may hold the last reference.
  if (!keepAlive_.empty()) {
    InterpreterExit::drop(keepAlive_);
  }
}

bool GpuCompletion::pollDone() {
  // An event never recorded counts as fired: a call not yet enqueued has not begun.
  if (!done_.load(std::memory_order_acquire) && enqueued() && gpu::eventDone(end_)) {
    releaseTensors();
    done_.store(true, std::memory_order_release);
  }
  return done_.load(std::memory_order_acquire);
}

void GpuCompletion::markEnqueued() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    enqueued_.store(true, std::memory_order_release);
  }
  settled_.notify_all();
}

std::exception_ptr GpuCompletion::waitEnqueued() {
  std::unique_lock<std::mutex> lock(mutex_);
  settled_.wait(lock, [this] { return enqueued() || error_; });
  return error_;
}

void GpuCompletion::releaseTensors() {
  // Destroyed outside mutex_: freeing a tensor may need the GIL, which a Python caller of error() can hold. Called
  // from the watchdog too, so kept once the interpreter exits (interpreter_exit.hpp).
  std::vector<at::Tensor> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(keepAlive_);
  }
  if (!dropped.empty()) {  // a synchronous call's completion keeps nothing: no atomics on its path
    InterpreterExit::drop(dropped);
  }
}

void GpuCompletion::fail(std::exception_ptr error, bool releaseKept) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    if (!releaseKept) {
      // Deliberately leaked: freeing memory a copy engine may still write into would corrupt whatever the
      // caching allocator puts there next.
      new std::vector<at::Tensor>(std::move(keepAlive_));
      keepAlive_.clear();
    }
  }
  settled_.notify_all();
  releaseTensors();
}

void GpuCompletion::setError(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
  }
  settled_.notify_all();
}

std::exception_ptr GpuCompletion::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

}  // namespace sdma
