#include "collective/captured_exchange.hpp"

#include <algorithm>

#include "collective/byte_spans.hpp"
#include "collective/staging_allgather.hpp"

namespace sdma {
namespace {

// How one pair's stream is cut: both of its ranks derive it from the pair's byte count alone.
struct PairChunks {
  size_t chunkBytes = 0;
  size_t count = 0;
};

PairChunks chunksOfPair(uint64_t bytes, const StagingGeometry& g) {
  if (bytes == 0) {
    return {};
  }
  const size_t chunk = chunkBytesFor(static_cast<size_t>(bytes), g);
  return {chunk, divCeil(static_cast<size_t>(bytes), chunk)};
}

}  // namespace

size_t capturedExchangeRounds(const ExchangePlan& plan, const StagingGeometry& geometry, int rank) {
  size_t rounds = 0;
  for (size_t q = 0; q < plan.sendTo.size(); ++q) {
    if (static_cast<int>(q) != rank) {
      rounds = std::max({rounds, chunksOfPair(plan.sendTo[q].bytes, geometry).count,
                         chunksOfPair(plan.recvFrom[q].bytes, geometry).count});
    }
  }
  return rounds;
}

// Why each reset cannot lose a signal (a waiter resets a word before it does what lets the signaller set it again):
// - Ready of a slot, reset on the Drain lane once every peer that sends chunk c here signalled it. The next Ready of
//   that slot from such a peer is chunk c + slots, which needs our Credit, signalled after the reset; a peer with no
//   chunk c sends none later in the collective; and any peer's first push of the next collective waits for our Done,
//   signalled on the Drain lane after every reset of this one.
// - Credit of a slot, reset on the Push lane once every peer we send chunk c signalled it: a peer's next Credit of
//   that slot needs our Ready of chunk c, signalled after the reset, and a peer we send no chunk c signals none.
// - Done, reset on the Push lane: a peer's next Done needs our Arrived of the next collective (or, for a captured
//   all-gather, our Ready), which the Push lane signals after the reset. Without the Arrived a peer that moves
//   nothing with this rank (two non-roots of a broadcast) could run through its next collective and set Done before
//   the reset, which would then erase it.
// - Arrived, reset on the Drain lane before our Done: a peer signals its next Arrived only after its Push lane saw our
//   Done.
void scheduleCapturedExchange(Transport& t, const ExchangePlan& plan) {
  DirectTransport& d = *t.direct();
  const StagingGeometry& g = t.geometry();
  const int me = t.rank();
  const int size = g.worldSize;
  const std::vector<ByteSpan> input = inputRegion(plan);
  const std::vector<ByteSpan> output = outputRegion(plan);
  std::vector<PairChunks> sends(size), recvs(size);
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      sends[q] = chunksOfPair(plan.sendTo[q].bytes, g);
      recvs[q] = chunksOfPair(plan.recvFrom[q].bytes, g);
    }
  }
  const size_t rounds = capturedExchangeRounds(plan, g, me);

  t.signalPeers(Lane::Push, Flag::Arrived, 0, 1);
  const ByteRange& toSelf = plan.sendTo[me];
  copyPieces(t, Lane::Drain, piecesOf(output, plan.recvFrom[me].offset, toSelf.bytes),
             piecesOf(input, toSelf.offset, toSelf.bytes));

  for (size_t c = 0; c < rounds; ++c) {
    const int slot = static_cast<int>(c % static_cast<size_t>(g.slots));
    // Push chunk c to every peer whose stream has one. A slot's first use in a collective needs no credit: the last
    // collective ended with every peer done.
    bool credited = false;
    for (int q = 0; q < size; ++q) {
      if (q != me && c < sends[q].count && c >= static_cast<size_t>(g.slots)) {
        d.waitPeer(Lane::Push, q, Flag::Credit, slot, 1);
        credited = true;
      }
    }
    if (credited) {
      t.resetOwnFlags(Lane::Push, Flag::Credit, slot);
    }
    for (int q = 0; q < size; ++q) {
      if (q == me || c >= sends[q].count) {
        continue;
      }
      const size_t from = c * sends[q].chunkBytes;
      const size_t len = std::min<size_t>(sends[q].chunkBytes, plan.sendTo[q].bytes - from);
      size_t at = 0;
      for (const ByteSpan& piece : piecesOf(input, plan.sendTo[q].offset + from, len)) {
        t.pushChunkToPeer(Lane::Push, q, slot, piece.ptr, piece.bytes, at);
        at += piece.bytes;
      }
      d.signalPeer(Lane::Push, q, Flag::Ready, slot, 1);
    }

    // Drain chunk c of every peer whose stream has one, and give the slot back where that stream uses it again.
    bool landed = false;
    for (int q = 0; q < size; ++q) {
      if (q != me && c < recvs[q].count) {
        d.waitPeer(Lane::Drain, q, Flag::Ready, slot, 1);
        landed = true;
      }
    }
    if (landed) {
      t.resetOwnFlags(Lane::Drain, Flag::Ready, slot);
    }
    for (int q = 0; q < size; ++q) {
      if (q == me || c >= recvs[q].count) {
        continue;
      }
      const size_t from = c * recvs[q].chunkBytes;
      const size_t len = std::min<size_t>(recvs[q].chunkBytes, plan.recvFrom[q].bytes - from);
      copyPieces(t, Lane::Drain, piecesOf(output, plan.recvFrom[q].offset + from, len),
                 {{t.localSegment(slot, q), len}});
      if (c + static_cast<size_t>(g.slots) < recvs[q].count) {
        d.signalPeer(Lane::Drain, q, Flag::Credit, slot, 1);
      }
    }
  }

  // Every peer has drained all we pushed before our Push lane goes on to the next collective, whose first pushes
  // take no credit.
  t.waitPeers(Lane::Drain, Flag::Arrived, 0, 1);
  t.resetOwnFlags(Lane::Drain, Flag::Arrived, 0);
  t.signalPeers(Lane::Drain, Flag::Done, 0, 1);
  t.waitPeers(Lane::Push, Flag::Done, 0, 1);
  t.resetOwnFlags(Lane::Push, Flag::Done, 0);
}

}  // namespace sdma
