#include "collective/direct_allgather.hpp"

#include <algorithm>

#include "collective/byte_spans.hpp"
#include "collective/staging_allgather.hpp"

namespace sdma {
namespace {

// Chunk `c` of a late pair's landing: its serial (after the `before` chunks the pair landed earlier), the slot that
// serial uses (the landing area is a ring of slots per peer, like staging), and its bytes within the rank's stream.
struct LandingChunk {
  uint32_t serial;
  int slot;
  size_t at;
  size_t bytes;
};

LandingChunk landingChunk(const StagingGeometry& g, uint32_t before, size_t c, size_t chunkBytes, size_t streamBytes) {
  const uint32_t serial = before + 1 + static_cast<uint32_t>(c);
  const size_t at = c * chunkBytes;
  return {serial, static_cast<int>(serial & static_cast<uint32_t>(g.slots - 1)), at,
          std::min(chunkBytes, streamBytes - at)};
}

// The earlier rank of a late pair: the chunk into its segment of the peer's landing area, once the peer has copied
// out what landed in that slot before (Credit); then announced (Ready).
void landChunkInPeer(Transport& t, DirectTransport& d, int peer, const char* src, const LandingChunk& k) {
  // Flags start at the landing count of the transport's first collective, so the first uses of a slot pass.
  d.waitPeer(Lane::Push, peer, Flag::Credit, k.slot, k.serial - static_cast<uint32_t>(t.geometry().slots));
  t.pushChunkToPeer(Lane::Push, peer, k.slot, src + k.at, k.bytes);
  d.signalPeer(Lane::Push, peer, Flag::Ready, k.slot, k.serial);
}

// The later rank of a late pair: the peer's chunk, once it landed, into this rank's output; the slot back to the peer.
void copyLandedChunk(Transport& t, DirectTransport& d, int peer, char* dst, const LandingChunk& k) {
  d.waitPeer(Lane::Drain, peer, Flag::Ready, k.slot, k.serial);
  t.copyLocal(Lane::Drain, dst + k.at, t.localSegment(k.slot, peer), k.bytes);
  d.signalPeer(Lane::Drain, peer, Flag::Credit, k.slot, k.serial);
}

}  // namespace

size_t landingChunkCount(const AllgatherPlan& plan, const StagingGeometry& landing) {
  return chunkCount(plan, landing);
}

void scheduleDirectAllgather(Transport& t, const AllgatherPlan& plan, uint32_t serial, const PostedBuffers& posted,
                             const std::vector<PeerBuffers>& peerPosts, LatePairs late) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  const size_t n = plan.bytesPerRank;
  char* postedInput = const_cast<char*>(posted.input);
  const bool inputBounced = plan.input.size() != 1 || plan.input.front().ptr != posted.input;
  const bool outputBounced = posted.outputBase != plan.outputBase;
  const bool lands = late == LatePairs::kEarlierLands;
  const size_t chunk = lands ? chunkBytesFor(plan, t.geometry()) : 0;
  const size_t landingChunks = lands ? landingChunkCount(plan, t.geometry()) : 0;
  auto landsIn = [&](int q) { return lands && peerPosts[q].pairing == Pairing::kPeerCameLate; };
  auto landedFrom = [&](int q) { return lands && peerPosts[q].pairing == Pairing::kThisCameLate; };
  // Step c of the landing: chunk c into every later peer's landing area, then chunk c of every earlier peer out of
  // ours. A step waits only for lower steps of later peers (their Credit) and this step of earlier ones (their
  // Ready), and "earlier" follows the order the ranks posted in, so no rank waits in a circle even where one queue
  // runs both lanes.
  auto landAndCopyOut = [&](size_t c) {
    for (int q = 0; q < size; ++q) {
      if (q != me && landsIn(q)) {
        landChunkInPeer(t, d, q, posted.input, landingChunk(t.geometry(), peerPosts[q].landedBefore, c, chunk, n));
      }
    }
    for (int q = 0; q < size; ++q) {
      if (q != me && landedFrom(q)) {
        // Straight into the output, bounced or not: no peer writes this slot.
        copyLandedChunk(t, d, q, plan.outputBase + static_cast<size_t>(q) * n,
                        landingChunk(t.geometry(), peerPosts[q].landedBefore, c, chunk, n));
      }
    }
  };
  // The steps that wait only for copies of earlier collectives go before the pushes that wait for a peer's stream;
  // the rest, which wait for the late peers to copy this collective's first chunks out, after them.
  const size_t stepsFirst = std::min(landingChunks, static_cast<size_t>(t.geometry().slots));

  // Peers may read our input and write our output as soon as our stream is here: tell them first, so that their
  // pushes overlap our own-slot copy (bounced, once the bounce area holds our bytes).
  if (inputBounced) {
    copyPieces(t, Lane::Drain, {ByteSpan{postedInput, n}}, plan.input);
    d.joinLane(Lane::Push, Lane::Drain);  // our pushes below read the bounce area
  }
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.signalPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
    }
  }
  copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);  // nothing when in place

  for (size_t c = 0; c < stepsFirst; ++c) {
    landAndCopyOut(c);
  }
  // Our bytes into each peer's output once its stream is there; where we came late and nothing lands, the peer's
  // bytes too, pulled from its input (the read over the link on the other lane than the write).
  for (int q = 0; q < size; ++q) {
    const PeerBuffers& peer = peerPosts[q];
    if (q == me || peer.pairing == Pairing::kPeerCameLate) {
      continue;
    }
    d.waitPeer(Lane::Push, q, Flag::Arrived, 0, serial);
    d.copyToPeer(Lane::Push, q, peer.outputBase + static_cast<uint64_t>(me) * n, posted.input, n);
    if (peer.pairing == Pairing::kThisCameLate && !lands) {
      d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, serial);
      d.copyFromPeer(Lane::Drain, q, posted.outputBase + static_cast<size_t>(q) * n, peer.input, n);
    }
  }
  for (size_t c = stepsFirst; c < landingChunks; ++c) {
    landAndCopyOut(c);
  }
  d.joinLane(Lane::Drain, Lane::Push);
  // Done after our copies; complete only after every peer's, since a peer may be writing into our output.
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.signalPeer(Lane::Drain, q, Flag::Done, 0, serial);
    }
  }
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.waitPeer(Lane::Drain, q, Flag::Done, 0, serial);
    }
  }
  if (outputBounced) {
    for (int q = 0; q < size; ++q) {
      if (q != me && !landedFrom(q)) {
        t.copyLocal(Lane::Drain, plan.outputBase + static_cast<size_t>(q) * n,
                    posted.outputBase + static_cast<size_t>(q) * n, n);
      }
    }
  }
}

}  // namespace sdma
