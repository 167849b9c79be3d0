#include "collective/relayed_broadcast.hpp"

#include <algorithm>
#include <vector>

#include "collective/peer_order.hpp"

namespace sdma {
namespace {

uint64_t ceilDiv(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}

// The bytes of the part of the rank at distance d from the root, cut on chunk bounds: the chunks dealt out as evenly
// as the parts allow, the earlier parts one more where they do not divide.
ByteRange partAt(int d, uint64_t bytes, uint64_t chunkBytes, int ranks) {
  const uint64_t chunks = ceilDiv(bytes, chunkBytes);
  const uint64_t parts = static_cast<uint64_t>(ranks - 1);
  const auto firstChunk = [&](uint64_t part) { return part * (chunks / parts) + std::min(part, chunks % parts); };
  const uint64_t begin = std::min(bytes, firstChunk(d - 1) * chunkBytes);
  const uint64_t end = std::min(bytes, firstChunk(d) * chunkBytes);
  return {begin, end - begin};
}

int distanceFrom(int root, int rank, int ranks) {
  return (rank - root + ranks) % ranks;
}

// Calls visit(c, offset, bytes) for each chunk of `range`.
template <class Visit>
void forEachChunk(const ByteRange& range, uint64_t chunkBytes, Visit&& visit) {
  int c = 0;
  for (uint64_t at = 0; at < range.bytes; at += chunkBytes, ++c) {
    visit(c, at, std::min(chunkBytes, range.bytes - at));
  }
}

// Calls visit(q, c, offset, bytes) for chunk c of range[q] of every rank q of `ranks`, chunk-major: chunk 0 of each in
// turn, then chunk 1, ...
template <class Visit>
void forEachChunkRound(const std::vector<ByteRange>& range, const std::vector<int>& ranks, uint64_t chunkBytes,
                       Visit&& visit) {
  for (uint64_t at = 0, c = 0;; at += chunkBytes, ++c) {
    bool any = false;
    for (int q : ranks) {
      if (at < range[q].bytes) {
        visit(q, static_cast<int>(c), at, std::min(chunkBytes, range[q].bytes - at));
        any = true;
      }
    }
    if (!any) {
      return;
    }
  }
}

}  // namespace

bool broadcastIsRelayed(uint64_t bytes, int ranks) {
  return ranks > 2 && bytes >= kRelayMinBytes;
}

ExchangePlan relayedBroadcastPlan(char* region, uint64_t bytes, int root, int rank, int ranks, uint64_t chunkUnit) {
  ExchangePlan p;
  p.sendTo.assign(ranks, ByteRange{});
  p.recvFrom.assign(ranks, ByteRange{});
  p.relayRoot = root;
  // As few chunks as fill every part's slots, each a whole number of units (none smaller than the copy engines run
  // well at).
  const uint64_t perSlot = ceilDiv(bytes, static_cast<uint64_t>(ranks - 1) * kRelayChunksPerPart);
  p.relayChunkBytes = std::max<uint64_t>(1, ceilDiv(perSlot, chunkUnit)) * chunkUnit;
  const auto partOf = [&](int q) { return partAt(distanceFrom(root, q, ranks), bytes, p.relayChunkBytes, ranks); };
  if (rank == root) {
    for (int q = 0; q < ranks; ++q) {
      if (q != root) {
        p.sendTo[q] = partOf(q);
      }
    }
    p.input = region;
    p.inputBytes = bytes;
    return p;
  }
  // A relaying rank sends its part from its output, where the root's chunks land: it posts no input.
  for (int q = 0; q < ranks; ++q) {
    if (q == rank) {
      continue;
    }
    p.recvFrom[q] = partOf(q == root ? rank : q);
    if (q != root) {
      p.sendTo[q] = partOf(rank);
    }
  }
  p.output = region;
  p.outputBytes = bytes;
  return p;
}

void scheduleRelayedBroadcast(Transport& t, const ExchangePlan& plan, uint32_t serial, const PostedBuffers& posted,
                              const std::vector<ExchangePeer>& peers) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int ranks = t.geometry().worldSize;
  const int root = plan.relayRoot;
  const uint64_t chunk = plan.relayChunkBytes;
  openDirectExchange(t, plan, serial, posted, peers);

