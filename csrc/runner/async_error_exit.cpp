#include "runner/async_error_exit.hpp"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace sdma {

bool exitsOnAsyncError() {
  static const bool on = [] {
    const char* raw = std::getenv("TORCH_SDMA_ASYNC_ERROR_HANDLING");
    if (raw == nullptr) {
      return true;
    }
    std::string v(raw);
    const size_t first = v.find_first_not_of(" \t");
    const size_t last = v.find_last_not_of(" \t");
    return first == std::string::npos || v.substr(first, last - first + 1) != "0";
  }();
  return on;
}

void exitOnAsyncError(const std::string& failure, const std::vector<std::string>& inFlight) {
  std::string line = "torch_sdma: " + failure + " Calls in flight on it: ";
  for (size_t i = 0; i < inFlight.size(); ++i) {
    line += (i ? "; " : "") + inFlight[i];
  }
  if (inFlight.empty()) {
    line += "none";
  }
  line += ". The process exits with status " + std::to_string(kAsyncErrorExitStatus) +
          " before its streams run on, so that no later work reads their outputs as complete "
          "(TORCH_SDMA_ASYNC_ERROR_HANDLING=0 keeps it running, with those outputs undefined).\n";
  // One write: the line is whole in a log where other ranks' lines meet it.
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n <= 0) {
      break;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  std::_Exit(kAsyncErrorExitStatus);
}

}  // namespace sdma
