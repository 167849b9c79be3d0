// The step between nodes of the hierarchical all-gather (docs/multinode.md): an all-gather across this rank's rail
// (the ranks with its local index on every node) by an inner backend (gloo, NCCL), which owns the network. The
// schedule never moves bytes between nodes itself.
//
// Gathers run in their own order, beside the transport's lanes (on GPUs, on a stream of their own, so that the
// gather of one chunk overlaps the fan-out of the one before inside the node; on CPU the host runner's worker runs
// everything in the order it was scheduled). The lanes and the gathers meet only where a method names a lane.
#pragma once

#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

class InnerAllgather {
 public:
  virtual ~InnerAllgather() = default;

  // One member per node; a rank's rail rank is its node's index.
  virtual int railSize() const = 0;
  virtual int railRank() const = 0;

  // Where slot's gathers land: rail member m's bytes at m * (the gather's bytes). Holds railSize() chunks of the
  // node transport's segment size.
  virtual char* gathered(int slot) = 0;
  // Once `after`'s operations scheduled so far have run, gathers `bytes` (this rank's part, in pieces) from every
  // rail member into gathered(slot). Every rail member schedules the same gathers in the same order.
  virtual void gather(int slot, Lane after, const std::vector<ByteSpan>& mine, size_t bytes) = 0;
  // Holds `lane` until slot's last scheduled gather has landed.
  virtual void awaitGathered(Lane lane, int slot) = 0;
};

}  // namespace sdma
