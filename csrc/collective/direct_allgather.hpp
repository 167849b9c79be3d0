// The all-gather without staging (docs/design.md, "Direct"): straight between the ranks' own buffers. For
// each pair, as the arrival mailbox settled it, each rank pushes its own bytes into the other's output; where one
// rank came late, the later one moves both directions (pushes its bytes, pulls the earlier one's).
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

// How the pair with rank q settled and, where this rank copies to or from q's buffers, q's posted buffers as the
// transport's copyToPeer / copyFromPeer address them (input only where this rank moves both directions).
struct PeerBuffers {
  Pairing pairing = Pairing::kPeerCameLate;
  uint64_t input = 0;
  uint64_t outputBase = 0;
};

// For a plan with an outputBase, on a transport whose direct() is not null. `serial` is the group's direct-collective
// serial, which this collective's Arrived and Done flags carry. Pushes run on the Push lane, pulls on the Drain lane,
// which the transport may run on two engines at once. Only the Drain lane writes flags, and it ends the collective:
// a runner that keeps each group's Drain lanes in call order keeps every flag word monotone.
void scheduleDirectAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t serial,
                             const PostedBuffers& posted, const std::vector<PeerBuffers>& peerPosts);

}  // namespace sdma
