// "[0, 2, 3]": the ranks an error message or a log line names. Free of torch, so the schedule tests can use it.
#pragma once

#include <string>
#include <vector>

namespace sdma {

inline std::string rankList(const std::vector<int>& ranks, const char* separator = ", ") {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    out += (i ? separator : "") + std::to_string(ranks[i]);
  }
  return out + "]";
}

}  // namespace sdma
