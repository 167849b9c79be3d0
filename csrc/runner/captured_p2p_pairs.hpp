// Point-to-point captured into a CUDA graph (docs/design.md, "Captured point-to-point"): each step of a batch (a
// two-rank exchange, collective/p2p_batch.hpp) runs the captured exchange's schedule on a captured staging transport
// of its pair alone, connected at the pair's first captured op, in the batch's step order, which every rank shares
// (lower member, higher member, k): chains of waits then follow that order and never close a cycle. Before anything
// is enqueued, both members of each step compare what it moves through the pair's own store keys.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "collective/collective_info.hpp"
#include "collective/p2p_batch.hpp"
#include "runner/captured_lanes.hpp"

namespace sdma {

class CapturedP2pPairs {
 public:
  // `geometry`: the staging of each pair's captured transport (two members). On the current device.
  CapturedP2pPairs(int rank, int device, const StagingGeometry& geometry);

  bool connected(int peer) const {
    return pairs_.count(peer) != 0;
  }
  // Collective over the pair (both members call it at their first captured op with each other, in pair order within
  // a batch): connects its captured transport under `pairStore` (the pair's prefix of the group's store), the capture
  // mode relaxed. `members`: the pair's identities, in group-rank order.
  void connect(int peer, const c10::intrusive_ptr<c10d::Store>& pairStore, const std::vector<MemberIdentity>& members);

  // Enqueues `steps` (every peer connected) into the capture of `caller`, one after another in their order, and
  // returns the batch's Work. Where the two members of a step disagree on what it moves, or a peer never posts it,
  // calls `failGroup(reason)` and throws, nothing enqueued; the peer reads the same posts and refuses too.
  c10::intrusive_ptr<c10d::Work> enqueue(const std::vector<PairStep>& steps, const CollectiveInfo& info,
                                         gpu::Stream caller, const std::function<void(const std::string&)>& failGroup);

 private:
  struct Pair {
    c10::intrusive_ptr<c10d::Store> store;  // the pair's captured keys
    std::shared_ptr<CopyEngineTransport> transport;
    uint64_t steps = 0;  // captured steps so far, which number the keys of their size check
  };

  const int rank_;
  const int device_;
  const StagingGeometry geometry_;
  std::map<int, Pair> pairs_;  // by peer; only the caller's thread touches it
  CapturedLanes lanes_;
  std::shared_ptr<EventPool> endEvents_ = std::make_shared<EventPool>();
};

}  // namespace sdma
