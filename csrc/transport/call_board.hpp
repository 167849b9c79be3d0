// One board per group on which every collective posts what it is, so that ranks that make different calls are named
// before a byte moves (docs/design.md, "The call board").
//
// Every collective of a group (every all-gather form, whichever path it takes, and every collective handed to the
// inner backend) has a sequence number, 1, 2, 3, ... alike on every member. For sequence number s a rank posts its
// call (the collective, the device and the way it goes, and for an all-gather its bytes per rank), then reads every
// peer's post for s without waiting for one that is not there. Post and read are sequentially consistent, so of any
// two ranks at least one sees the other's post: where two calls differ, some rank sees a call unlike its own and
// refuses it with nothing enqueued. Every other rank goes on, and whatever watches its call in flight (the
// copy-engine watchdog, the shared-memory worker's waits, the watcher of delegated calls) finds the differing post
// here (differing()) and fails it in the same words (describe()).
//
// The posts live in memory every member maps (a GroupRegion): a ring of `depth` posts per rank, one cache line each.
// A rank overwrites its post for s - depth only after every peer has read the posts for s - depth (its readUpTo), so
// a post is never gone before a peer read it when it posted; a rank that refuses stops reading and posting, so its
// post stays for the peers' watchers. Only a rank whose CPU is `depth` calls ahead of a peer's waits, and that wait
// ends with an error when the peer failed (its failedAt), or when the caller's `stop` says so (a peer exited, the
// group failed) or the timeout passes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sdma {

// The collectives a call may be, by the names of torch.distributed's functions.
enum class CallOp : uint16_t {
  kNone = 0,
  kAllgatherIntoTensor,
  kAllgather,
  kAllgatherIntoTensorCoalesced,
  kAllgatherCoalesced,
  kBroadcast,
  kAllreduce,
  kAllreduceSparse,
  kAllreduceCoalesced,
  kReduce,
  kGather,
  kScatter,
  kReduceScatter,
  kReduceScatterTensor,
  kReduceScatterTensorCoalesced,
  kAlltoallSingle,
  kAlltoall,
  kBarrier,
  kMonitoredBarrier,
  kCount,
};

inline const char* callOpName(CallOp op) {
  static constexpr const char* kNames[] = {"(none)",
                                           "all_gather_into_tensor",
                                           "all_gather",
                                           "all_gather_into_tensor_coalesced",
                                           "all_gather_coalesced",
                                           "broadcast",
                                           "all_reduce",
                                           "all_reduce (sparse)",
                                           "all_reduce_coalesced",
                                           "reduce",
                                           "gather",
                                           "scatter",
                                           "reduce_scatter",
                                           "reduce_scatter_tensor",
                                           "reduce_scatter_tensor_coalesced",
                                           "all_to_all_single",
                                           "all_to_all",
                                           "barrier",
                                           "monitored_barrier"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(CallOp::kCount), "a name per CallOp");
  const auto i = static_cast<size_t>(op);
  return i < static_cast<size_t>(CallOp::kCount) ? kNames[i] : "(unknown collective)";
}

// What one rank posts for one call. `route`: how it goes, which the call's form, the group's settings and the sizes
// decide alike on every rank that passes the same arguments; the DMA schedule within the route (direct, staging,
// captured, hierarchical) follows from the form and settings alone, so it is not posted.
struct CallPost {
  // kRefused: the rank refused the call on its own arguments, before it took any route; its peers' calls of that
  // sequence number fail instead of meeting the rank's next call.
  enum Route : uint8_t { kInnerCpu = 0, kInnerCuda = 1, kDmaCpu = 2, kDmaCuda = 3, kRefused = 4 };
  CallOp op = CallOp::kNone;
  uint8_t route = kInnerCpu;
  uint8_t dtype = 0;   // an all-gather's input dtype (c10::ScalarType), named in the words only
  uint64_t bytes = 0;  // an all-gather's bytes per rank; compared where a DMA route takes the call
  int32_t root = -1;   // broadcast's src, gather's dst, scatter's src (group ranks); -1 for the others
  bool isDma() const {
    return route == kDmaCpu || route == kDmaCuda;
  }
  bool operator==(const CallPost& o) const {
    return op == o.op && route == o.route && bytes == o.bytes && root == o.root;
  }
};

