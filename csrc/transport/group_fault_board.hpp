// How each member of a group stands after a failure, in host memory every member maps (docs/design.md, "Failures").
//
// A member that fails the group publishes it here, with its reason, only after it stopped enqueueing and set an error
// on every call it had in flight; the peers' watchdogs read it (also while idle) and fail the group too. A failed
// member whose lanes have run out writes the release values into the flags of every failed peer, then publishes
// that it released them. The board is what lets a rank give up on a call without ever satisfying a wait of its own
// that gates a copy into a peer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace sdma {

class GroupFaultBoard {
 public:
  enum State : uint32_t {
    kHealthy = 0,
    kFailed = 1,    // enqueues nothing more; every call it had in flight carries an error
    kReleased = 2,  // failed, its lanes ran out, and it wrote the release values into every failed peer
    kLeft = 3,      // destroyed the group with nothing in flight: it signals nothing more, as if its process were gone
  };

  static size_t bytesFor(int worldSize) {
    return sizeof(Entry) * static_cast<size_t>(worldSize);
  }

  // `shared`: bytesFor() zeroed bytes mapped by every member at the same layout.
  GroupFaultBoard(void* shared, int rank, int worldSize)
      : entries_(static_cast<Entry*>(shared)), rank_(rank), size_(worldSize) {}

  int rank() const {
    return rank_;
  }
  int size() const {
    return size_;
  }

  // The reason goes first, the state after it: a peer that reads kFailed reads the whole reason.
  void publishFailed(const std::string& reason) {
    Entry& own = entries_[rank_];
    if (own.state.load(std::memory_order_relaxed) != kHealthy) {
      return;
    }
    const size_t n = std::min(reason.size(), sizeof(own.reason) - 1);
    std::memcpy(own.reason, reason.data(), n);
    own.reason[n] = '\0';
    own.state.store(kFailed, std::memory_order_seq_cst);
  }
  void publishReleased() {
    entries_[rank_].state.store(kReleased, std::memory_order_seq_cst);
  }
  void publishLeft() {
    entries_[rank_].state.store(kLeft, std::memory_order_seq_cst);
  }

  State stateOf(int q) const {
    return static_cast<State>(entries_[q].state.load(std::memory_order_seq_cst));
  }
  bool failed(int q) const {
    const State s = stateOf(q);
    return s == kFailed || s == kReleased;
  }
  // A failed peer's reason, as it published it.
  std::string reasonOf(int q) const {
    if (!failed(q)) {
      return "";
    }
    const Entry& e = entries_[q];
    return std::string(e.reason, strnlen(e.reason, sizeof(e.reason)));
  }
  // The first peer that failed the group, or -1.
  int firstFailedPeer() const {
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && failed(q)) {
        return q;
      }
    }
    return -1;
  }

 private:
  struct alignas(64) Entry {
    std::atomic<uint32_t> state;
    char reason[252];
  };
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "the fault board needs lock-free 32-bit atomics");

  Entry* entries_;
  int rank_;
  int size_;
};

}  // namespace sdma
