// The all-gather without staging (docs/design-direct-push.md): straight between the ranks' own buffers. For each
// pair, as the arrival mailbox settled it, each rank pushes its own bytes into the other's output, or the later
// arriver moves both directions.
#pragma once

#include <cstdint>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/arrival_mailbox.hpp"
#include "transport/transport.hpp"

namespace sdma {

// What this rank posted for its peers: its own buffers, or a bounce area of its own standing in for a buffer the
// peers cannot map (then the schedule fills it before and empties it after, locally).
struct PostedBuffers {
  const char* input = nullptr;  // this rank's bytes, where a peer that moves both directions reads them
  char* outputBase = nullptr;   // where peers write their bytes: rank q's at outputBase + q * bytesPerRank
};

// How the pair with rank q is shared and, where this rank copies to or from q, q's posted buffers as the
// transport's copyToPeer / copyFromPeer address them (input only for kThisMovesBoth).
struct PeerBuffers {
  Pairing pairing = Pairing::kPeerMovesBoth;
  uint64_t input = 0;
  uint64_t outputBase = 0;
};

// For a plan with an outputBase, on a transport whose direct() is not null. `serial` is the group's
// direct-collective serial. Pushes run on the Push lane and pulls on the Drain lane, which the transport may run
// on two engines at once; the Drain lane ends the collective.
void scheduleDirectAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t serial,
                             const PostedBuffers& posted, const std::vector<PeerBuffers>& peerPosts);

}  // namespace sdma
