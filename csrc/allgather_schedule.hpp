// The all-gather algorithm, written once for every transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport.hpp"

namespace sdma {

struct ByteSpan {
  char* ptr = nullptr;
  size_t bytes = 0;
};

// Every form of all-gather (list, into-tensor, coalesced) reduces to this: each rank contributes a byte stream
// of `bytesPerRank` bytes, scattered over `input`; rank q's stream lands in this rank's `outputByRank[q]`.
struct AllgatherPlan {
  size_t bytesPerRank = 0;
  std::vector<ByteSpan> input;
  std::vector<std::vector<ByteSpan>> outputByRank;
  // all_gather_into_tensor only (the same form on every rank, so every rank makes the same choice): the one
  // output tensor, rank q's bytes at outputBase + q * bytesPerRank. The direct path needs it.
  char* outputBase = nullptr;
};

// Every member derives the same chunking from the group's geometry and the message size alone, so chunk serials
// agree across ranks.
size_t chunkBytesFor(const AllgatherPlan& plan, const StagingGeometry& geometry);
size_t chunkCount(const AllgatherPlan& plan, const StagingGeometry& geometry);

// Enqueues the whole collective on `transport` and advances the group's chunk serial by chunkCount().
void scheduleAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t& chunkSerial);

// The direct path for a plan with an outputBase: `peerPosts[q]` holds rank q's posted {input, outputBase} when q
// arrived before this rank (this rank then moves both directions of the pair), else nothing. `serial` is the
// group's direct-collective serial.
struct PeerBuffers {
  bool posted = false;
  uint64_t input = 0;
  uint64_t outputBase = 0;
};
void scheduleDirectAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t serial,
                             const std::vector<PeerBuffers>& peerPosts);

}  // namespace sdma