inline bool callsDiffer(const CallPost& a, const CallPost& b) {
  if (a.op != b.op || a.route != b.route || a.root != b.root) {
    return true;
  }
  // Only a DMA route moves an all-gather's bytes itself; the inner backend checks what it takes (uneven lists).
  return a.isDma() && a.bytes != b.bytes;
}

class CallBoard {
 public:
  // The board cannot go on: a peer failed, the caller's stop check fired, or the timeout passed.
  struct Stopped : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  // awaitPeers() waited for a peer that never posted the call within the timeout.
  struct PeerNeverPosted : std::runtime_error {
    PeerNeverPosted(int peer, std::chrono::milliseconds waited)
        : std::runtime_error("a peer never posted the call"), peer(peer), waited(waited) {}
    int peer;
    std::chrono::milliseconds waited;
  };
  // Says why a wait must end ("" to go on): a peer exited, the group failed. Checked every few milliseconds.
  using StopCheck = std::function<std::string()>;

  static size_t bytesFor(int members, int depth) {
    return (sizeof(Header) + sizeof(Slot) * static_cast<size_t>(depth)) * static_cast<size_t>(members);
  }

  // `shared`: bytesFor() bytes, zeroed by whoever created them, mapped by every member at the same layout.
  // `groupRanks[member]`: the group rank of each member (a node's members, for a group that spans nodes), named in
  // the words with `groupName`; `dtypeName` names a posted dtype.
  CallBoard(void* shared, int member, int members, int depth, std::vector<int> groupRanks = {},
            std::string groupName = "", std::string (*dtypeName)(uint8_t) = nullptr)
      : member_(member),
        size_(members),
        depth_(static_cast<uint64_t>(depth)),
        groupRanks_(std::move(groupRanks)),
        groupName_(std::move(groupName)),
        dtypeName_(dtypeName) {
    if (depth < 1) {
      throw std::invalid_argument("CallBoard: depth must be at least 1");
    }
    if (groupRanks_.empty()) {
      for (int q = 0; q < size_; ++q) {
        groupRanks_.push_back(q);
      }
    }
    headers_ = static_cast<Header*>(shared);
    slots_ = reinterpret_cast<Slot*>(headers_ + size_);
  }

  int member() const {
    return member_;
  }
  int members() const {
    return size_;
  }
  int groupRankOf(int member) const {
    return groupRanks_[member];
  }
  const std::string& groupName() const {
    return groupName_;
  }

  struct Differing {
    int peer = -1;  // -1: no post read differs
    CallPost post;  // the peer's
    explicit operator bool() const {
      return peer >= 0;
    }
  };

  // Posts `mine` for `seq`, then reads every peer's post for it. Returns the first peer found with another call;
  // the caller then refuses the call and calls fail(seq). Waits while some peer has not yet read this rank's post for
  // seq - depth. Called by one thread at a time, with seq growing by one per call.
  Differing post(uint64_t seq, const CallPost& mine, std::chrono::milliseconds timeout, const StopCheck& stop = {}) {
    if (seq > depth_) {
      waitUntilPeersRead(seq - depth_, std::chrono::steady_clock::now() + timeout, stop);
    }
    // A seqlock's write: a watcher may be reading the post for seq - depth this moment.
    Slot& own = slotOf(member_, seq);
    own.seq.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    own.what.store(pack(mine), std::memory_order_relaxed);
    own.bytes.store(mine.bytes, std::memory_order_relaxed);
    own.seq.store(seq, std::memory_order_seq_cst);
    Differing found;
    for (int q = 0; q < size_ && !found; ++q) {
      if (q == member_) {
        continue;
      }
      // A peer's post for `seq` is overwritten only after this rank's readUpTo reaches it, which comes below.
      const Slot& theirs = slotOf(q, seq);
      if (theirs.seq.load(std::memory_order_seq_cst) == seq) {
        const CallPost p =
            unpack(theirs.what.load(std::memory_order_relaxed), theirs.bytes.load(std::memory_order_relaxed));
        if (callsDiffer(mine, p)) {
          found = {q, p};
        }
      }
    }
    if (!found) {
      headers_[member_].readUpTo.store(seq, std::memory_order_release);
    }
    return found;
  }

