// The all-gather without staging (docs/design-direct-push.md): for each pair of ranks the later arriver moves both
// directions, straight between the two ranks' own buffers.
#pragma once

#include <cstdint>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Rank q's posted buffers, when q arrived before this rank (this rank then moves both directions of the pair).
struct PeerBuffers {
  bool posted = false;
  uint64_t input = 0;
  uint64_t outputBase = 0;
};

// For a plan with an outputBase, on a transport whose direct() is not null. `serial` is the group's
// direct-collective serial.
void scheduleDirectAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t serial,
                             const std::vector<PeerBuffers>& peerPosts);

}  // namespace sdma
