// Test-only knobs of where the shared-memory runner runs a collective, read once when a runner starts:
//   TORCH_SDMA_TEST_SYNC_ON_CALLER=1  a synchronous all-gather runs its operations on the calling thread instead of
//                                     the group's worker, as a GPU's runs on the caller's current stream while an
//                                     async one runs on the group's internal stream; so the CPU path can meet the
//                                     ordering problems of the GPU path.
//   TORCH_SDMA_TEST_UNORDERED=1       a collective no longer waits for the group's earlier ones that another thread
//                                     runs (call_ticket.hpp), so that a test can show the ordering is what keeps the
//                                     caller-thread mode right.
#pragma once

#include <cstdlib>
#include <cstring>

namespace sdma {

inline bool testKnobOn(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "1") == 0;
}

inline bool testSyncOnCallerRequested() {
  return testKnobOn("TORCH_SDMA_TEST_SYNC_ON_CALLER");
}

inline bool testUnorderedRequested() {
  return testKnobOn("TORCH_SDMA_TEST_UNORDERED");
}

}  // namespace sdma
