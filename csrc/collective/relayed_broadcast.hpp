// A broadcast among more than two ranks, relayed through the peers (docs/design.md, "Exchange"). Root to all, the
// root's links carry the tensor once per peer, so it ends after (ranks - 1) x bytes / link rate however many engines
// push. Relayed, the root sends each other rank one part of the tensor, in chunks, and each of them forwards its part
// to the rest as the chunks arrive: the root's links carry the tensor once, every other rank's carry its part to each
// of the rest at the same time, and the collective ends after about bytes / link rate.
//
// The part of the rank at distance d from the root (d = 1 .. ranks - 1) is the (d - 1)-th, cut on chunk bounds. The
// root signals Ready (slot c) into a rank once chunk c of its part is there; a rank signals Credit (slot c) into each
// other non-root rank once chunk c of its part is in its own output, for a peer that came late to their pair and pulls
// the part from there. Every rank computes the same plan from the size, the root and the ranks alone.
#pragma once

#include <cstdint>

#include "collective/direct_exchange.hpp"
#include "collective/exchange_plan.hpp"

namespace sdma {

// Chunks a part moves in at most: also the flag slots of the direct path's transport.
constexpr int kRelayChunksPerPart = 8;
// Smaller chunks cost the copy engines more than the pipeline gains.
constexpr uint64_t kRelayMinChunkBytes = uint64_t{512} << 10;
// Below this, root to all: a second hop costs more latency than the root's links save.
constexpr uint64_t kRelayMinBytes = uint64_t{4} << 20;

// Whether a broadcast of `bytes` among `ranks` is relayed.
bool broadcastIsRelayed(uint64_t bytes, int ranks);

// The relayed plan of `rank` for a broadcast of `bytes` from `root`: `region` is the tensor's bytes on this rank (the
// root's input, every other rank's output). Chunks are whole multiples of `chunkUnit` bytes (the schedule model cuts
// a few bytes into chunks of a byte or two).
ExchangePlan relayedBroadcastPlan(char* region, uint64_t bytes, int root, int rank, int ranks,
                                  uint64_t chunkUnit = kRelayMinChunkBytes);

// The schedule of such a plan, called by scheduleDirectExchange.
void scheduleRelayedBroadcast(Transport& transport, const ExchangePlan& plan, uint32_t serial,
                              const PostedBuffers& posted, const std::vector<ExchangePeer>& peers);

}  // namespace sdma
