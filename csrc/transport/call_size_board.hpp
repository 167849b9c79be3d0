// Where nothing else passes between the ranks' CPUs per call (staging on GPUs: each CPU only enqueues copies and
// flag operations), the bytes per rank of each call are posted here, so that ranks that passed different sizes
// fail the call instead of moving wrong bytes (docs/design.md, "Sizes agree").
//
// For serial s (1, 2, 3, ... per eager staging all-gather, alike on every member) a rank posts its size, then reads
// every peer's post for s, without waiting for one that is not there. Post and read are sequentially consistent, so
// of any two ranks at least one sees the other's post: if any two sizes differ, some rank sees a size unlike its own
// and refuses the call before it enqueues anything. Every other rank then waits on the GPU for that rank's chunks,
// which never come, and its watchdog finds the differing post here (peerPostedOtherSize) and fails the call. So a
// call with differing sizes completes on no rank.
//
// The posts live in memory every member maps (host shared memory): a ring of `depth` posts per rank. A rank
// overwrites its post for s - depth only after every peer has read the posts for s - depth (its `readUpTo`), so a
// post is never gone before a peer read it at enqueue; only a rank whose CPU is `depth` calls ahead of a peer's waits.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>

namespace sdma {

class CallSizeBoard {
 public:
  // post() waited for a peer that never posted the serial within the timeout.
  struct PeerNeverPosted : std::runtime_error {
    PeerNeverPosted(int peer, std::chrono::milliseconds waited)
        : std::runtime_error("a peer never posted its size"), peer(peer), waited(waited) {}
    int peer;
    std::chrono::milliseconds waited;
  };

  static size_t bytesFor(int worldSize, int depth) {
    return (sizeof(Header) + sizeof(Post) * static_cast<size_t>(depth)) * static_cast<size_t>(worldSize);
  }

  // `shared`: bytesFor() bytes, zeroed by whoever created them, mapped by every member at the same layout.
  CallSizeBoard(void* shared, int rank, int worldSize, int depth)
      : rank_(rank), size_(worldSize), depth_(static_cast<uint64_t>(depth)) {
    if (depth < 1) {
      throw std::invalid_argument("CallSizeBoard: depth must be at least 1");
    }
    headers_ = static_cast<Header*>(shared);
    posts_ = reinterpret_cast<Post*>(headers_ + size_);
  }

  struct Differing {
    int peer = -1;  // -1: every post this rank read carried its own size
    uint64_t peerBytes = 0;
  };

  // Posts `bytes` for `serial`, then reads every peer's post for it. Returns the first peer found with another size.
  // Waits while some peer has not yet read this rank's post for serial - depth, and, with `waitForPeers`, until
  // every peer has posted for `serial` (a call that connects memory meets its peers anyway, so that a rank with
  // another size is found before, not inside, the connect); past `timeout` throws. Called by one thread at a time.
  Differing post(uint64_t serial, uint64_t bytes, std::chrono::milliseconds timeout, bool waitForPeers = false) {
    const auto start = std::chrono::steady_clock::now();
    if (serial > depth_) {
      waitUntilPeersRead(serial - depth_, start + timeout);
    }
    // A seqlock's write: a watchdog may be reading the post for serial - depth this moment.
    Post& own = postOf(rank_, serial);
    own.serial.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    own.bytes.store(bytes, std::memory_order_relaxed);
    own.serial.store(serial, std::memory_order_seq_cst);
    Differing found;
    for (int q = 0; q < size_ && found.peer < 0; ++q) {
      if (q == rank_) {
        continue;
      }
      // A peer's post for `serial` is overwritten only after this rank's readUpTo reaches it, which comes below.
      const Post& theirs = postOf(q, serial);
      if (waitForPeers) {
        waitUntilPosted(q, serial, start, timeout);
      }
      if (theirs.serial.load(std::memory_order_seq_cst) == serial) {
        const uint64_t b = theirs.bytes.load(std::memory_order_relaxed);
        if (b != bytes) {
          found = {q, b};
        }
      }
    }
    // A rank that found another size goes no further: its readUpTo stays, and peers never overwrite the post that
    // their watchdogs look for.
    if (found.peer < 0) {
      headers_[rank_].readUpTo.store(serial, std::memory_order_release);
    }
    return found;
  }

  // For the watchdog, from any thread: the bytes per rank peer q posted for `serial` where they differ from
  // `bytesPerRank` (0 bytes included), else nothing (also when its post for `serial` is not, or no longer, there).
  std::optional<uint64_t> peerPostedOtherSize(int q, uint64_t serial, uint64_t bytesPerRank) const {
    const Post& theirs = postOf(q, serial);
    if (theirs.serial.load(std::memory_order_acquire) != serial) {
      return std::nullopt;
    }
    const uint64_t bytes = theirs.bytes.load(std::memory_order_relaxed);
    // Overwritten depth serials later (post() clears the serial first): read it again, so that bytes of a later
    // post count as gone.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (theirs.serial.load(std::memory_order_relaxed) != serial || bytes == bytesPerRank) {
      return std::nullopt;
    }
    return bytes;
  }

 private:
  struct alignas(64) Header {
    std::atomic<uint64_t> readUpTo;  // the last serial for which this rank read every peer's post
  };
  struct Post {
    std::atomic<uint64_t> serial;  // published after `bytes`: the size below belongs to it
    std::atomic<uint64_t> bytes;
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the board needs lock-free 64-bit atomics");

  Post& postOf(int owner, uint64_t serial) const {
    return posts_[static_cast<size_t>(owner) * depth_ + serial % depth_];
  }

  void waitUntilPosted(int q, uint64_t serial, std::chrono::steady_clock::time_point start,
                       std::chrono::milliseconds timeout) {
    while (postOf(q, serial).serial.load(std::memory_order_seq_cst) != serial) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited > timeout) {
        throw PeerNeverPosted(q, std::chrono::duration_cast<std::chrono::milliseconds>(waited));
      }
      std::this_thread::yield();
    }
  }

  void waitUntilPeersRead(uint64_t serial, std::chrono::steady_clock::time_point deadline) {
    for (int q = 0; q < size_; ++q) {
      while (q != rank_ && headers_[q].readUpTo.load(std::memory_order_acquire) < serial) {
        if (std::chrono::steady_clock::now() > deadline) {
          throw std::runtime_error("rank " + std::to_string(q) + " is " + std::to_string(depth_) +
                                   " or more all-gathers behind rank " + std::to_string(rank_) +
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
  Post* posts_;
};

}  // namespace sdma
