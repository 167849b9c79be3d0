// Which ops of a point-to-point batch form which step (docs/design.md, "Point-to-point"), on the ops' peers and
// directions alone, so that the schedule model (tests/cpp/schedule_simulation.cpp) forms steps with the code the
// backend runs: with each peer, the k-th send of the batch to it and the k-th recv from it form the k-th step; the
// peers in the order of their pairs (lower member, higher member) ascending, on every rank alike.
#pragma once

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

namespace sdma {

struct PairStepOps {
  int peer = -1;
  int send = -1;  // the send's index among the batch's ops; -1 where the step only receives
  int recv = -1;  // the recv's; -1 where the step only sends
};

// `ops[i].peer` (a group rank) and `ops[i].isSend` of every op, in call order; `rank`: this rank.
template <class Op>
std::vector<PairStepOps> pairStepOpsOf(const std::vector<Op>& ops, int rank) {
  std::map<int, std::pair<std::vector<int>, std::vector<int>>> byPeer;  // sends, recvs
  for (size_t i = 0; i < ops.size(); ++i) {
    auto& lists = byPeer[ops[i].peer];
    (ops[i].isSend ? lists.first : lists.second).push_back(static_cast<int>(i));
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
  std::vector<PairStepOps> steps;
  for (int peer : peers) {
    const auto& [sends, recvs] = byPeer[peer];
    for (size_t k = 0; k < std::max(sends.size(), recvs.size()); ++k) {
      steps.push_back({peer, k < sends.size() ? sends[k] : -1, k < recvs.size() ? recvs[k] : -1});
    }
  }
  return steps;
}

}  // namespace sdma
