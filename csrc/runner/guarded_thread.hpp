// A thread of ours. Whatever its body throws goes to `onEscape` instead of ending the process, which is what
// std::thread does with an escaping exception (std::terminate): no thread of ours may take a training job down.
#pragma once

#include <c10/util/Logging.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace sdma {

class GuardedThread {
 public:
  GuardedThread() = default;
  // `onEscape` receives the escaped exception's message; it runs on this thread and must not throw (if it does,
  // that is logged and dropped).
  GuardedThread(std::function<void()> body, std::function<void(const std::string&)> onEscape)
      : thread_([body = std::move(body), onEscape = std::move(onEscape)] {
          std::string escaped;
          try {
            body();
            return;
          } catch (const std::exception& e) {
            escaped = e.what();
          } catch (...) {
            escaped = "an exception that is not a std::exception";
          }
          try {
            onEscape(escaped);
          } catch (const std::exception& e) {
            LOG(ERROR) << "torch_sdma: a background thread failed (" << escaped
                       << ") and so did its cleanup: " << e.what();
          } catch (...) {
            LOG(ERROR) << "torch_sdma: a background thread failed (" << escaped << ") and so did its cleanup";
          }
        }) {}
  GuardedThread(GuardedThread&&) = default;
  GuardedThread& operator=(GuardedThread&&) = default;
  ~GuardedThread() {
    join();
  }

  void join() {
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  // Sets the loop's `stop` under its mutex, wakes it, and waits for it to end.
  void stopAndJoin(std::mutex& mutex, std::condition_variable& wake, bool& stop) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    wake.notify_all();
    join();
  }

 private:
  std::thread thread_;
};

}  // namespace sdma
