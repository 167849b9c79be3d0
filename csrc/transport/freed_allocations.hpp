// Process-wide and in order: the base addresses of device allocations this process has given back (the caching
// allocator's segments, the communication buffer pool's, bounce areas). A peer that mapped one of them holds its
// memory until it unmaps it, so the direct path's exporter reads this log to tell its peers which of their
// mappings now name nothing here (retired_segments.hpp): their mappings of this process stay bounded by what is live.
#pragma once

#include <cstdint>
#include <vector>

namespace sdma {

// Thread-safe and cheap: it runs inside the caching allocator's lock, so it takes no lock of anything else.
void noteAllocationFreed(uint64_t base);

// One reader's place in the log: it sees the frees noted after it was made.
class FreedAllocationReader {
 public:
  FreedAllocationReader();
  // Appends the bases freed since the last call. False when the log dropped some of them before this reader read
  // them (it keeps the newest few thousand): the caller must then check every allocation it exported.
  bool readNew(std::vector<uint64_t>* bases);

 private:
  uint64_t cursor_;
};

}  // namespace sdma
