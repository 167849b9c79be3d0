#include "collective/relayed_broadcast.hpp"

#include <algorithm>
#include <vector>

namespace sdma {
namespace {

uint64_t ceilDiv(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

// Calls visit(c, offset, bytes) for each chunk of `bytes`.
template <class Visit>
void forEachChunk(uint64_t bytes, uint64_t chunkBytes, Visit&& visit) {
  int c = 0;
  for (uint64_t at = 0; at < bytes; at += chunkBytes, ++c) {
    visit(c, at, std::min(chunkBytes, bytes - at));
  }
}

}  // namespace

bool broadcastIsRelayed(uint64_t bytes, int ranks) {
  return ranks > 2 && bytes >= kRelayMinBytes;
}

ExchangePlan relayedBroadcastPlan(char* region, uint64_t bytes, int root, int rank, int ranks, uint64_t chunkUnit,
                                  int chunks) {
  ExchangePlan p;
  p.sendTo.assign(ranks, ByteRange{});
  p.recvFrom.assign(ranks, ByteRange{});
  p.relayRoot = root;
  uint64_t n = chunks > 0 ? static_cast<uint64_t>(chunks)
                          : std::clamp<uint64_t>(bytes / kRelayChunkBytes, kRelayMinChunks, kRelayMaxChunks);
  n = std::max<uint64_t>(1, std::min(n, bytes / chunkUnit));
  p.relayChunkBytes = std::max<uint64_t>(1, ceilDiv(ceilDiv(bytes, n), chunkUnit)) * chunkUnit;
  const int d = (rank - root + ranks) % ranks;
  const ByteRange whole{0, bytes};
  if (d > 0) {
    p.recvFrom[(rank - 1 + ranks) % ranks] = whole;
  }
  if (d < ranks - 1) {
    p.sendTo[(rank + 1) % ranks] = whole;
  }
  if (d == 0) {
    p.input = region;
    p.inputBytes = bytes;
  } else {
    // A forwarding rank sends from its output, where its chunks land: it posts no input.
    p.output = region;
    p.outputBytes = bytes;
  }
  return p;
}

void scheduleRelayedBroadcast(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                              const std::vector<ExchangePeer>& peers) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int ranks = t.geometry().worldSize;
  const int prev = (me - 1 + ranks) % ranks;
  const int next = (me + 1) % ranks;
  const bool isRoot = me == plan.relayRoot;
  const bool isLast = next == plan.relayRoot;
  const uint64_t chunk = plan.relayChunkBytes;
  openDirectExchange(t, plan, serial, posted, peers);

  // What this rank forwards: the root's input, or its own output as the chunks land.
  const char* from = isRoot ? plan.input : posted.outputBase;
  const uint64_t bytes = isRoot ? plan.inputBytes : plan.outputBytes;
  // Our chunks: pushed by the previous rank, each announced by Ready, unless we came late to that pair, when it
  // enqueued nothing for us and we pull them: the root's input whole (all there from its Arrived), a forwarding
  // rank's output chunk by chunk as its Credit says each is there.
  const bool pulled = !isRoot && peers[prev].buffers.pairing == Pairing::kThisCameLate && bytes > 0;
  if (pulled) {
    const ExchangePeer& p = peers[prev];
    d.waitPeer(Lane::Drain, prev, Flag::Arrived, 0, serial);
    if (prev == plan.relayRoot) {
      d.copyFromPeer(Lane::Drain, prev, posted.outputBase, p.buffers.input + p.ranges.sends.offset, bytes);
    } else {
      forEachChunk(bytes, chunk, [&](int c, uint64_t at, uint64_t n) {
        d.waitPeer(Lane::Drain, prev, Flag::Credit, c, serial);
        d.copyFromPeer(Lane::Drain, prev, posted.outputBase + at, p.buffers.outputBase + p.ranges.sends.offset + at, n);
      });
    }
    d.joinLane(Lane::Push, Lane::Drain);  // the forwards below read it
  }
  if (!isLast && bytes > 0) {
    const ExchangePeer& n = peers[next];
    if (n.buffers.pairing == Pairing::kPeerCameLate) {
      // The next rank pulls from our output (the root's input: whole, with no Credit): each chunk announced once here.
      if (!isRoot) {
        forEachChunk(bytes, chunk, [&](int c, uint64_t, uint64_t) {
          if (!pulled) {
            d.waitPeer(Lane::Drain, prev, Flag::Ready, c, serial);
          }
          d.signalPeer(Lane::Drain, next, Flag::Credit, c, serial);
        });
      }
    } else {
      // One lane: two (chunks alternating between Push and Drain) ran 5-10% slower on 4x H100.
      d.waitPeer(Lane::Push, next, Flag::Arrived, 0, serial);
      forEachChunk(bytes, chunk, [&](int c, uint64_t at, uint64_t len) {
        if (!isRoot && !pulled) {
          d.waitPeerOnLaneOf(Lane::Push, next, prev, Flag::Ready, c, serial);
        }
        d.copyToPeer(Lane::Push, next, n.buffers.outputBase + n.ranges.expects.offset + at, from + at, len);
        d.signalPeer(Lane::Push, next, Flag::Ready, c, serial);
      });
    }
  }
  closeDirectExchange(t, plan, serial, posted);
}

}  // namespace sdma
