// Who moves which bytes of each collective, per pair of ranks, agreed by the CPUs at enqueue
// (docs/design.md, "Direct"). Each rank posts its buffer addresses for serial s, then reads every peer's post
// for s. A peer whose post is already there arrived earlier: this rank knows its buffers. A peer that has not
// posted yet is waited for, at most `peerWait`; one that posts within it knows ours and we know its.
//
// A pair ends in one of two ways, settled by one compare-and-swap on a word of the earlier rank's post:
// - each pushes its own bytes into the other's output (the later rank claimed the word while the earlier one was
//   still waiting, or both arrived together): both copy engines work, one direction each;
// - the later rank came late (the earlier one stopped waiting first and closed the word): the earlier rank never
//   learns the later one's addresses, and the later rank moves both directions (collective/direct_allgather.hpp).
// A rank never enqueues work for a collective after it returned from arrive(), so no copy of ours ever queues
// behind a wait that needs it.
//
// The posts live in memory every member maps (host shared memory): a ring of `depth` posts per rank. A rank
// overwrites its post for s - depth only after every peer has read it; every peer publishes the last serial it
// has read. Only a rank more than `depth` collectives ahead of a peer's CPU ever waits for longer than lateWait.
//
// Lateness that outlasts one collective is paid once: the earlier rank stops waiting after `peerWait` (the copy
// that moving both adds), but then waits up to `lateWait` at the next collective for the same peer. Without that, a
// peer whose CPU fell behind by more than peerWait (a preemption, a slow Python step) stayed behind, since nobody
// waited for it, and moved both directions at every collective of the run at half the rate (2x H200, 64 MiB in
// place: every call of a 40-call loop, 195 us against 101). A rank that waited the long wait in vain goes back to
// short waits until the pair pushes its own bytes again, so a peer that is always far behind costs one long wait.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

// How this rank and one peer settled their pair (the comment at the top).
enum class Pairing : uint32_t {
  kPeerCameLate = 0,   // this rank stopped waiting for the peer: it never learns the peer's buffers
  kThisCameLate = 1,   // the peer stopped waiting for this rank: this rank knows the peer's buffers, not vice versa
  kEachPushesOwn = 2,  // both know both buffers: each pushes its own bytes into the other's output
};

// An exchange (collective/exchange_plan.hpp) posts, per peer, the range of its input it sends that peer and the range
// of its output that peer's bytes fill, so that each side of a pair can copy either direction and check the other
// agrees on the sizes.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
struct PairRanges {
  ByteRange sends;    // of the poster's input, for the peer
  ByteRange expects;  // of the poster's output, from the peer
};

// The largest group whose mailbox carries ranges: every post carries them for every peer, so the mailbox grows with
// the square of the group's size. Larger groups exchange by the inner backend.
constexpr int kMaxExchangeRanks = 16;

struct BufferPost {
  uint64_t input = 0;   // peer-mappable address of the rank's input bytes
  uint64_t output = 0;  // peer-mappable address of the rank's whole output
  uint64_t bytes = 0;   // bytes per rank
  ExportedSegment inputSegment;
  ExportedSegment outputSegment;
};

class ArrivalMailbox {
 public:
  // `withRanges`: every post has room for PairRanges per peer (an exchange's), which grows the mailbox by a factor of
  // about the group's size.
  static size_t bytesFor(int worldSize, int depth, bool withRanges = false) {
    const size_t posts = static_cast<size_t>(worldSize) * static_cast<size_t>(depth);
    return sizeof(Header) * static_cast<size_t>(worldSize) + sizeof(Slot) * posts +
           sizeof(std::atomic<uint32_t>) * posts * static_cast<size_t>(worldSize) +
           (withRanges ? 8 + sizeof(PairRanges) * posts * static_cast<size_t>(worldSize) : 0);
  }

  // `shared`: bytesFor() bytes, zeroed by whoever created them, mapped by every member at the same layout.
  ArrivalMailbox(void* shared, int rank, int worldSize, int depth, bool withRanges = false)
      : rank_(rank), size_(worldSize), depth_(depth), lateness_(static_cast<size_t>(worldSize), Lateness::kOnTime) {
    if (depth < 1) {
      throw std::invalid_argument("ArrivalMailbox: depth must be at least 1");
    }
    headers_ = static_cast<Header*>(shared);
    slots_ = reinterpret_cast<Slot*>(static_cast<char*>(shared) + sizeof(Header) * static_cast<size_t>(size_));
    claims_ = reinterpret_cast<std::atomic<uint32_t>*>(slots_ + static_cast<size_t>(size_) * depth_);
    if (withRanges) {
      const size_t claims = static_cast<size_t>(size_) * depth_ * static_cast<size_t>(size_);
      // Claims are 4-byte words; ranges are 8-byte aligned after them (size * size * depth is a multiple of 2 only
      // when depth is even: round up).
      ranges_ = reinterpret_cast<PairRanges*>(reinterpret_cast<char*>(claims_) + ((claims * 4 + 7) & ~size_t{7}));
    }
  }
  bool carriesRanges() const {
    return ranges_ != nullptr;
  }