  // After post(): waits until every peer has posted `seq` (or gone past it, which it does only agreeing with this
  // rank's post), and returns the first that posted another call. For a call that connects memory together, or that
  // has nothing to move and so no other way to meet its peers. Throws PeerNeverPosted past the timeout, Stopped when
  // a peer failed or `stop` says so.
  Differing awaitPeers(uint64_t seq, const CallPost& mine, std::chrono::milliseconds timeout,
                       const StopCheck& stop = {}) const {
    const auto start = std::chrono::steady_clock::now();
    auto nextCheck = start + kCheckEvery;
    for (int q = 0; q < size_; ++q) {
      if (q == member_) {
        continue;
      }
      for (uint64_t spin = 0;; ++spin) {
        if (auto p = postOf(q, seq)) {
          if (callsDiffer(mine, *p)) {
            return {q, *p};
          }
          break;
        }
        if (headers_[q].readUpTo.load(std::memory_order_acquire) >= seq) {
          break;
        }
        if (spin < 64) {
          continue;
        }
        const auto now = std::chrono::steady_clock::now();
        if (now >= nextCheck) {
          nextCheck = now + kCheckEvery;
          stopIfPeerFailed(q, stop);
          const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - start);
          if (waited > timeout) {
            throw PeerNeverPosted(q, waited);
          }
        }
        pause(now - start);
      }
    }
    return {};
  }

  // For a watcher, from any thread, at any time: a peer whose post for `seq` differs from `mine`. A post that is
  // not (or no longer) there differs from nothing.
  Differing differing(uint64_t seq, const CallPost& mine) const {
    for (int q = 0; q < size_; ++q) {
      if (q == member_) {
        continue;
      }
      if (auto p = postOf(q, seq); p && callsDiffer(mine, *p)) {
        return {q, *p};
      }
    }
    return {};
  }

  // Whether `member` reached `seq`: its post for it is there, or it went past it (it overwrites the post only after
  // every peer read it). For a watcher, from any thread, at any time.
  bool reached(int member, uint64_t seq) const {
    return postOf(member, seq).has_value() || headers_[member].readUpTo.load(std::memory_order_acquire) >= seq;
  }

  // Every peer went past `seq`: each saw this rank's post or this rank saw its, and both were alike.
  bool settled(uint64_t seq) const {
    for (int q = 0; q < size_; ++q) {
      if (q != member_ && headers_[q].readUpTo.load(std::memory_order_acquire) < seq) {
        return false;
      }
    }
    return true;
  }

  // This rank's group failed at `seq` (it refused it, or a watcher failed it), for `reason`: peers waiting for this
  // rank stop, and this process makes no further collectives on the group (failure()). The first reason stays.
  void fail(uint64_t seq, const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(reasonMutex_);
      if (reason_.empty()) {
        reason_ = reason;
      }
    }
    failed_.store(true, std::memory_order_release);
    uint64_t none = 0;
    headers_[member_].failedAt.compare_exchange_strong(none, seq == 0 ? 1 : seq, std::memory_order_seq_cst);
  }
  // Why this process's group failed ("" while it did not). Any thread; one load while it did not.
  std::string failure() const {
    if (!failed_.load(std::memory_order_acquire)) {
      return "";
    }
    std::lock_guard<std::mutex> lock(reasonMutex_);
    return reason_;
  }
  // The sequence number at which `member`'s group failed (0: it did not). Any thread.
  uint64_t failedAtOf(int member) const {
    return headers_[member].failedAt.load(std::memory_order_acquire);
  }
  // A peer whose group failed, and at which sequence number (0: none).
  std::pair<int, uint64_t> failedPeer() const {
    for (int q = 0; q < size_; ++q) {
      const uint64_t at = q == member_ ? 0 : headers_[q].failedAt.load(std::memory_order_acquire);
      if (at != 0) {
        return {q, at};
      }
    }
    return {-1, 0};
  }

  // The words every rank uses for a call that differs, whichever rank finds it: both calls in group-rank order,
  // e.g. "the ranks called different collectives: all_gather_into_tensor on rank 0 vs all_reduce on rank 1,
  // sequence number 7 of group '0'; ...".
  std::string describe(uint64_t seq, const CallPost& mine, const Differing& d) const {
    const int me = groupRanks_[member_];
    const int peer = groupRanks_[d.peer];
    const bool peerFirst = peer < me;
    const auto& [ra, a] = peerFirst ? std::pair<int, CallPost>{peer, d.post} : std::pair<int, CallPost>{me, mine};
    const auto& [rb, b] = peerFirst ? std::pair<int, CallPost>{me, mine} : std::pair<int, CallPost>{peer, d.post};
    const std::string where = ", sequence number " + std::to_string(seq) + " of group '" + groupName_ + "'";
    if (a.route == CallPost::kRefused || b.route == CallPost::kRefused) {
      const bool aRefused = a.route == CallPost::kRefused;
      const int refuser = aRefused ? ra : rb;
      const CallPost& refused = aRefused ? a : b;
      const CallPost& other = aRefused ? b : a;
      return "group rank " + std::to_string(refuser) + " refused its " + callOpName(refused.op) +
             " on its own arguments (its error says why) while group rank " + std::to_string(aRefused ? rb : ra) +
             (other.route == CallPost::kRefused ? " refused its " : " called ") + callOpName(other.op) + where +
             "; a call one rank refuses fails on every rank";
    }
    if (a.op != b.op) {
      return std::string("the ranks called different collectives: ") + callOpName(a.op) + " on rank " +
             std::to_string(ra) + " vs " + callOpName(b.op) + " on rank " + std::to_string(rb) + where +
             "; every rank must call the group's collectives in the same order";
    }
    if (a.root != b.root) {
      return std::string("the ranks passed different roots to ") + callOpName(a.op) + ": group rank " +
             std::to_string(ra) + " root " + std::to_string(a.root) + ", group rank " + std::to_string(rb) + " root " +
             std::to_string(b.root) + where + "; every rank must pass the same root";
    }
    if ((a.isDma() || b.isDma()) && a.bytes != b.bytes) {
      return std::string("the ranks passed inputs of different sizes to ") + callOpName(a.op) +
             " (bytes per rank: group rank " + std::to_string(ra) + " " + sizeOf(a) + ", group rank " +
             std::to_string(rb) + " " + sizeOf(b) + ")" + where + "; every rank must pass the same size";
    }
    return std::string("the ranks called ") + callOpName(a.op) + " on different paths: " + routeName(a.route) +
           " on rank " + std::to_string(ra) + " vs " + routeName(b.route) + " on rank " + std::to_string(rb) + where +
           "; every rank must pass tensors of the same device and size";
  }

 private:
  struct alignas(64) Header {
    std::atomic<uint64_t> readUpTo;  // the last seq for which this rank read every peer's post and agreed
    std::atomic<uint64_t> failedAt;  // the seq at which this rank's group failed (0: it did not)
  };
  struct alignas(64) Slot {
    std::atomic<uint64_t> seq;  // published after the rest: the call below belongs to it
    std::atomic<uint64_t> what;
    std::atomic<uint64_t> bytes;
  };
  static_assert(sizeof(Slot) == 64, "a post is one cache line");
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the board needs lock-free 64-bit atomics");
  static constexpr auto kCheckEvery = std::chrono::milliseconds(5);

  static uint64_t pack(const CallPost& p) {
    return static_cast<uint64_t>(p.op) | static_cast<uint64_t>(p.route) << 16 | static_cast<uint64_t>(p.dtype) << 24 |
           static_cast<uint64_t>(static_cast<uint32_t>(p.root + 1)) << 32;
  }
  static CallPost unpack(uint64_t what, uint64_t bytes) {
    CallPost p;
    p.op = static_cast<CallOp>(what & 0xffff);
    p.route = static_cast<uint8_t>(what >> 16);
    p.dtype = static_cast<uint8_t>(what >> 24);
    p.root = static_cast<int32_t>(static_cast<uint32_t>(what >> 32)) - 1;
    p.bytes = bytes;
    return p;
  }
  static const char* routeName(uint8_t route) {
    switch (route) {
      case CallPost::kInnerCpu:
        return "the inner backend on CPU tensors";
      case CallPost::kInnerCuda:
        return "the inner backend on CUDA tensors";
      case CallPost::kDmaCpu:
        return "DMA on CPU tensors";
      case CallPost::kDmaCuda:
        return "DMA on CUDA tensors";
      case CallPost::kRefused:
        return "refused on its own arguments";
      default:
        return "(unknown)";
    }
  }
  std::string sizeOf(const CallPost& p) const {
    return std::to_string(p.bytes) + " bytes" + (dtypeName_ ? " of " + dtypeName_(p.dtype) : "");
  }

  Slot& slotOf(int owner, uint64_t seq) const {
    return slots_[static_cast<size_t>(owner) * depth_ + seq % depth_];
  }
  // Peer q's post for `seq`, if it is there: read between two reads of its seq (a seqlock's read), so that a post
  // overwritten depth calls later counts as gone, never as another call.
  std::optional<CallPost> postOf(int q, uint64_t seq) const {
    const Slot& theirs = slotOf(q, seq);
    if (theirs.seq.load(std::memory_order_seq_cst) != seq) {
      return std::nullopt;
    }
    const uint64_t what = theirs.what.load(std::memory_order_relaxed);
    const uint64_t bytes = theirs.bytes.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (theirs.seq.load(std::memory_order_relaxed) != seq) {
      return std::nullopt;
    }
    return unpack(what, bytes);
  }

  void stopIfPeerFailed(int q, const StopCheck& stop) const {
    const uint64_t at = headers_[q].failedAt.load(std::memory_order_acquire);
    if (at != 0) {
      throw Stopped("group rank " + std::to_string(groupRanks_[q]) + " failed its collective of sequence number " +
                    std::to_string(at) + " and makes no further ones");
    }
    if (stop) {
      std::string why = stop();
      if (!why.empty()) {
        throw Stopped(why);
      }
    }
  }

  static void pause(std::chrono::steady_clock::duration waited) {
    if (waited < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void waitUntilPeersRead(uint64_t seq, std::chrono::steady_clock::time_point deadline, const StopCheck& stop) {
    const auto start = std::chrono::steady_clock::now();
    auto nextCheck = start + kCheckEvery;
    for (int q = 0; q < size_; ++q) {
      while (q != member_ && headers_[q].readUpTo.load(std::memory_order_acquire) < seq) {
        const auto now = std::chrono::steady_clock::now();
        if (now >= nextCheck) {
          nextCheck = now + kCheckEvery;
          stopIfPeerFailed(q, stop);
          if (now > deadline) {
            throw Stopped("group rank " + std::to_string(groupRanks_[q]) + " is " + std::to_string(depth_) +
                          " or more collectives behind group rank " + std::to_string(groupRanks_[member_]) +
                          " and did not catch up within the group's timeout");
          }
        }
        pause(now - start);
      }
    }
  }

  int member_;
  int size_;
  uint64_t depth_;
  std::vector<int> groupRanks_;
  std::string groupName_;
  std::string (*dtypeName_)(uint8_t);
  Header* headers_;
  Slot* slots_;
  std::atomic<bool> failed_{false};
  mutable std::mutex reasonMutex_;
  std::string reason_;
};

}  // namespace sdma
