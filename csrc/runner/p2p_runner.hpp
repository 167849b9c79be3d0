// What the backend asks of a device's point-to-point runner (docs/design.md, "Point-to-point"). It owns one
// transport per pair of ranks that has exchanged point-to-point, connected at the pair's first operation by the two
// members alone (third ranks never call), and runs batches of pair steps (collective/p2p_batch.hpp) on them in this
// rank's call order. It is not the group's collective runner: that one connects collectively, at the group's first
// DMA collective, which may come after a pair's first send, so the route of a send may not depend on it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/collective_info.hpp"
#include "collective/collective_path.hpp"
#include "collective/p2p_batch.hpp"
#include "runner/collective_runner.hpp"
#include "runner/group_failure.hpp"
#include "transport/call_board.hpp"

namespace sdma {

class P2pRunner {
 public:
  virtual ~P2pRunner() = default;

  // The pair with `peer`'s path, the DMA path or the inner backend and why, alike on both members (both call it at
  // their first operation with each other, in pair order within a batch). Decided without the peer; the pair's
  // transport connects on the runner's thread, collectively over the pair, before the pair's first batch is posted,
  // so the caller never waits for the peer. Only the copy engines' captured state connects here, at the pair's first
  // captured op, and throws where the peer never came within the group's timeout.
  virtual CollectivePath connectPair(int peer) = 0;
  // Enqueues `steps` (every one on a pair whose connectPair said DMA) as one batch: every step's post in its pair's
  // mailbox first, then the batch's schedule; on the caller's thread only where nothing there waits for a peer (the
  // pairs connected, room in their rings of posts and on the lanes, nothing queued before), else on the runner's
  // thread in call order, the Work complete once that thread enqueued and the copies ended. Throws before enqueuing
  // anything where a step's peer posted another operation; the group has then failed. `nextCollective`: the group's
  // next sequence number, at which a failure of this batch fails the group on the call board.
  virtual c10::intrusive_ptr<c10d::Work> run(std::vector<PairStep> steps, const CollectiveInfo& info,
                                             uint64_t nextCollective) = 0;
  // This rank refused an op with `peer` (connectPair said DMA) on its own arguments, for `why`: the op still takes
  // the pair's next serial, posted as refused (`directions`: what it would have moved), so that the peer's op of that
  // serial fails naming this rank and `why` instead of meeting this rank's next op; then the group fails here too.
  // Never throws: the refusal itself is the caller's error.
  virtual void refuse(int peer, uint64_t directions, const std::string& why, const CollectiveInfo& info,
                      uint64_t nextCollective) = 0;
};

// Where a peer's op reads why this rank refused its op of the pair's `serial` (the group's store); the pairs of CUDA
// tensors count their serials apart from those of CPU tensors.
inline std::string p2pRefusalKey(int rank, int peer, uint64_t serial, bool cuda = false) {
  return std::string(cuda ? "p2p/cuda/" : "p2p/") + std::to_string(std::min(rank, peer)) + "-" +
         std::to_string(std::max(rank, peer)) + "/refused/" + std::to_string(serial) + "/" + std::to_string(rank);
}

// The refuser's words under `key`, "" where they are not there. Written before the refused post, but through the
// store's server, which may serve this read first: looked for a moment, an error path's cost only.
inline std::string readP2pRefusal(c10d::Store& store, const std::string& key) {
  try {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
    bool there = store.check({key});
    while (!there && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      there = store.check({key});
    }
    if (there) {
      const std::vector<uint8_t> bytes = store.get(key);
      return std::string(bytes.begin(), bytes.end());
    }
  } catch (const std::exception&) {
    // the refusal is named without its error
  }
  return "";
}

// Before a batch is posted: refused where the group failed, as this runner saw it (`failure`, under `mutex`) or as
// the call board says (a collective's failure, or a pair's of another runner of the group).
inline void refuseBatchOfFailedGroup(std::mutex& mutex, const GroupFailure& failure, CallBoard* board,
                                     const CollectiveInfo& info) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    failure.refuse(info);
  }
  if (board) {
    const std::string failed = board->failure();
    TORCH_CHECK_WITH(DistBackendError, failed.empty(), "torch_sdma: ", info.describe(),
                     " refused: an earlier collective on this group failed: ", failed);
  }
}

// Shared memory, for CPU tensors (host_p2p_runner.cpp). `store`: the group's own, which a pair's connect reads under
// "p2p/<lo>-<hi>/" within the group's timeout. `board`: the group's call board (null where it has none).
std::unique_ptr<P2pRunner> makeHostP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, CallBoard* board);
// Copy engines, for CUDA tensors of GPU `device` (copy_engine_p2p_runner.cpp; a build without CUDA has none and
// throws). `options`: the group's direct path's (the peer wait). `cap`: the group's staging, whose size each pair's
// captured staging takes.
std::unique_ptr<P2pRunner> makeCopyEngineP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int device,
                                                   CallBoard* board, const DirectPathOptions& options,
                                                   const StagingGeometry& cap);

}  // namespace sdma