  if (me == root) {
    // Chunk by chunk, each round to every rank, nearest first, each chunk announced on the lane that copied it: on
    // one lane too, every rank then has its first chunk to forward after one chunk's time.
    std::vector<int> to;
    forEachPeerFrom(me, ranks, [&](int q) {
      if (peers[q].buffers.pairing != Pairing::kPeerCameLate && plan.sendTo[q].bytes > 0) {
        d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
        to.push_back(q);  // else the rank pulls its part itself
      }
    });
    forEachChunkRound(plan.sendTo, to, chunk, [&](int q, int c, uint64_t at, uint64_t bytes) {
      const ExchangePeer& peer = peers[q];
      d.copyToPeer(Lane::Push, q, peer.buffers.outputBase + peer.ranges.expects.offset + at,
                   plan.input + plan.sendTo[q].offset + at, bytes);
      d.signalPeer(Lane::Push, q, Flag::Ready, c, serial);
    });
    closeDirectExchange(t, plan, serial, posted);
    return;
  }

  char* output = posted.outputBase;
  const ByteRange& mine = plan.recvFrom[root];
  const ExchangePeer& fromRoot = peers[root];
  // Our part: pushed by the root, chunk by chunk, unless we came late to the pair, when the root enqueued nothing for
  // us and we pull the part whole before forwarding any of it.
  const bool pulled = fromRoot.buffers.pairing == Pairing::kThisCameLate;
  if (pulled && mine.bytes > 0) {
    d.waitPeer(Lane::Drain, root, Flag::Arrived, 0, serial);
    d.copyFromPeer(Lane::Drain, root, output + mine.offset, fromRoot.buffers.input + fromRoot.ranges.sends.offset,
                   mine.bytes);
    d.joinLane(Lane::Push, Lane::Drain);  // the forwards below read it
  }
  // Each chunk of our part, once in our output, announced to every relaying peer, for one that pulls it.
  forEachChunk(mine, chunk, [&](int c, uint64_t, uint64_t) {
    if (!pulled) {
      d.waitPeer(Lane::Drain, root, Flag::Ready, c, serial);
    }
    forEachPeerFrom(me, ranks, [&](int q) {
      if (q != root) {
        d.signalPeer(Lane::Drain, q, Flag::Credit, c, serial);
      }
    });
  });
  // Our part forwarded to each relaying peer, chunk by chunk, each round to every peer, a chunk as soon as it is here.
  std::vector<int> to;
  forEachPeerFrom(me, ranks, [&](int q) {
    if (q != root && peers[q].buffers.pairing != Pairing::kPeerCameLate && plan.sendTo[q].bytes > 0) {
      d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
      to.push_back(q);
    }
  });
  forEachChunkRound(plan.sendTo, to, chunk, [&](int q, int c, uint64_t at, uint64_t bytes) {
    const ExchangePeer& peer = peers[q];
    if (!pulled) {
      d.waitPeerOnLaneOf(Lane::Push, q, root, Flag::Ready, c, serial);
    }
    d.copyToPeer(Lane::Push, q, peer.buffers.outputBase + peer.ranges.expects.offset + at,
                 output + plan.sendTo[q].offset + at, bytes);
  });
  // A peer's part pulled from its output where it enqueued nothing for us (we came late to the pair).
  forEachPeerFrom(me, ranks, [&](int q) {
    const ExchangePeer& peer = peers[q];
    const ByteRange& from = plan.recvFrom[q];
    if (q == root || peer.buffers.pairing != Pairing::kThisCameLate || from.bytes == 0) {
      return;
    }
    d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
    forEachChunk(from, chunk, [&](int c, uint64_t at, uint64_t bytes) {
      d.waitPeer(Lane::Drain, q, Flag::Credit, c, serial);
      d.copyFromPeer(Lane::Drain, q, output + from.offset + at, peer.buffers.outputBase + peer.ranges.sends.offset + at,
                     bytes);
    });
  });
  closeDirectExchange(t, plan, serial, posted);
}

}  // namespace sdma
