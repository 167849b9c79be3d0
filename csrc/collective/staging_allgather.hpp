// The all-gather through staging, written once for every transport: push each chunk into every peer's staging
// slot, wait for every peer's chunk, drain it into the output, hand the slot back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "collective/byte_spans.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Every member derives the same chunking from the group's geometry and the message size alone, so chunk serials
// agree across ranks.
size_t chunkBytesFor(const AllgatherPlan& plan, const StagingGeometry& geometry);
// The same rule for a stream of `bytes` (one pair's, in the captured exchange).
size_t chunkBytesFor(size_t bytes, const StagingGeometry& geometry);
size_t chunkCount(const AllgatherPlan& plan, const StagingGeometry& geometry);

// The two steps every staging schedule takes per chunk. Push: `pieces` (len bytes of this rank's stream) into this
// rank's segment of `slot` in every peer, packed first into one contiguous copy per peer where the geometry has a
// pack segment and the chunk spans several tensors. Drain: every peer's segment of `slot` into the next len bytes
// of that peer's output.
void pushChunkToPeers(Transport& transport, Lane lane, int slot, std::vector<ByteSpan> pieces, size_t len);
void drainChunkFromPeers(Transport& transport, Lane lane, int slot, std::vector<SpanCursor>& outputs, size_t len);

// Enqueues the whole collective on `transport` and advances the transport's chunk count by chunkCount(). Flags carry
// its low 32 bits; the count itself is 64-bit so that a slot's first use (count <= slots) is known even after the
// flags wrapped, and needs no credit: a wait for serial - slots would wait for 2^32 - 1 there, which only a cyclic
// compare (CUDA's) takes for passed, and HIP's unsigned one never does.
void scheduleStagingAllgather(Transport& transport, const AllgatherPlan& plan, uint64_t& chunkCount);

}  // namespace sdma
