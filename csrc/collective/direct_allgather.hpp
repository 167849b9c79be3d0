// The all-gather without staging (docs/design-direct-push.md): straight between the ranks' own buffers. For each
// pair, as the arrival mailbox settled it, each rank pushes its own bytes into the other's output; where one rank
// came late, what LatePairs says.
#pragma once

#include <cstdint>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/arrival_mailbox.hpp"
#include "transport/transport.hpp"

namespace sdma {

// What a pair does when the earlier rank stopped waiting for the later one (Pairing::kPeerCameLate on the earlier
// rank, kThisCameLate on the later), so that the earlier one never learned where the later one's output is.
enum class LatePairs {
  // The later rank moves both directions: it pushes its bytes into the earlier one's output and pulls the earlier
  // one's bytes out of its input. One GPU's copy engines carry the pair: between processes a push and a pull issued
  // by one process share one rate (half of each pushing its own, on 2x H200).
  kLaterMovesBoth,
  // The earlier rank pushes its bytes into its segments of the later one's landing area (the transport's staging,
  // mapped since the group connected: no address of the later one's is needed), as soon as its own stream is
  // there; the later one pushes its bytes into the earlier one's output and copies the landed bytes into its own
  // output. Each GPU's engines push one direction, at the price of a local copy on the later rank.
  kEarlierLands,
};

// What this rank posted for its peers: its own buffers, or a bounce area of its own standing in for a buffer the
// peers cannot map (then the schedule fills it before and empties it after, locally).
struct PostedBuffers {
  const char* input = nullptr;  // this rank's bytes, where a peer that moves both directions reads them
  char* outputBase = nullptr;   // where peers write their bytes: rank q's at outputBase + q * bytesPerRank
};

// How the pair with rank q settled and, where this rank copies to or from q's buffers, q's posted buffers as the
// transport's copyToPeer / copyFromPeer address them (input only where this rank moves both directions).
struct PeerBuffers {
  Pairing pairing = Pairing::kPeerCameLate;
  uint64_t input = 0;
  uint64_t outputBase = 0;
  // kEarlierLands, in a late pair: how many chunks the earlier rank of the pair has landed in the later one before
  // this collective, on this transport (both ranks count alike). The chunks of this collective carry the serials
  // after it on the landing slots' Ready and Credit flags.
  uint32_t landedBefore = 0;
};

// The chunks one rank's bytes land in, on a transport whose geometry is the landing area's (the same on every rank).
size_t landingChunkCount(const AllgatherPlan& plan, const StagingGeometry& landing);

// For a plan with an outputBase, on a transport whose direct() is not null (and, for kEarlierLands, whose staging
// is the landing area, used by nothing else). `serial` is the group's direct-collective serial. Pushes run on the
// Push lane, pulls and the copies out of the landing area on the Drain lane, which the transport may run on two
// engines at once; the Drain lane ends the collective.
void scheduleDirectAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t serial,
                             const PostedBuffers& posted, const std::vector<PeerBuffers>& peerPosts, LatePairs late);

}  // namespace sdma
