// Ends the way a watchdog that finds a failure after its call returned ends the process (async_error_exit.hpp), so
// that test_async_error_exit.py can read its status, its stderr and what ran on the way out.
#include <cstdio>
#include <cstdlib>

#include "runner/async_error_exit.hpp"

struct SaysWhenDestroyed {
  ~SaysWhenDestroyed() {
    std::fputs("a destructor ran\n", stderr);
  }
};

int main() {
  static SaysWhenDestroyed global;
  std::atexit([] { std::fputs("an atexit handler ran\n", stderr); });
  const bool on = sdma::exitsOnAsyncError();
  std::printf("%s\n", on ? "on" : "off");
  std::fflush(stdout);
  if (on) {
    sdma::exitOnAsyncError("all_to_all_single (sequence number 2 on group '0', rank 0 of 2) timed out after 5 ms.",
                           {"all_to_all_single (sequence number 2)", "broadcast (sequence number 3)"});
  }
  return 0;
}
