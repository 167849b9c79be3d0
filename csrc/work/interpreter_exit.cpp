#include "work/interpreter_exit.hpp"

#include <atomic>
#include <chrono>
#include <thread>

namespace sdma {
namespace {

// Sequentially consistent, so that of a DropScope that counts itself in and then reads `closed`, and a close() that
// sets `closed` and then reads the count, at least one sees the other's write: either the scope is refused or
// close() waits for it.
std::atomic<bool> closed{false};
std::atomic<int> inside{0};

}  // namespace

InterpreterExit::DropScope::DropScope() {
  inside.fetch_add(1);
  open_ = !closed.load();
  if (!open_) {
    inside.fetch_sub(1);
  }
}

InterpreterExit::DropScope::~DropScope() {
  if (open_) {
    inside.fetch_sub(1);
  }
}

void InterpreterExit::close() {
  closed.store(true);
  while (inside.load() != 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace sdma
