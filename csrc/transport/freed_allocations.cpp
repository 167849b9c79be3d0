#include "transport/freed_allocations.hpp"

#include <mutex>

namespace sdma {
namespace {

// Enough for the frees of an empty_cache() between two collectives of a group; a reader further behind rechecks.
constexpr uint64_t kRemembered = 4096;

struct FreedLog {
  std::mutex mutex;
  uint64_t noted = 0;
  uint64_t bases[kRemembered] = {};
};

FreedLog& freedLog() {
  static auto* log = new FreedLog();  // never destroyed: allocators free into it during exit
  return *log;
}

}  // namespace

void noteAllocationFreed(uint64_t base) {
  FreedLog& log = freedLog();
  std::lock_guard<std::mutex> lock(log.mutex);
  log.bases[log.noted % kRemembered] = base;
  ++log.noted;
}

FreedAllocationReader::FreedAllocationReader() {
  FreedLog& log = freedLog();
  std::lock_guard<std::mutex> lock(log.mutex);
  cursor_ = log.noted;
}

bool FreedAllocationReader::readNew(std::vector<uint64_t>* bases) {
  FreedLog& log = freedLog();
  std::lock_guard<std::mutex> lock(log.mutex);
  bool complete = true;
  if (log.noted - cursor_ > kRemembered) {
    cursor_ = log.noted - kRemembered;
    complete = false;
  }
  for (; cursor_ < log.noted; ++cursor_) {
    bases->push_back(log.bases[cursor_ % kRemembered]);
  }
  return complete;
}

}  // namespace sdma
