// The all-gather through staging, written once for every transport: push each chunk into every peer's staging
// slot, wait for every peer's chunk, drain it into the output, hand the slot back.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/allgather_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Every member derives the same chunking from the group's geometry and the message size alone, so chunk serials
// agree across ranks.
size_t chunkBytesFor(const AllgatherPlan& plan, const StagingGeometry& geometry);
size_t chunkCount(const AllgatherPlan& plan, const StagingGeometry& geometry);

// Enqueues the whole collective on `transport` and advances the group's chunk serial by chunkCount().
void scheduleStagingAllgather(Transport& transport, const AllgatherPlan& plan, uint32_t& chunkSerial);

}  // namespace sdma
