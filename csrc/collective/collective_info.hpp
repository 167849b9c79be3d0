// What a runner needs to know about the collective it runs, for ordering, deadlines and error messages.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>

namespace sdma {

struct CollectiveInfo {
  c10d::OpType opType;
  const char* op;  // the user-facing name, e.g. "all_gather_into_tensor"
  uint64_t seq;
  std::string groupName;
  int rank;
  int size;
  std::chrono::milliseconds timeout;

  // Built only when a message needs it: formatting it on every call would cost more than a driver call.
  std::string describe() const {
    return std::string(op) + " (sequence number " + std::to_string(seq) + " on group '" + groupName + "', rank " +
           std::to_string(rank) + " of " + std::to_string(size) + ")";
  }
};

}  // namespace sdma
