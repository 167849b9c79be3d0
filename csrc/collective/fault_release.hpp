// The fault protocol's pure decisions (docs/design.md, "Failures"): when a rank of a failed group may enqueue, which of
// its own waits it may let pass, and when and with what it lets a peer's waits pass. No GPU, no threads: the runners
// apply these, and tests/cpp/schedule_simulation.cpp --faults model-checks them against the real schedules.
//
// A rank waits only on flag words in its own memory that a peer writes. Once a rank failed, a wait of its own may be
// left hanging on a peer that will never run that call; the peer, once it failed too and every call it enqueued has
// ended on its lanes, writes those words for it. A rank never satisfies its own waits (its peer may still be about
// to push into its staging or copy into its buffers), except where the peer's process is gone.
#pragma once

#include <cstdint>

#include "transport/transport.hpp"

namespace sdma {

// How far past the releasing rank's last serial a released flag word stands. A failed rank enqueued a prefix of the
// group's calls no longer than any peer's by more than the calls in flight, so every serial the peer still waits for
// lies within 2^30 past the releaser's last one and flagReached passes it; the releaser writes nothing afterwards,
// so the word is never rolled back.
constexpr uint32_t kReleaseLead = uint32_t{1} << 30;

// The value a quiesced failed rank writes into each flag word a failed peer waits on from it, on one transport.
inline uint32_t releaseValue(uint32_t lastSerialOnTransport) {
  return lastSerialOnTransport + kReleaseLead;
}

// Whether a rank may enqueue a call: not once it failed, nor once any peer published "failed" (it then fails too).
inline bool mayEnqueue(bool failed, bool anyPeerPublishedFailed) {
  return !failed && !anyPeerPublishedFailed;
}

// Whether a rank whose watchdog polls the peers fails because of them: any peer published "failed".
inline bool failsForPeer(bool failed, bool anyPeerPublishedFailed) {
  return !failed && anyPeerPublishedFailed;
}

// Whether a rank may let its own waits on a peer pass (writing releaseValue of its own last serial into its own flag
// words from that peer): only once it failed (every call it has in flight carries an error) and that peer's process
// is gone (nothing of it runs, so nothing of it still copies or signals).
inline bool mayPassOwnWaits(bool failed, bool peerProcessGone) {
  return failed && peerProcessGone;
}

// Whether a rank writes the release into one peer now: it failed, every call it enqueued ended on its lanes
// (quiesced: none of its copies will touch the peer's buffers or read its staging again), the peer published
// "failed" (so every call the peer has in flight carries an error, and its calls' bytes are not trusted), and it has
// not released that peer yet. Once it released every peer that published "failed", it publishes "released".
inline bool mayReleaseInto(bool failed, bool quiesced, bool peerPublishedFailed, bool peerReleasedAlready) {
  return failed && quiesced && peerPublishedFailed && !peerReleasedAlready;
}

// Every flag word a peer waits on from this rank, on one transport: flag[kind][this rank][slot] in the peer's memory,
// for every kind and every slot. visit(Flag, slot).
template <class Visit>
void forEachReleasedWord(int slots, Visit&& visit) {
  for (int kind = 0; kind < kFlagKinds; ++kind) {
    for (int slot = 0; slot < slots; ++slot) {
      visit(static_cast<Flag>(kind), slot);
    }
  }
}

}  // namespace sdma
