// What threads of ours let go of once the Python interpreter exits: nothing.
//
// Letting go of the last reference of a tensor whose Python object Python already dropped takes the GIL (torch
// keeps such an object alive for as long as the tensor lives, and releases it then), and a future's callbacks may be
// Python. Once the interpreter finalizes, CPython ends a thread that asks for the GIL with pthread_exit; its forced
// unwind meets a noexcept destructor, std::terminate follows, and a script that ended with all-gathers in flight dies
// by SIGABRT instead of exiting with its own status.
//
// So `import torch_sdma` registers a hook with Python's atexit, which runs before finalization begins. It closes this
// gate with the GIL released: it waits until no thread is inside a DropScope (one that is inside may be waiting for
// the GIL, and gets it), and from then on every DropScope is refused, so that our threads keep what they would have
// let go of (the process is ending). Without Python (C++ use) the gate never closes and everything is freed as usual.
#pragma once

#include <memory>
#include <utility>

namespace sdma {

class InterpreterExit {
 public:
  // A stretch of code that may let go of tensors or run a future's callbacks: closing the gate waits for it.
  class DropScope {
   public:
    DropScope();
    ~DropScope();
    DropScope(const DropScope&) = delete;
    DropScope& operator=(const DropScope&) = delete;
    // False once the gate closed: keep everything, run no callback.
    bool open() const {
      return open_;
    }

   private:
    bool open_;
  };

  // The atexit hook; called without the GIL. Returns once no thread is inside a DropScope.
  static void close();

  // Lets go of what `held` holds, or keeps it for the rest of the process once the gate closed. `held` is empty after.
  template <typename T>
  static void drop(T& held) {
    DropScope scope;
    T gone = std::move(held);
    if (!scope.open()) {
      new T(std::move(gone));  // deliberately never freed
    }
  }
};

}  // namespace sdma
