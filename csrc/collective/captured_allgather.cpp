#include "collective/captured_allgather.hpp"

#include <algorithm>

#include "collective/byte_spans.hpp"
#include "collective/staging_allgather.hpp"

namespace sdma {

// Why each reset cannot lose a signal: a waiter resets its flag before it does what lets the signaller signal
// again. Ready: the drain resets it, then signals Credit (or Done), which the pusher needs before it pushes into
// that slot again. Credit: the pusher resets it, then pushes and signals Ready, which the drainer needs before it
// can signal Credit for that slot again. Done: the push lane resets it before its next collective's first Ready (a
// captured exchange's: its Arrived), which every peer needs before it can signal Done again.
void scheduleCapturedAllgather(Transport& t, const AllgatherPlan& plan) {
  if (plan.bytesPerRank == 0) {
    return;  // no staging touched, nothing to order
  }
  const StagingGeometry& g = t.geometry();
  const int me = t.rank();
  const size_t chunkBytes = chunkBytesFor(plan, g);
  const size_t chunks = chunkCount(plan, g);
  const bool ownSlotLast = chunks == 1;
  SpanCursor input(plan.input);
  std::vector<SpanCursor> outputs = cursorsOver(plan.outputByRank);

  for (size_t c = 0; c < chunks; ++c) {
    const size_t len = std::min(chunkBytes, plan.bytesPerRank - c * chunkBytes);
    const int slot = static_cast<int>(c % g.slots);

    // Push. A slot's first use in a collective needs no credit: the last collective ended with every peer done.
    if (c >= static_cast<size_t>(g.slots)) {
      t.waitPeers(Lane::Push, Flag::Credit, slot, 1);
      t.resetOwnFlags(Lane::Push, Flag::Credit, slot);
    }
    pushChunkToPeers(t, Lane::Push, slot, input.take(len), len);
    t.signalPeers(Lane::Push, Flag::Ready, slot, 1);

    if (c == 0 && !ownSlotLast) {
      copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);
    }

    // Drain, and give the slot back only where this collective uses it again.
    t.waitPeers(Lane::Drain, Flag::Ready, slot, 1);
    t.resetOwnFlags(Lane::Drain, Flag::Ready, slot);
    drainChunkFromPeers(t, Lane::Drain, slot, outputs, len);
    if (c + g.slots < chunks) {
      t.signalPeers(Lane::Drain, Flag::Credit, slot, 1);
    }
  }
  if (ownSlotLast) {
    copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);
  }
  // Every peer has drained all we pushed before our push lane goes on to the next collective. (The lanes may be
  // independent streams, so the wait sits on the push lane itself.)
  t.signalPeers(Lane::Drain, Flag::Done, 0, 1);
  t.waitPeers(Lane::Push, Flag::Done, 0, 1);
  t.resetOwnFlags(Lane::Push, Flag::Done, 0);
}

}  // namespace sdma
