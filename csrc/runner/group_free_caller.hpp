// Runs a call on a thread of its own and waits for it: for the rail's NCCL gathers of the hierarchical all-gather.
// NCCL groups belong to a thread. Inside a coalescing block the caller's thread has one open (ProcessGroupNCCL's
// startCoalescing calls ncclGroupStart, and so does ours through the inner backend), and NCCL would defer the rail's
// gather to the group's end, after the copies that read what it gathered: peers' slots arrived as zeros on 2x H200.
// A thread of our own never has a group open.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>

#include "runner/guarded_thread.hpp"

namespace sdma {

class GroupFreeCaller {
 public:
  GroupFreeCaller()
      : thread_([this] { loop(); },
                [](const std::string& why) { LOG(ERROR) << "torch_sdma: the rail's calling thread ended: " << why; }) {}
  ~GroupFreeCaller() {
    thread_.stopAndJoin(mutex_, wake_, stop_);
  }
  GroupFreeCaller(const GroupFreeCaller&) = delete;
  GroupFreeCaller& operator=(const GroupFreeCaller&) = delete;

  // Runs `call` there and returns when it has returned; rethrows what it threw.
  void run(std::function<void()> call) {
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = std::move(call);
    failure_ = nullptr;
    done_ = false;
    wake_.notify_all();
    wake_.wait(lock, [this] { return done_; });
    if (failure_) {
      std::rethrow_exception(failure_);
    }
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || task_; });
      if (stop_) {
        return;
      }
      std::function<void()> call = std::move(task_);
      task_ = nullptr;
      lock.unlock();
      std::exception_ptr failure;
      try {
        call();
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      failure_ = failure;
      done_ = true;
      wake_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::function<void()> task_;
  std::exception_ptr failure_;
  bool done_ = false;
  bool stop_ = false;
  GuardedThread thread_;  // last: starts after the state it reads
};

}  // namespace sdma
