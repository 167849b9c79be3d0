#include "collective/direct_allgather.hpp"

#include "collective/byte_spans.hpp"
#include "collective/peer_order.hpp"

namespace sdma {

void scheduleDirectAllgather(Transport& t, const AllgatherPlan& plan, uint32_t serial, const PostedBuffers& posted,
                             const std::vector<PeerBuffers>& peerPosts) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  const size_t n = plan.bytesPerRank;
  char* postedInput = const_cast<char*>(posted.input);
  const bool inputBounced = plan.input.size() != 1 || plan.input.front().ptr != posted.input;
  const bool outputBounced = posted.outputBase != plan.outputBase;

  // Peers may read our input and write our output as soon as our stream is here: tell them first, so that their
  // pushes overlap our own-slot copy (bounced, once the bounce area holds our bytes).
  if (inputBounced) {
    copyPieces(t, Lane::Drain, {ByteSpan{postedInput, n}}, plan.input);
    d.joinLane(Lane::Push, Lane::Drain);  // our pushes below read the bounce area
  }
  forEachPeerFrom(me, size, [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Arrived, 0, serial); });
  copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);  // nothing when in place

  // Our bytes into each peer's output once its stream is there, each peer on the Push lane of its own (the
  // transport may run them at once, on several engines); where we came late, the peer's bytes too, pulled from its
  // input (the read over the link on the other lane than the write).
  forEachPeerFrom(me, size, [&](int q) {
    const PeerBuffers& peer = peerPosts[q];
    if (peer.pairing == Pairing::kPeerCameLate) {
      return;
    }
    d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
    d.copyToPeer(Lane::Push, q, peer.outputBase + static_cast<uint64_t>(me) * n, posted.input, n);
    if (peer.pairing == Pairing::kThisCameLate) {
      d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
      d.copyFromPeer(Lane::Drain, q, posted.outputBase + static_cast<size_t>(q) * n, peer.input, n);
    }
  });
  d.joinLane(Lane::Drain, Lane::Push);
  // Done after our copies; complete only after every peer's, since a peer may be writing into our output.
  forEachPeerFrom(me, size, [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  forEachPeerFrom(me, size, [&](int q) { d.waitPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  if (outputBounced) {
    forEachPeerFrom(me, size, [&](int q) {
      t.copyLocal(Lane::Drain, plan.outputBase + static_cast<size_t>(q) * n,
                  posted.outputBase + static_cast<size_t>(q) * n, n);
    });
  }
}

}  // namespace sdma
