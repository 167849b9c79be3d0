// The case loop and the report that the model checks of tests/cpp/ share: the design must pass every case ("ok N",
// exit 0; the first failure on stderr, exit 1); a wrong variant or a limit runs every case and counts what it catches
// per kind ("caught N of CASES cases: <kind> <count>; ...", exit 1 where N > 0), the first case of each kind on
// stderr, or every one with `everyCase`.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>

namespace model {

struct CaseFailure {
  std::string kind;
  std::string line;  // the case and what failed in it, after "seed S case I "
};

// runCase(i) -> std::optional<CaseFailure>.
template <typename RunCase>
int reportCases(uint64_t seed, int cases, bool mustPass, bool everyCase, RunCase&& runCase) {
  std::map<std::string, int> caught;
  int total = 0;
  for (int i = 0; i < cases; ++i) {
    const std::optional<CaseFailure> f = runCase(i);
    if (!f) {
      continue;
    }
    const std::string line = "seed " + std::to_string(seed) + " case " + std::to_string(i) + " " + f->line;
    if (mustPass) {
      fprintf(stderr, "FAIL: %s\n", line.c_str());
      return 1;
    }
    if (caught[f->kind]++ == 0 || everyCase) {
      fprintf(stderr, "FAIL: %s\n", line.c_str());
    }
    ++total;
  }
  if (mustPass) {
    printf("ok %d\n", cases);
    return 0;
  }
  printf("caught %d of %d cases:", total, cases);
  for (const auto& [kind, count] : caught) {
    printf(" %s %d;", kind.c_str(), count);
  }
  printf("\n");
  return total > 0 ? 1 : 0;
}

}  // namespace model
