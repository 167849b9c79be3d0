#include "collective/direct_exchange.hpp"

#include "collective/byte_spans.hpp"
#include "collective/peer_order.hpp"
#include "collective/relayed_broadcast.hpp"

namespace sdma {
namespace {

// Whether this rank's pushes read its input from the bounce area, packed before Arrived: where peers write its output
// in place (not bounced) over the input's own tensors (a list form whose outputs alias its inputs), a peer's bytes
// could land in a tensor before this rank pushed what it held.
bool pushesReadBounce(const ExchangePlan& plan, const PostedBuffers& posted) {
  if (posted.input == plan.input || plan.inputBytes == 0 || posted.outputBase != plan.output) {
    return false;
  }
  // The list's own tensors on both sides, also where a host runner posted them in place.
  const auto piecesOr = [](const std::vector<ByteSpan>& pieces, const char* base, uint64_t bytes) {
    return !pieces.empty() ? pieces : std::vector<ByteSpan>{{const_cast<char*>(base), bytes}};
  };
  return spansOverlap(piecesOr(plan.inputPieces, plan.input, plan.inputBytes),
                      piecesOr(plan.outputPieces, plan.output, plan.outputBytes));
}

// The bytes of range `r` of this rank's input where its pushes read them: in the bounce area (above), in the list
// form's tensors, or at that offset from the region's start (a tensor, or pieces a host runner posted in place, whose
// ranges it rebased on the first).
std::vector<ByteSpan> inputSpans(const ExchangePlan& plan, const PostedBuffers& posted, bool fromBounce,
                                 const ByteRange& r) {
  if (fromBounce) {
    return {{const_cast<char*>(posted.input) + r.offset, r.bytes}};
  }
  if (plan.inputPacked()) {
    return piecesOf(plan.inputPieces, r.offset, r.bytes);
  }
  return {{const_cast<char*>(plan.input) + r.offset, r.bytes}};
}

}  // namespace

bool openDirectExchange(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                        const std::vector<ExchangePeer>& peers) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  // A bounced input is read by the peers that pull from it (this rank enqueued nothing for them: they came late to
  // the pair) and by this rank's pushes only where peers write over the input (pushesReadBounce); otherwise this
  // rank's copies read the input's tensors where they are. So it is packed only then, and before Arrived, which such
  // a peer's pull waits for.
  bool pulledFrom = false;
  for (int q = 0; q < size; ++q) {
    pulledFrom = pulledFrom || (q != me && plan.sendTo[q].bytes > 0 && !pushesTo(plan, q, peers[q].buffers.pairing));
  }
  const bool pushesRead = pushesReadBounce(plan, posted);
  if (posted.input != plan.input && plan.inputBytes > 0 && (pulledFrom || pushesRead)) {
    copyPieces(t, Lane::Drain, {ByteSpan{const_cast<char*>(posted.input), plan.inputBytes}}, inputRegion(plan));
    if (pushesRead) {
      d.joinLane(Lane::Push, Lane::Drain);
    }
  }
  forEachPeerFrom(me, size, [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Arrived, 0, serial); });
  return pushesRead;
}

void closeDirectExchange(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                         const std::vector<ByteRange>* bounced) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  d.joinLane(Lane::Drain, Lane::Push);
  // Done after our copies; complete only after every peer's, since a peer may be reading our input or writing our
  // output.
  forEachPeerFrom(me, size, [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  forEachPeerFrom(me, size, [&](int q) { d.waitPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  if (posted.outputBase == plan.output || plan.outputBytes == 0) {
    return;
  }
  if (!bounced) {
    copyPieces(t, Lane::Drain, outputRegion(plan), {ByteSpan{posted.outputBase, plan.outputBytes}});
    return;
  }
  for (const ByteRange& r : *bounced) {
    copyPieces(t, Lane::Drain, piecesOf(outputRegion(plan), r.offset, r.bytes),
               {ByteSpan{posted.outputBase + r.offset, r.bytes}});
  }
}

void scheduleDirectExchange(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                            const std::vector<ExchangePeer>& peers) {
  if (plan.relayRoot >= 0) {
    scheduleRelayedBroadcast(t, plan, serial, posted, peers);
    return;
  }
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  const bool fromBounce = openDirectExchange(t, plan, serial, posted, peers);
  // A pulling root (a gather's, whose output list is bounced) copies what it pulls, and its own part, into the
  // list's tensors where they lie, and unpacks after Done only the ranges peers pushed into the bounce area (those
  // it did not wait for). Otherwise everything lands in the posted output, unpacked whole where bounced.
  const bool intoPieces = plan.pullingRoot == me && posted.outputBase != plan.output;
  const auto landing = [&](const ByteRange& r) {
    return intoPieces ? piecesOf(outputRegion(plan), r.offset, r.bytes)
                      : std::vector<ByteSpan>{{posted.outputBase + r.offset, r.bytes}};
  };
  std::vector<ByteRange> bounced;
  const ByteRange& toSelf = plan.sendTo[me];
  if (toSelf.bytes > 0) {
    copyPieces(t, Lane::Drain, landing({plan.recvFrom[me].offset, toSelf.bytes}),
               inputSpans(plan, posted, fromBounce, toSelf));
  }
  // Each peer on the Push lane of its own, nearest first (peer_order.hpp).
  forEachPeerFrom(me, size, [&](int q) {
    const ExchangePeer& peer = peers[q];
    const ByteRange& from = plan.recvFrom[q];
    if (peer.buffers.pairing == Pairing::kPeerCameLate) {
      if (from.bytes > 0) {
        bounced.push_back(from);  // the peer pushes it
      }
      return;
    }
    const ByteRange& to = plan.sendTo[q];
    if (pushesTo(plan, q, peer.buffers.pairing)) {
      d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
      uint64_t at = peer.buffers.outputBase + peer.ranges.expects.offset;
      for (const ByteSpan& piece : inputSpans(plan, posted, fromBounce, to)) {
        d.copyToPeer(Lane::Push, q, at, piece.ptr, piece.bytes);
        at += piece.bytes;
      }
    }
    if (pullsFrom(plan, me, q, peer.buffers.pairing)) {
      d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
      uint64_t at = peer.buffers.input + peer.ranges.sends.offset;
      for (const ByteSpan& piece : landing(from)) {
        d.copyFromPeer(Lane::Drain, q, piece.ptr, at, piece.bytes);
        at += piece.bytes;
      }
    } else if (from.bytes > 0) {
      bounced.push_back(from);
    }
  });
  closeDirectExchange(t, plan, serial, posted, intoPieces ? &bounced : nullptr);
}

}  // namespace sdma
