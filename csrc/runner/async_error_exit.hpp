// What a failure found after its call returned does to the process (docs/design.md, "Failures", the exit): a GPU
// call's stream runs on once the peers release its waits, and the kernels queued behind it would read an output
// that never got its bytes. Under TORCH_SDMA_ASYNC_ERROR_HANDLING=1 (the default, as NCCL's
// TORCH_NCCL_ASYNC_ERROR_HANDLING) the thread that finds such a failure names it and the calls in flight on stderr
// and ends the process with kAsyncErrorExitStatus before anything releases those waits; torchrun sees a worker that
// exited with an error and restarts the job. Under 0 the process goes on: the failed calls' outputs are undefined
// and the group refuses further calls.
#pragma once

#include <string>
#include <vector>

namespace sdma {

// EX_TEMPFAIL: a failure a restart may not meet again.
constexpr int kAsyncErrorExitStatus = 75;

// TORCH_SDMA_ASYNC_ERROR_HANDLING, read once per process (the Python side refuses values other than 0 and 1 when a
// group is created); only the failure paths ask.
bool exitsOnAsyncError();

// One line on stderr naming `failure` and `inFlight` (each call's describe()), then std::_Exit: no destructor, no
// atexit handler and no other thread of ours runs after it, so nothing releases a stream's wait on the way out.
[[noreturn]] void exitOnAsyncError(const std::string& failure, const std::vector<std::string>& inFlight);

// The calls (or batches) in flight as exitOnAsyncError names them: each one's info.describe().
template <typename Calls>
std::vector<std::string> describeEach(const Calls& calls) {
  std::vector<std::string> out;
  for (const auto& c : calls) {
    out.push_back(c.info.describe());
  }
  return out;
}

}  // namespace sdma
