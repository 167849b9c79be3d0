// The all-gather of a group that spans nodes (docs/multinode.md), written once for every transport: each chunk of
// every rank's stream is first gathered across the rank's rail by the inner backend, then each rank pushes what its
// rail gathered into the staging of the other ranks of its node, which drain it into their outputs. The node's
// transport never carries bytes between nodes; the inner backend never carries bytes inside a node.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/allgather_plan.hpp"
#include "collective/inner_allgather.hpp"
#include "collective/node_layout.hpp"
#include "transport/transport.hpp"

namespace sdma {

// The chunk every rank's stream is cut into. A segment of the node's transport carries one rank's gathered rail,
// `nodes` chunks, so chunks are at most a segment / nodes. Every member derives the same chunk from the message size,
// the node transport's geometry (the same on every node) and the node count.
size_t hierarchicalChunkBytes(const AllgatherPlan& plan, const StagingGeometry& nodeGeometry, int nodes);
// The most a segment of the node transport is filled with by this collective at `nodeGeometry`.
// The chunks such a message is cut into (hierarchicalChunkBytes each, the last one shorter).
size_t hierarchicalChunkCount(const AllgatherPlan& plan, const StagingGeometry& nodeGeometry, int nodes);
size_t hierarchicalSegmentBytes(const AllgatherPlan& plan, const StagingGeometry& nodeGeometry, int nodes);

// Enqueues the whole collective: `node` spans this rank's node (its rank is this rank's local index), `rail` this
// rank's rail; `layout` maps (node, local index) to the group ranks `plan` is indexed by. Advances `chunkCount` by the
// chunk count, as the flat schedule does (staging_allgather.hpp), on the node transport's flags.
void scheduleHierarchicalAllgather(Transport& node, InnerAllgather& rail, const NodeLayout& layout,
                                   const AllgatherPlan& plan, uint64_t& chunkCount);

}  // namespace sdma
