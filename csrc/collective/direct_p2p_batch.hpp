// A batch of point-to-point steps (p2p_batch.hpp) on the direct path (docs/design.md, "Point-to-point"): each step is
// a two-rank exchange on its pair's transport, as collective/direct_exchange.hpp moves one, but the batch's steps run
// phase by phase: Arrived to every step's peer first, then every step's copies (each after its peer's own Arrived for
// that step) and its Done, then the waits for every peer's Done. No rank's first wait of a batch is on a signal that
// its peer issues after a wait of its own, so a ring (each rank sends to the next and receives from the previous in
// one batch) never waits in a cycle. After the Arrived phase each peer's steps run on lanes of that peer alone, joined
// at the batch's end, so that a step waiting for one peer never holds another peer's copies or Done: a batch whose
// peers match it with lone calls that interleave with lone calls among themselves completes, as NCCL's channels serve
// it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "collective/direct_exchange.hpp"

namespace sdma {

struct DirectPairStep {
  Transport* transport = nullptr;  // the pair's: rank 0 and 1 are its members in group-rank order
  ExchangePlan plan;               // by pair rank
  uint32_t serial = 0;             // the pair's, carried by this step's Arrived and Done
  // What this rank posted: the plan's regions, or a bounce area for a region the peer cannot map, which the schedule
  // fills before Arrived (a send) and empties after Done (a recv). A bounce area serves one step of a batch.
  PostedBuffers posted;
  ExchangePeer peer;  // how the pair settled, and what the peer posted
};

enum class P2pPhase { kArrive, kCopy, kFinish };

// Called before each step's operations of each phase are recorded on its transport, so that a runner whose
// transports record rather than enqueue (the host's) keeps the batch's one order across them.
using P2pStepStart = std::function<void(size_t step, P2pPhase phase)>;

// The lanes of a batch's peers. A peer is a transport of the batch's steps (one per pair); the k-th peer is the k-th
// to appear in the steps' order.
class P2pPeerLanes {
 public:
  virtual ~P2pPeerLanes() = default;
  // After every step's Arrived, before the first copy of the k-th peer's steps (the first of them is `firstStep`):
  // that peer's lanes start where the batch's Drain lane stands, and its transport's operations go on them from now.
  virtual void fork(size_t peer, size_t firstStep) = 0;
  // After every step's operations: the batch's Drain lane waits for every forked peer's Drain lane, which each of
  // that peer's steps joined its Push lane into before its Done.
  virtual void join() = 0;
};

// `lanes`: null runs every step on the transports' lanes as they are (one pair of lanes shared by all the batch's
// peers, where the runner bound them so): a batch matched by interleaved lone calls may then hang.
void scheduleDirectP2pBatch(const std::vector<DirectPairStep>& steps, const P2pStepStart& onStep = {},
                            P2pPeerLanes* lanes = nullptr);

}  // namespace sdma
