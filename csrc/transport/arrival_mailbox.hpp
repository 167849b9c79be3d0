// Who arrived first at each collective, per pair of ranks, learned by the CPU at enqueue without waiting for the
// peer (docs/design-direct-push.md). Each rank posts its buffer addresses for serial s, then reads every peer's
// post for s: a peer whose post is already there arrived earlier, so this rank is the late one of that pair and
// will move the pair's bytes. Store-then-load, both sequentially consistent, guarantees that of two ranks at least
// one sees the other's post; both may (they arrived together), never neither.
//
// The posts live in memory every member maps (host shared memory): a ring of `depth` posts per rank. A rank
// overwrites its post for s - depth only after every peer has read it; every peer publishes the last serial it
// has read. Only a rank more than `depth` collectives ahead of a peer's CPU ever waits.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sdma {

// How a peer in another process maps the allocation a posted address lies in. The copy-engine transport needs it
// (peer_segments.hpp); the host transport reads and writes the poster's addresses as they are and posts none.
struct ExportedSegment {
  enum Kind : uint32_t { kNone = 0, kLegacyIpc = 1, kShareableFd = 2 };
  uint32_t kind = kNone;
  int32_t fd = -1;    // kShareableFd: the descriptor, in the poster's process
  uint64_t id = 0;    // never names two allocations of the poster, so a peer's mapping keyed by it is never stale
  uint64_t base = 0;  // the allocation's address in the poster's process
  uint64_t bytes = 0;
  char ipcHandle[64] = {};  // kLegacyIpc
};

struct BufferPost {
  uint64_t input = 0;   // peer-mappable address of the rank's input bytes
  uint64_t output = 0;  // peer-mappable address of the rank's whole output
  uint64_t bytes = 0;   // bytes per rank
  ExportedSegment inputSegment;
  ExportedSegment outputSegment;
};

class ArrivalMailbox {
 public:
  static size_t bytesFor(int worldSize, int depth) {
    return sizeof(Header) * static_cast<size_t>(worldSize) +
           sizeof(Slot) * static_cast<size_t>(worldSize) * static_cast<size_t>(depth);
  }

  // `shared`: bytesFor() bytes, zeroed by whoever created them, mapped by every member at the same layout.
  ArrivalMailbox(void* shared, int rank, int worldSize, int depth) : rank_(rank), size_(worldSize), depth_(depth) {
    if (depth < 1) {
      throw std::invalid_argument("ArrivalMailbox: depth must be at least 1");
    }
    headers_ = static_cast<Header*>(shared);
    slots_ = reinterpret_cast<Slot*>(static_cast<char*>(shared) + sizeof(Header) * static_cast<size_t>(size_));
  }

  // For serial s (1, 2, 3, ... on every rank): posts `mine`, then returns, per peer, the peer's post when the peer
  // had already posted s (this rank is late for that pair) or nothing (early). Entry rank() is always empty.
  // Waits only when a peer has not yet read this rank's post for s - depth; past `timeout` that throws.
  std::vector<std::optional<BufferPost>> arrive(uint64_t serial, const BufferPost& mine,
                                                std::chrono::milliseconds timeout) {
    waitUntilPeersRead(serial - std::min<uint64_t>(serial, depth_), timeout);
    Slot& own = slot(rank_, serial);
    own.post = mine;
    own.serial.store(serial, std::memory_order_seq_cst);

    std::vector<std::optional<BufferPost>> seen(size_);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        continue;
      }
      Slot& theirs = slot(q, serial);
      if (theirs.serial.load(std::memory_order_seq_cst) == serial) {
        seen[q] = theirs.post;
      }
    }
    headers_[rank_].readUpTo.store(serial, std::memory_order_release);
    return seen;
  }

  int rank() const {
    return rank_;
  }

 private:
  struct alignas(64) Header {
    std::atomic<uint64_t> readUpTo;  // the last serial for which this rank has read every peer's post
  };
  struct alignas(64) Slot {
    std::atomic<uint64_t> serial;  // published last: the post below belongs to it
    BufferPost post;
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the mailbox needs lock-free 64-bit atomics");

  Slot& slot(int owner, uint64_t serial) {
    return slots_[static_cast<size_t>(owner) * depth_ + serial % depth_];
  }

  void waitUntilPeersRead(uint64_t serial, std::chrono::milliseconds timeout) {
    if (serial == 0) {
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int q = 0; q < size_; ++q) {
      while (q != rank_ && headers_[q].readUpTo.load(std::memory_order_acquire) < serial) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw std::runtime_error("torch_sdma: rank " + std::to_string(q) + " is " + std::to_string(depth_) +
                                   " or more collectives behind rank " + std::to_string(rank_) +
                                   " and did not catch up within the group's timeout");
        }
        std::this_thread::yield();
      }
    }
  }

  int rank_;
  int size_;
  uint64_t depth_;
  Header* headers_;
  Slot* slots_;
};

}  // namespace sdma
