#include "collective/direct_exchange.hpp"

#include "collective/byte_spans.hpp"
#include "collective/peer_order.hpp"
#include "collective/relayed_broadcast.hpp"

namespace sdma {

void openDirectExchange(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted) {
  DirectTransport& d = *t.direct();
  char* input = const_cast<char*>(posted.input);
  // Peers may read our input and write our output once our stream is here: a bounced input first.
  if (input != plan.input && plan.inputBytes > 0) {
    copyPieces(t, Lane::Drain, {ByteSpan{input, plan.inputBytes}},
               plan.inputPacked() ? plan.inputPieces
                                  : std::vector<ByteSpan>{ByteSpan{const_cast<char*>(plan.input), plan.inputBytes}});
    d.joinLane(Lane::Push, Lane::Drain);  // our pushes below read the bounce area
  }
  forEachPeerFrom(t.rank(), t.geometry().worldSize,
                  [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Arrived, 0, serial); });
}

void closeDirectExchange(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  d.joinLane(Lane::Drain, Lane::Push);
  // Done after our copies; complete only after every peer's, since a peer may be reading our input or writing our
  // output.
  forEachPeerFrom(me, size, [&](int q) { d.signalPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  forEachPeerFrom(me, size, [&](int q) { d.waitPeer(Lane::Drain, q, Flag::Done, 0, serial); });
  if (posted.outputBase != plan.output && plan.outputBytes > 0) {
    copyPieces(t, Lane::Drain,
               plan.outputPacked() ? plan.outputPieces : std::vector<ByteSpan>{ByteSpan{plan.output, plan.outputBytes}},
               {ByteSpan{posted.outputBase, plan.outputBytes}});
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
  const char* input = posted.input;
  char* output = posted.outputBase;
  openDirectExchange(t, plan, serial, posted);
  const ByteRange& toSelf = plan.sendTo[me];
  if (toSelf.bytes > 0) {
    t.copyLocal(Lane::Drain, output + plan.recvFrom[me].offset, input + toSelf.offset, toSelf.bytes);
  }
  // Each peer on the Push lane of its own, nearest first (peer_order.hpp).
  forEachPeerFrom(me, size, [&](int q) {
    const ExchangePeer& peer = peers[q];
    if (peer.buffers.pairing == Pairing::kPeerCameLate) {
      return;
    }
    const ByteRange& to = plan.sendTo[q];
    if (to.bytes > 0) {
      d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
      d.copyToPeer(Lane::Push, q, peer.buffers.outputBase + peer.ranges.expects.offset, input + to.offset, to.bytes);
    }
    const ByteRange& from = plan.recvFrom[q];
    if (peer.buffers.pairing == Pairing::kThisCameLate && from.bytes > 0) {
      d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
      d.copyFromPeer(Lane::Drain, q, output + from.offset, peer.buffers.input + peer.ranges.sends.offset, from.bytes);
    }
  });
  closeDirectExchange(t, plan, serial, posted);
}

}  // namespace sdma
