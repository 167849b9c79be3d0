// The small interface the all-gather schedule is written against: copy, push, signal, wait.
//
// Every member of a group owns a staging area of `slots` slots; a slot holds one segment per peer, each
// `chunkBytes` long, plus (groups of three or more) one in which the rank packs a chunk that spans several input
// tensors. A rank pushes chunk data into its segment of the slot in every peer and then signals READY;
// the peer drains the segment into the user's output and signals CREDIT back, which frees the slot for reuse.
// Flags live in the memory of the rank that waits on them, so every wait is on local memory. Flag values are
// per-group chunk serials compared cyclically, so they never need resetting.
//
// Operations are issued on one of two lanes. A transport may run the lanes concurrently (the copy-engine
// transport maps them to two GPU streams so pushes overlap drains) or serially (the host transport has one
// worker); the schedule is correct either way because it only depends on flags, never on lane timing.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sdma {

// Chunks, segments and flag areas start on page boundaries, where copies run fastest.
constexpr size_t kPageBytes = 4096;

inline size_t roundUp(size_t bytes, size_t align) {
  return (bytes + align - 1) / align * align;
}

enum class Lane : int { Push = 0, Drain = 1 };
enum class Flag : int { Ready = 0, Credit = 1, Arrived = 2, Done = 3 };
constexpr int kFlagKinds = 4;

struct StagingGeometry {
  int worldSize = 0;
  int slots = 0;  // a power of two, so that serial % slots survives wrap-around
  size_t chunkBytes = 0;          // one segment: the largest chunk
  size_t pipelineChunkBytes = 0;  // the chunk a message is cut into (at most chunkBytes); 0: automatic

  // With two ranks a chunk that spans several tensors goes to the one peer piece by piece, as many copies as
  // packing it would take, so the room a pack segment would hold goes to the peer's segment instead: 256 MiB of
  // staging then carries 128 MiB chunks, not 64 (one 64 MiB copy-engine copy runs at about 356 GB/s on H200, one
  // of 512 MiB at 390). With more ranks packing saves a copy per peer per piece.
  bool hasPackSegment() const {
    return worldSize > 2;
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

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual const StagingGeometry& geometry() const = 0;

  // Where srcRank's chunk lands in this rank's own staging area.
  virtual char* localSegment(int slot, int srcRank) = 0;
  // Where this rank packs a chunk spanning several tensors (only where geometry().hasPackSegment()).
  virtual char* packSegment(int slot) = 0;

  virtual void copyLocal(Lane lane, void* dst, const void* src, size_t bytes) = 0;
  // Into this rank's segment of the slot in every peer, `at` bytes into it.
  virtual void pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) = 0;
  // Sets flag[rank()][slot] = value in every peer's memory, after the lane's earlier operations completed.
  virtual void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) = 0;
  // Holds the lane until flag[peer][slot] >= value (cyclically) for every peer.
  virtual void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) = 0;

  // The direct path (docs/design-direct-push.md): one peer's buffers, by the address that peer posted, and flags
  // of one peer (slot 0 of Arrived and Done). Transports without it never see these calls.
  virtual void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) = 0;
  virtual void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) = 0;
  virtual void signalPeer(Lane lane, int peer, Flag flag, uint32_t value) = 0;
  virtual void waitPeer(Lane lane, int peer, Flag flag, uint32_t value) = 0;
};

}  // namespace sdma
