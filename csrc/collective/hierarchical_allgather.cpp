#include "collective/hierarchical_allgather.hpp"

#include <algorithm>

#include "collective/byte_spans.hpp"

namespace sdma {
namespace {

// Automatic chunking cuts a message into about this many chunks, so that the gather of one chunk between nodes runs
// while the one before fans out inside the node, but never into chunks below kSmallestPipelinedChunk a rank: each
// gather is a call of the inner backend with its own latency. Neither is measured yet on a real cluster
// (docs/multinode.md says what to measure); they are where to start.
constexpr size_t kPipelineDepth = 4;
constexpr size_t kSmallestPipelinedChunk = size_t{1} << 20;

}  // namespace

size_t hierarchicalChunkBytes(const AllgatherPlan& plan, const StagingGeometry& g, int nodes) {
  size_t fits = g.chunkBytes / static_cast<size_t>(nodes);
  fits = fits >= kPageBytes ? fits / kPageBytes * kPageBytes : std::max<size_t>(fits, 1);
  if (g.pipelineChunkBytes > 0) {  // TORCH_SDMA_CHUNK_BYTES
    return std::min(fits, g.pipelineChunkBytes);
  }
  const size_t share = roundUp((plan.bytesPerRank + kPipelineDepth - 1) / kPipelineDepth, kPageBytes);
  return std::min(fits, std::max(kSmallestPipelinedChunk, share));
}

size_t hierarchicalChunkCount(const AllgatherPlan& plan, const StagingGeometry& g, int nodes) {
  return divCeil(plan.bytesPerRank, hierarchicalChunkBytes(plan, g, nodes));
}

size_t hierarchicalSegmentBytes(const AllgatherPlan& plan, const StagingGeometry& g, int nodes) {
  const size_t chunk = std::min(hierarchicalChunkBytes(plan, g, nodes), plan.bytesPerRank);
  return static_cast<size_t>(nodes) * roundUp(chunk, kPageBytes);
}

void scheduleHierarchicalAllgather(Transport& t, InnerAllgather& rail, const NodeLayout& layout,
                                   const AllgatherPlan& plan, uint64_t& chunkCount) {
  const StagingGeometry& g = t.geometry();
  const int local = t.rank();
  const int node = rail.railRank();
  const int nodes = rail.railSize();
  const int me = layout.rankAt(node, local);
  const uint32_t slots = static_cast<uint32_t>(g.slots);
  const size_t chunkBytes = hierarchicalChunkBytes(plan, g, nodes);
  const size_t chunks = hierarchicalChunkCount(plan, g, nodes);
  // This collective's chunks take the transport's next serials, firstCount + k for chunk k.
  const uint64_t firstCount = chunkCount + 1;
  chunkCount += chunks;
  auto lengthOf = [&](size_t k) { return std::min(chunkBytes, plan.bytesPerRank - k * chunkBytes); };
  auto serialOf = [&](size_t k) { return static_cast<uint32_t>(firstCount + k); };
  auto slotOf = [&](size_t k) { return static_cast<int>(serialOf(k) & (slots - 1)); };

  // Chunk k's gather fills slot k's gathered buffer, which the push lane reads until chunk k has fanned out, so
  // chunk k + slots is gathered only after that; the first `slots` chunks are gathered up front, so that while
  // chunk k fans out inside the node, chunk k + 1 is already crossing between nodes.
  SpanCursor input(plan.input);
  auto gather = [&](size_t k) { rail.gather(slotOf(k), Lane::Push, input.take(lengthOf(k)), lengthOf(k)); };
  for (size_t k = 0; k < std::min<size_t>(chunks, slots); ++k) {
    gather(k);
  }

  // Own contribution: a local copy, or nothing when the input already is the output's own slot.
  copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);

  std::vector<SpanCursor> outputs = cursorsOver(plan.outputByRank);
  std::vector<std::vector<ByteSpan>> dst(plan.outputByRank.size());

  for (size_t k = 0; k < chunks; ++k) {
    const size_t len = lengthOf(k);
    const uint32_t serial = serialOf(k);
    const int slot = slotOf(k);
    for (size_t q = 0; q < outputs.size(); ++q) {
      dst[q] = outputs[q].take(len);
    }

    // Push what the rail gathered (one chunk per node) to the node's other ranks, then into our own output.
    if (firstCount + k > slots) {
      t.waitPeers(Lane::Push, Flag::Credit, slot, serial - slots);
    }
    rail.awaitGathered(Lane::Push, slot);
    char* gathered = rail.gathered(slot);
    t.pushChunkToPeers(Lane::Push, slot, gathered, static_cast<size_t>(nodes) * len, 0);
    t.signalPeers(Lane::Push, Flag::Ready, slot, serial);
    for (int m = 0; m < nodes; ++m) {
      if (m != node) {
        copyPieces(t, Lane::Push, dst[layout.rankAt(m, local)], {{gathered + m * len, len}});
      }
    }
    if (k + slots < chunks) {
      gather(k + slots);
    }

    // Drain what each other rank of the node gathered on its rail.
    t.waitPeers(Lane::Drain, Flag::Ready, slot, serial);
    for (int j = 0; j < g.worldSize; ++j) {
      if (j == local) {
        continue;
      }
      char* segment = t.localSegment(slot, j);
      for (int m = 0; m < nodes; ++m) {
        copyPieces(t, Lane::Drain, dst[layout.rankAt(m, j)], {{segment + m * len, len}});
      }
    }
    t.signalPeers(Lane::Drain, Flag::Credit, slot, serial);
  }
}

}  // namespace sdma
