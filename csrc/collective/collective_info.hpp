// What a runner needs to know about the collective it runs, for ordering, deadlines and error messages.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>

#include "transport/call_board.hpp"

namespace sdma {

struct CollectiveInfo {
  c10d::OpType opType;
  const char* op;  // the user-facing name, e.g. "all_gather_into_tensor"
  uint64_t seq;
  std::string groupName;
  int rank;
  int size;
  std::chrono::milliseconds timeout;
  // The group's call board and what this rank posted on it for `seq` (null where the group has none): whatever
  // watches the call in flight fails it once a peer's post for `seq` differs (call_board.hpp).
  CallBoard* board = nullptr;
  CallPost post;

  // Built only when a message needs it: formatting it on every call would cost more than a driver call.
  std::string describe() const {
    return std::string(op) + " (sequence number " + std::to_string(seq) + " on group '" + groupName + "', rank " +
           std::to_string(rank) + " of " + std::to_string(size) + ")";
  }
  // The words naming a peer that posted another call for `seq` (call_board.hpp), or "" while none did. Any thread.
  std::string callMismatch() const {
    if (!board) {
      return "";
    }
    const CallBoard::Differing d = board->differing(seq, post);
    return d ? board->describe(seq, post, d) : "";
  }
};

}  // namespace sdma
