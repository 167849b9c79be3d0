// The parent's side of the multi-process C++ tests: each rank is a fork() of the test that ends with _exit().
#pragma once

#include <sys/wait.h>

#include <cstdio>

// Waits for `count` forked ranks; true when every one exited with status 0, else says so on stderr.
inline bool forkedRanksSucceeded(int count) {
  bool ok = true;
  for (int r = 0; r < count; ++r) {
    int status = 0;
    wait(&status);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) {
    fprintf(stderr, "a rank failed\n");
  }
  return ok;
}
