// What a runner needs to know about the collective it runs, for ordering, deadlines and error messages.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>

namespace sdma {

struct CollectiveInfo {
  c10d::OpType opType;
  uint64_t seq;
  std::string description;  // e.g. "all-gather _allgather_base (seq 12, group '3', rank 0 of 2)"
  std::chrono::milliseconds timeout;
};

}  // namespace sdma
