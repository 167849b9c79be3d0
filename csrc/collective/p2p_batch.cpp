#include "collective/p2p_batch.hpp"

#include "collective/pair_steps.hpp"

namespace sdma {
namespace {

uint64_t bytesOf(const at::Tensor& t) {
  return t.defined() ? static_cast<uint64_t>(t.numel()) * t.element_size() : 0;
}

std::string directionWords(uint64_t directions, uint64_t sends, uint64_t expects) {
  switch (directions & (kStepSends | kStepReceives)) {
    case kStepSends:
      return "a send of " + std::to_string(sends) + " bytes";
    case kStepReceives:
      return "a recv of " + std::to_string(expects) + " bytes";
    case kStepSends | kStepReceives:
      return "a send of " + std::to_string(sends) + " bytes and a recv of " + std::to_string(expects) + " bytes";
    default:
      return "nothing";
  }
}

}  // namespace

std::vector<PairStep> pairStepsOf(const std::vector<P2pOp>& ops, int rank) {
  std::vector<PairStep> steps;
  for (const PairStepOps& s : pairStepOpsOf(ops, rank)) {
    steps.push_back(
        {s.peer, s.send >= 0 ? ops[s.send].tensor : at::Tensor(), s.recv >= 0 ? ops[s.recv].tensor : at::Tensor()});
  }
  return steps;
}

ExchangePlan pairPlanOf(const PairStep& step, int me) {
  ExchangePlan plan;
  const int peer = 1 - me;
  plan.sendTo.assign(2, ByteRange{});
  plan.recvFrom.assign(2, ByteRange{});
  plan.sendTo[peer] = {0, bytesOf(step.send)};
  plan.recvFrom[peer] = {0, bytesOf(step.recv)};
  if (step.send.defined()) {
    plan.input = static_cast<const char*>(step.send.data_ptr());
    plan.inputBytes = bytesOf(step.send);
  }
  if (step.recv.defined()) {
    plan.output = static_cast<char*>(step.recv.data_ptr());
    plan.outputBytes = bytesOf(step.recv);
  }
  return plan;
}

std::string pairStepDisagreement(int rank, int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                                 uint64_t peerDirections, const PairRanges& peers) {
  const bool directionsMeet = ((myDirections & kStepSends) != 0) == ((peerDirections & kStepReceives) != 0) &&
                              ((myDirections & kStepReceives) != 0) == ((peerDirections & kStepSends) != 0);
  if (directionsMeet && mine.sends.bytes == peers.expects.bytes && peers.sends.bytes == mine.expects.bytes) {
    return "";
  }
  return "the point-to-point operations of group ranks " + std::to_string(rank) + " and " + std::to_string(peer) +
         " do not match: as their operation number " + std::to_string(serial) + " with each other, group rank " +
         std::to_string(rank) + " posted " + directionWords(myDirections, mine.sends.bytes, mine.expects.bytes) +
         " and group rank " + std::to_string(peer) + " posted " +
         directionWords(peerDirections, peers.sends.bytes, peers.expects.bytes) +
         "; each send must meet a recv of the same size, in the same order on both ranks, and nothing was copied";
}

std::string pairStepRefusal(int rank, int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                            uint64_t peerDirections, const std::string& why) {
  std::string refused;
  switch (peerDirections & (kStepSends | kStepReceives)) {
    case kStepSends:
      refused = "send";
      break;
    case kStepReceives:
      refused = "recv";
      break;
    default:
      refused = "batch_isend_irecv";
  }
  return "group rank " + std::to_string(peer) + " refused its " + refused + " with group rank " + std::to_string(rank) +
         " on its own arguments (its error says why) while group rank " + std::to_string(rank) + " posted " +
         directionWords(myDirections, mine.sends.bytes, mine.expects.bytes) + ", as their operation number " +
         std::to_string(serial) + " with each other; an operation one rank refuses fails on both ranks" +
         (why.empty() ? "" : "; its error: " + why);
}

}  // namespace sdma
