// What torch's profiler and the execution-trace tools read about a collective, recorded the way ProcessGroupNCCL
// records its own: a "sdma:<collective>" range (NCCL's names after its "nccl:" prefix) around the call, and inside
// it a record_param_comms event carrying the collective's name, element counts, dtype, split sizes and group (what
// Holistic Trace Analysis, Chakra and the profiler's distributed view look for). The copies a DMA collective
// enqueues inside the range show up as GPU memcpy events correlated with it. Nothing is built while no profiler
// callback is registered, so a call costs one check then.
#pragma once

#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/ParamCommsUtils.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "transport/call_board.hpp"

namespace sdma {

// How one kind of collective is named: in sdma's stats ("delegated:<stats>"), in the trace range ("sdma:<trace>",
// NCCL's profiling title), in record_param_comms (NCCL's collective name) and on the group's call board (kNone:
// point to point, which only two ranks make and so is not posted).
struct CollectiveNames {
  const char* stats;
  const char* trace;
  const char* comms;
  CallOp call = CallOp::kNone;
};

// The group as record_param_comms describes it (its description comes from torch after creation, so apart).
struct TracedGroup {
  std::string name;
  int rank = 0;
  int size = 0;
  int globalRankStart = 0;
  int globalRankStride = 1;
};

inline const std::vector<int64_t> kNoSplits;

// What is traced of one call. Only references and numbers: the strings are built once a profiler listens.
struct TracedCollective {
  const CollectiveNames& names;
  const std::vector<at::Tensor>& inputs;
  const std::vector<at::Tensor>& outputs;
  const std::vector<int64_t>& inSplit = kNoSplits;
  const std::vector<int64_t>& outSplit = kNoSplits;
  const char* comms = nullptr;  // record_param_comms' name where it is not names.comms
  const char* arrow = nullptr;  // point-to-point: "->" or "<-" between this rank and `peer` in the title
  int rank = 0;
  int peer = 0;

  // "sdma:all_reduce", "sdma:send 0->1"
  std::string title() const {
    std::string t = std::string("sdma:") + names.trace;
    if (arrow) {
      t += " " + std::to_string(rank) + arrow + std::to_string(peer);
    }
    return t;
  }
};

inline int64_t totalNumel(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += t.numel();
  }
  return n;
}

template <typename Fn>
auto runTraced(const TracedGroup& group, const std::string& groupDesc, uint64_t seq, const TracedCollective& c,
               Fn&& fn) -> decltype(fn()) {
  if (C10_LIKELY(!at::hasCallbacks())) {
    return fn();
  }
  std::vector<c10::IValue> args(c.inputs.begin(), c.inputs.end());
  const std::string title = c.title();
  RECORD_FUNCTION(title.c_str(), args);
  // A scope of its own: both macros declare a `guard`.
  return [&] {
    const auto& some = c.inputs.empty() ? c.outputs : c.inputs;
    RECORD_PARAM_COMMS_DATA(static_cast<int64_t>(seq), std::make_tuple(group.name, groupDesc), c.inputs, c.outputs,
                            group.rank, c.comms ? c.comms : c.names.comms, totalNumel(c.inputs), totalNumel(c.outputs),
                            some.empty() ? at::kByte : some.front().scalar_type(), c.inSplit, c.outSplit,
                            group.globalRankStart, group.globalRankStride, group.size);
    return fn();
  }();
}

}  // namespace sdma
