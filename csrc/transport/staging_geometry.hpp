// How a group's staging area is cut into slots and segments. Every member derives the same geometry from the group
// size and the knobs, so a rank can compute where its chunk lands in a peer's staging without asking.
#pragma once

#include <cstddef>

namespace sdma {

// Chunks, segments and flag areas start on page boundaries, where copies run fastest.
constexpr size_t kPageBytes = 4096;

inline size_t divCeil(size_t bytes, size_t unit) {
  return (bytes + unit - 1) / unit;
}
inline size_t roundUp(size_t bytes, size_t align) {
  return divCeil(bytes, align) * align;
}

struct StagingGeometry {
  int worldSize = 0;
  int slots = 0;                  // a power of two, so that serial % slots survives wrap-around
  size_t chunkBytes = 0;          // one segment: the largest chunk
  size_t pipelineChunkBytes = 0;  // the chunk a message is cut into (at most chunkBytes); 0: automatic
  bool packs = true;              // false: no pack segment (the direct path's landing area, which packs nothing)

  // The geometry that fits `stagingBytes`: as many whole pages per segment as the slots and segments leave room
  // for, at least one page.
  static StagingGeometry fit(int worldSize, int slots, size_t stagingBytes, size_t pipelineChunkBytes,
                             bool packs = true) {
    StagingGeometry g;
    g.worldSize = worldSize;
    g.slots = slots;
    g.packs = packs;
    const size_t perSegment = stagingBytes / (static_cast<size_t>(slots) * g.segmentsPerSlot());
    g.chunkBytes = perSegment < kPageBytes ? kPageBytes : perSegment / kPageBytes * kPageBytes;
    g.pipelineChunkBytes = pipelineChunkBytes;
    return g;
  }

  // With two ranks a chunk that spans several tensors goes to the one peer piece by piece, as many copies as
  // packing it would take, so the room a pack segment would hold goes to the peer's segment instead: 256 MiB of
  // staging then carries 128 MiB chunks, not 64 (one 64 MiB copy-engine copy runs at about 356 GB/s on H200, one
  // of 512 MiB at 390). With more ranks packing saves a copy per peer per piece.
  bool hasPackSegment() const {
    return packs && worldSize > 2;
  }
  int segmentsPerSlot() const {
    const int n = worldSize - 1 + (hasPackSegment() ? 1 : 0);
    return n > 0 ? n : 1;
  }
  // Where srcRank's chunk lands in owner's staging (srcRank != owner).
  size_t segmentOffset(int slot, int srcRank, int owner) const {
    const int index = srcRank < owner ? srcRank : srcRank - 1;
    return (static_cast<size_t>(slot) * segmentsPerSlot() + index) * chunkBytes;
  }
  size_t packSegmentOffset(int slot) const {
    return (static_cast<size_t>(slot) * segmentsPerSlot() + worldSize - 1) * chunkBytes;
  }
  size_t bytes() const {
    return static_cast<size_t>(slots) * segmentsPerSlot() * chunkBytes;
  }
};

}  // namespace sdma