  struct PeerArrival {
    Pairing pairing = Pairing::kPeerCameLate;
    BufferPost post;    // the peer's, unless pairing is kPeerCameLate
    PairRanges ranges;  // what the peer posted about its pair with this rank (an exchange), likewise
  };

  // How this rank's pairs have settled so far, one count per peer per collective (torch_sdma.stats shows them):
  // each pushing its own bytes, or one of the two late.
  struct PairTally {
    uint64_t eachPushingOwn = 0;
    uint64_t oneLate = 0;
  };
  PairTally tally() const {
    return {eachPushingOwn_.load(std::memory_order_relaxed), oneLate_.load(std::memory_order_relaxed)};
  }

  // For serial s (1, 2, 3, ... on every rank): posts `mine`, then settles every pair (entry rank() is left
  // kPeerCameLate and unused). Waits up to `peerWait` for peers that have not posted, up to `lateWait` for one this
  // rank stopped waiting for at the previous collective (the comment at the top); longer only when a peer has not
  // yet read this rank's post for s - depth, and past `timeout` that throws. Called by one thread at a time.
  // `ranges` (an exchange, on a mailbox that carriesRanges()): per peer, what this rank posts about its pair with it.
  std::vector<PeerArrival> arrive(uint64_t serial, const BufferPost& mine, std::chrono::milliseconds timeout,
                                  std::chrono::microseconds peerWait = std::chrono::microseconds(0),
                                  std::chrono::microseconds lateWait = std::chrono::microseconds(0),
                                  const std::vector<PairRanges>* ranges = nullptr) {
    waitUntilPeersRead(serial - std::min<uint64_t>(serial, depth_), timeout);
    // A seqlock's write: a peer's watchdog may be reading the post for serial - depth this moment.
    Slot& own = slot(rank_, serial);
    own.serial.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    own.post = mine;
    for (int q = 0; q < size_; ++q) {
      claim(rank_, serial, q).store(kOpen, std::memory_order_relaxed);
      if (ranges_) {
        rangesOf(rank_, serial, q) = ranges ? (*ranges)[q] : PairRanges{};
      }
    }
    own.serial.store(serial, std::memory_order_seq_cst);

    std::vector<PeerArrival> settled(size_);
    std::vector<int> notYetHere;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        continue;
      }
      Slot& theirs = slot(q, serial);
      if (theirs.serial.load(std::memory_order_seq_cst) == serial) {
        // It posted first, or with us: unless it already stopped waiting, it pushes its own bytes.
        uint32_t open = kOpen;
        const bool claimed = claim(q, serial, rank_).compare_exchange_strong(open, kClaimed, std::memory_order_seq_cst);
        settled[q] = {claimed ? Pairing::kEachPushesOwn : Pairing::kThisCameLate, theirs.post, rangesFor(q, serial)};
      } else {
        notYetHere.push_back(q);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    for (int q : notYetHere) {
      const auto deadline = start + (lateness_[q] == Lateness::kLateOnce ? std::max(peerWait, lateWait) : peerWait);
      std::atomic<uint32_t>& word = claim(rank_, serial, q);
      while (word.load(std::memory_order_acquire) == kOpen && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      uint32_t open = kOpen;
      if (!word.compare_exchange_strong(open, kClosed, std::memory_order_seq_cst)) {
        // Claimed: the peer posted before it claimed, and reads our post again only after we mark it read.
        settled[q] = {Pairing::kEachPushesOwn, slot(q, serial).post, rangesFor(q, serial)};
      } else {
        lateness_[q] = lateness_[q] == Lateness::kOnTime ? Lateness::kLateOnce : Lateness::kLateAgain;
      }
    }
    headers_[rank_].readUpTo.store(serial, std::memory_order_release);
    uint64_t eachOwn = 0;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && settled[q].pairing == Pairing::kEachPushesOwn) {
        ++eachOwn;
        lateness_[q] = Lateness::kOnTime;
      }
    }
    eachPushingOwn_.fetch_add(eachOwn, std::memory_order_relaxed);
    oneLate_.fetch_add(static_cast<uint64_t>(size_ - 1) - eachOwn, std::memory_order_relaxed);
    return settled;
  }

  int rank() const {
    return rank_;
  }
  int depth() const {
    return static_cast<int>(depth_);
  }

  // Whether arrive(serial) would find its ring slot free at once: every peer has read this rank's post for
  // serial - depth. Any thread; for a caller that must not wait for room and posts elsewhere while there is none.
  bool roomFor(uint64_t serial) const {
    if (serial <= depth_) {
      return true;
    }
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && headers_[q].readUpTo.load(std::memory_order_acquire) < serial - depth_) {
        return false;
      }
    }
    return true;
  }

  // For the watchdog, from any thread: whether peer q's CPU has posted for `serial` (what a peer never reached is
  // read here, not from a GPU flag).
  bool peerReached(int q, uint64_t serial) const {
    return headers_[q].readUpTo.load(std::memory_order_acquire) >= serial ||
           slot(q, serial).serial.load(std::memory_order_acquire) == serial;
  }
  // Peer q's post for `serial` and what it posted about its pair with this rank, once it is there (false while it
  // is not, or no longer is). For a rank that did not wait for q at arrive() and so never read it there: the pair's
  // other side then moves both directions, and this rank only compares what the two posted.
  bool readPeerPost(int q, uint64_t serial, BufferPost* post, PairRanges* ranges) {
    Slot& theirs = slot(q, serial);
    if (theirs.serial.load(std::memory_order_acquire) != serial) {
      return false;
    }
    BufferPost copied;
    std::memcpy(static_cast<void*>(&copied), static_cast<const void*>(&theirs.post), sizeof(BufferPost));
    const PairRanges r = rangesFor(q, serial);
    // A seqlock's read: overwritten meanwhile (depth serials later), the copy is torn and counts as gone.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (theirs.serial.load(std::memory_order_relaxed) != serial) {
      return false;
    }
    *post = copied;
    *ranges = r;
    return true;
  }
  // The bytes per rank peer q posted for `serial` where they differ from `bytesPerRank` (0 bytes included), else
  // nothing (also when its post for `serial` is not, or no longer, there).
  std::optional<uint64_t> peerPostedOtherSize(int q, uint64_t serial, uint64_t bytesPerRank) const {
    const auto bytes = peerPostedBytes(q, serial);
    return bytes && *bytes != bytesPerRank ? bytes : std::nullopt;
  }
  // The bytes word of peer q's post for `serial`, while that post is there.
  std::optional<uint64_t> peerPostedBytes(int q, uint64_t serial) const {
    const Slot& theirs = slot(q, serial);
    if (theirs.serial.load(std::memory_order_acquire) != serial) {
      return std::nullopt;
    }
    const uint64_t bytes = __atomic_load_n(&theirs.post.bytes, __ATOMIC_RELAXED);
    // Overwritten depth serials later (arrive() clears the serial first): read it again, so that bytes of a later
    // post count as gone.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (theirs.serial.load(std::memory_order_relaxed) != serial) {
      return std::nullopt;
    }
    return bytes;
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
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "the mailbox needs lock-free 32-bit atomics");

  // A word of owner's post for `serial`, one per peer: open while the owner may still push its own bytes to that
  // peer, claimed by the peer (it will, and the peer pushes its own), or closed by the owner (the peer came late).
  static constexpr uint32_t kOpen = 0;
  static constexpr uint32_t kClaimed = 1;
  static constexpr uint32_t kClosed = 2;

  Slot& slot(int owner, uint64_t serial) const {
    return slots_[static_cast<size_t>(owner) * depth_ + serial % depth_];
  }
  std::atomic<uint32_t>& claim(int owner, uint64_t serial, int peer) {
    return claims_[(static_cast<size_t>(owner) * depth_ + serial % depth_) * size_ + peer];
  }
  // Written before the post's serial is published, read after it is seen and before readUpTo says so: a peer
  // overwrites them only once this rank marked them read.
  PairRanges& rangesOf(int owner, uint64_t serial, int peer) {
    return ranges_[(static_cast<size_t>(owner) * depth_ + serial % depth_) * size_ + peer];
  }
  PairRanges rangesFor(int owner, uint64_t serial) {
    return ranges_ ? rangesOf(owner, serial, rank_) : PairRanges{};
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

  // Per peer, as this rank last found it when it had to wait for it (the comment at the top).
  enum class Lateness : uint8_t {
    kOnTime,     // came within the short wait, or this rank did not wait for it
    kLateOnce,   // missed the short wait at the previous collective: waited for up to lateWait at the next
    kLateAgain,  // missed the long wait too: short waits until the pair pushes its own bytes again
  };

  int rank_;
  int size_;
  uint64_t depth_;
  std::vector<Lateness> lateness_;
  Header* headers_;
  Slot* slots_;
  std::atomic<uint32_t>* claims_;
  PairRanges* ranges_ = nullptr;
  std::atomic<uint64_t> eachPushingOwn_{0};  // this process's counts, not shared
  std::atomic<uint64_t> oneLate_{0};
};

}  // namespace sdma
