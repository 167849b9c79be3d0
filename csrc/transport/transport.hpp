// The small interface the all-gather schedules are written against: copy, push, signal, wait.
//
// Every member of a group owns a staging area (staging_geometry.hpp). A rank pushes chunk data into its segment of
// a slot in every peer and then signals READY; the peer drains the segment into the user's output and signals
// CREDIT back, which frees the slot for reuse. Flags live in the memory of the rank that waits on them, so every
// wait is on local memory. Flag values are per-group chunk serials compared cyclically, so they never need
// resetting.
//
// Operations are issued on one of two lanes. A transport may run the lanes concurrently (the copy-engine
// transport maps them to two GPU streams so pushes overlap drains) or serially (the host transport has one
// worker); the schedule is correct either way because it only depends on flags, never on lane timing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/staging_geometry.hpp"

namespace sdma {

enum class Lane : int { Push = 0, Drain = 1 };
enum class Flag : int { Ready = 0, Credit = 1, Arrived = 2, Done = 3 };
constexpr int kFlagKinds = 4;

// Flag values are serials that may wrap: a flag has reached `serial` when it is at most 2^31 ahead of it.
inline bool flagReached(uint32_t flag, uint32_t serial) {
  return static_cast<int32_t>(flag - serial) >= 0;
}

// The direct path (docs/design.md, "Direct"): one peer's buffers, by the address that peer posted, and one peer's
// flags: flag[this rank][slot] in the peer's memory, flag[peer][slot] in this rank's. Arrived and Done use slot 0;
// a relayed broadcast (relayed_broadcast.hpp) uses Ready and Credit of a slot per chunk. A capability some transports
// have; see Transport::direct().
class DirectTransport {
 public:
  virtual ~DirectTransport() = default;
  virtual void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) = 0;
  virtual void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) = 0;
  virtual void signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) = 0;
  virtual void waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) = 0;
  // The same wait, on the lane that operations naming `lanePeer` run on (its peer lane, where the transport has
  // them): a relayed broadcast forwards to lanePeer what `peer` sent this rank.
  virtual void waitPeerOnLaneOf(Lane lane, int lanePeer, int peer, Flag flag, int slot, uint32_t value) {
    (void)lanePeer;
    waitPeer(lane, peer, flag, slot, value);
  }
  // Holds lane `into` until what was issued on lane `from` so far is done (nothing where the lanes run serially).
  virtual void joinLane(Lane into, Lane from) = 0;
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
  // Into this rank's segment of the slot in one peer, `at` bytes into it.
  virtual void pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) = 0;
  // Sets flag[rank()][slot] = value in every peer's memory, after the lane's earlier operations completed.
  virtual void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) = 0;
  // Holds the lane until flag[peer][slot] has reached `value` (flagReached) for every peer.
  virtual void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) = 0;
  // Sets this rank's own flag[peer][slot] = 0 for every peer, after the lane's earlier operations. A schedule
  // whose flag values cannot be serials (a captured graph replays the same values) returns them to 0 this way.
  virtual void resetOwnFlags(Lane lane, Flag flag, int slot) = 0;

  // The direct-path operations, or null where this transport (or this group) has none.
  virtual DirectTransport* direct() {
    return nullptr;
  }
};

}  // namespace sdma
