#include "collective/p2p_batch.hpp"

#include <algorithm>
#include <map>

namespace sdma {
namespace {

uint64_t bytesOf(const at::Tensor& t) {
  return t.defined() ? static_cast<uint64_t>(t.numel()) * t.element_size() : 0;
}

std::string directionWords(uint64_t directions, uint64_t sends, uint64_t expects) {
  switch (directions) {
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
  std::map<int, std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>>> byPeer;  // sends, recvs
  for (const P2pOp& op : ops) {
    auto& lists = byPeer[op.peer];
    (op.isSend ? lists.first : lists.second).push_back(op.tensor);
  }
  std::vector<int> peers;
  for (const auto& [peer, lists] : byPeer) {
    peers.push_back(peer);
  }
  // Every rank orders the pairs alike: by (lower member, higher member).
  std::sort(peers.begin(), peers.end(), [rank](int a, int b) {
    const auto pa = std::make_pair(std::min(a, rank), std::max(a, rank));
    const auto pb = std::make_pair(std::min(b, rank), std::max(b, rank));
    return pa < pb;
  });
  std::vector<PairStep> steps;
  for (int peer : peers) {
    const auto& [sends, recvs] = byPeer[peer];
    for (size_t k = 0; k < std::max(sends.size(), recvs.size()); ++k) {
      steps.push_back({peer, k < sends.size() ? sends[k] : at::Tensor(), k < recvs.size() ? recvs[k] : at::Tensor()});
    }
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

}  // namespace sdma
