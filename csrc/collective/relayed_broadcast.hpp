// A broadcast among more than two ranks, relayed through the ranks as a chain (docs/design.md, "Exchange"). Root to
// all, the root's links carry the tensor once per peer, so it ends after (ranks - 1) x bytes / link rate however many
// engines push. Chained, the root pushes the tensor to the next rank, chunk by chunk, and every rank forwards each
// chunk to the next as soon as it is there: every rank's links carry the tensor once in and once out, on the one push
// lane a rotated all-gather runs at the links' rate on, and the collective ends after about (chunks + ranks - 2)
// chunks' time.
//
// The rank at distance d from the root receives from d - 1 and sends to d + 1. A rank signals Ready (slot c) into the
// next once chunk c is in the next's output; where the next came late to their pair (it pulls), the rank signals it
// Credit (slot c) instead, once chunk c is in its own output. Every rank computes the same plan from the size, the
// root and the ranks alone.
#pragma once

#include <cstdint>

#include "collective/direct_exchange.hpp"
#include "collective/exchange_plan.hpp"

namespace sdma {

// Chunks a relayed broadcast moves in at most: also the flag slots of the direct path's transport.
constexpr int kRelayMaxChunks = 32;
// At least this many chunks, so that the chain's fill (ranks - 2 chunks' time) stays a small part of the whole.
constexpr int kRelayMinChunks = 8;
// The chunk size the chain aims at between those counts: each chunk costs the copy engines a signal and a wait, a
// few microseconds, which smaller chunks do not earn back (4x H100: 2 MiB chunks ran a 64 MiB broadcast at 0.55x
// NCCL, 8 MiB ones at 0.73x).
constexpr uint64_t kRelayChunkBytes = uint64_t{16} << 20;
// Chunks are whole multiples of this.
constexpr uint64_t kRelayChunkUnit = uint64_t{1} << 20;
// Below this, root to all: a chain's extra hops cost more latency than the root's links save.
constexpr uint64_t kRelayMinBytes = uint64_t{4} << 20;

// Whether a broadcast of `bytes` among `ranks` is relayed.
bool broadcastIsRelayed(uint64_t bytes, int ranks);

// The relayed plan of `rank` for a broadcast of `bytes` from `root`: `region` is the tensor's bytes on this rank (the
// root's input, every other rank's output). Chunks are whole multiples of `chunkUnit` bytes, `chunks` of them where
// that is not 0 (the schedule model cuts a few bytes into chunks of a byte or two), else as the constants above say.
ExchangePlan relayedBroadcastPlan(char* region, uint64_t bytes, int root, int rank, int ranks,
                                  uint64_t chunkUnit = kRelayChunkUnit, int chunks = 0);

// The schedule of such a plan, called by scheduleDirectExchange.
void scheduleRelayedBroadcast(Transport& transport, const ExchangePlan& plan, uint32_t serial,
                              const PostedBuffers& posted, const std::vector<ExchangePeer>& peers);

}  // namespace sdma
