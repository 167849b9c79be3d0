// How a CPU thread that polls for a peer waits between polls.
#pragma once

#include <sched.h>

#include <chrono>
#include <thread>

namespace sdma {

// `idleFor`: how long the poller has waited so far. It yields while the wait is young (peers are usually a few
// microseconds away), then sleeps, so that idle pollers leave the cores to the processes that have work.
inline void idleBackoff(std::chrono::steady_clock::duration idleFor) {
  if (idleFor < std::chrono::milliseconds(2)) {
    sched_yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace sdma
