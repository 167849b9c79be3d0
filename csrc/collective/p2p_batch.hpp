// Point-to-point as two-rank exchanges (docs/design.md, "Point-to-point"). A batch (batch_isend_irecv, or one send or
// recv alone) reduces to steps, one per pair exchange: with each peer, the k-th send of the batch to it and the k-th
// recv from it form one step, its k-th; the peer forms the same steps from its own operations, so that a send meets
// the recv that NCCL would match with it (per direction, in call order). A step is one ExchangePlan on the pair's own
// transport, whose ranks are the pair's members in group-rank order.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "collective/exchange_plan.hpp"

namespace sdma {

struct P2pOp {
  int peer = -1;  // group rank
  bool isSend = false;
  at::Tensor tensor;
  int tag = 0;  // for the inner backend, where the pair takes it (the DMA path matches by order alone, as NCCL does)
};

struct PairStep {
  int peer = -1;
  at::Tensor send;  // undefined where the step only receives
  at::Tensor recv;  // undefined where the step only sends
};

// The steps of `ops` (pair_steps.hpp), each peer's in its operations' order, the peers in the order of their pairs
// (lo, hi) ascending: connecting the pairs in that order on every rank never waits in a cycle.
std::vector<PairStep> pairStepsOf(const std::vector<P2pOp>& ops, int rank);

// Whether steps[i] opens its peer's run of steps (pairStepsOf puts a peer's steps side by side).
inline bool opensPeerRun(const std::vector<PairStep>& steps, size_t i) {
  return i == 0 || steps[i].peer != steps[i - 1].peer;
}

// The tensors of a batch's steps: what its Work returns (every recv) and what its copies touch (every send and recv).
struct StepTensors {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> keepAlive;
};
inline StepTensors tensorsOf(const std::vector<PairStep>& steps) {
  StepTensors out;
  for (const PairStep& step : steps) {
    for (const at::Tensor& t : {step.send, step.recv}) {
      if (t.defined()) {
        out.keepAlive.push_back(t);
      }
    }
    if (step.recv.defined()) {
      out.outputs.push_back(step.recv);
    }
  }
  return out;
}

// What a step posts in the mailbox's bytes word: which directions this rank moves, so that two sends (or two recvs)
// that meet are refused even at zero bytes.
constexpr uint64_t kStepSends = 1;
constexpr uint64_t kStepReceives = 2;
// Posted with the directions the op would have moved where this rank refused it on its own arguments: the step takes
// its serial all the same, so that the peer's op of that serial fails instead of meeting this rank's next op.
constexpr uint64_t kStepRefused = 4;
inline uint64_t directionsOf(const PairStep& step) {
  return (step.send.defined() ? kStepSends : 0) | (step.recv.defined() ? kStepReceives : 0);
}

// The step as an exchange on the pair's transport: this rank is pair rank `me` (0 or 1), the peer 1 - me.
ExchangePlan pairPlanOf(const PairStep& step, int me);

// "" where the two sides of a step agree (this rank's `mine`, the peer's posted directions and ranges), else the
// words that name both ranks, what each passed, and the step's place among the pair's operations.
std::string pairStepDisagreement(int rank, int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                                 uint64_t peerDirections, const PairRanges& peers);

// The words for a step whose peer posted kStepRefused, as the call board words a refused collective: which rank
// refused, what each side posted, and `why` (the refuser's own error, "" where it could not be read).
std::string pairStepRefusal(int rank, int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                            uint64_t peerDirections, const std::string& why);

}  // namespace sdma
