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
};

// Every member derives the same chunking from the group's geometry and the message size alone, so chunk serials
// agree across ranks.
size_t chunkBytesFor(const AllgatherPlan& plan, const StagingGeometry& geometry);
size_t chunkCount(const AllgatherPlan& plan, const StagingGeometry& geometry);

// Enqueues the whole collective on `transport` and advances the group's chunk serial by chunkCount().
void scheduleAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t& chunkSerial);

}  // namespace sdma
