// Test-only: TORCH_SDMA_TEST_FAULT=<place> makes one of our threads throw at <place>, so that tests can check what a
// user sees when a background thread fails (the collectives it concerns fail with its message; the process lives).
// Read once, when a runner starts. Places: "watchdog" (the copy-engine runner's), "worker" (the shared-memory
// runner's).
#pragma once

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace sdma {

inline bool testFaultRequested(const char* place) {
  const char* v = std::getenv("TORCH_SDMA_TEST_FAULT");
  return v && std::strcmp(v, place) == 0;
}

[[noreturn]] inline void throwTestFault(const char* place) {
  throw std::runtime_error(std::string("injected fault (TORCH_SDMA_TEST_FAULT=") + place + ")");
}

}  // namespace sdma
