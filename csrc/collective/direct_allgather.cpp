#include "collective/direct_allgather.hpp"

#include "collective/byte_spans.hpp"

namespace sdma {

void scheduleDirectAllgather(Transport& t, const AllgatherPlan& plan, uint32_t serial,
                             const std::vector<PeerBuffers>& peerPosts) {
  DirectTransport& d = *t.direct();
  const int me = t.rank();
  const int size = t.geometry().worldSize;
  const size_t n = plan.bytesPerRank;
  const char* input = plan.input.front().ptr;
  // Own slot first (nothing when in place), then tell every peer that our input is written and our output free.
  copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.signalPeer(Lane::Drain, q, Flag::Arrived, serial);
    }
  }
  // Late for a pair: move both directions of it, once the early peer's stream is there too.
  for (int q = 0; q < size; ++q) {
    if (q == me || !peerPosts[q].posted) {
      continue;
    }
    d.waitPeer(Lane::Drain, q, Flag::Arrived, serial);
    d.copyToPeer(Lane::Drain, q, peerPosts[q].outputBase + static_cast<uint64_t>(me) * n, input, n);
    d.copyFromPeer(Lane::Drain, q, plan.outputBase + static_cast<size_t>(q) * n, peerPosts[q].input, n);
  }
  // Done after our copies; complete only after every peer's, since a late peer may be writing into our output.
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.signalPeer(Lane::Drain, q, Flag::Done, serial);
    }
  }
  for (int q = 0; q < size; ++q) {
    if (q != me) {
      d.waitPeer(Lane::Drain, q, Flag::Done, serial);
    }
  }
}

}  // namespace sdma
