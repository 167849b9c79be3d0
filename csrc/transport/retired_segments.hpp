// How a rank tells the members of a group that allocations it exported to them are gone: one ring per member in
// host memory they share, written by its owner only, read by every peer at its next direct all-gather. A peer then
// drops its mapping of each retired allocation (once no copy in flight uses it), so that the memory the owner freed
// is really given back. Ids are never reused, so a retirement never names a live allocation.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace sdma {

struct RetiredSegment {
  uint32_t kind = 0;  // ExportedSegment::Kind
  uint64_t id = 0;
};

class RetiredSegmentLog {
 public:
  static constexpr uint64_t kEntries = 1024;

  static size_t bytesFor(int worldSize) {
    return sizeof(Ring) * static_cast<size_t>(worldSize);
  }

  // `shared`: bytesFor() bytes, zeroed by whoever created them, mapped by every member at the same layout.
  RetiredSegmentLog(void* shared, int rank, int worldSize)
      : rank_(rank), rings_(static_cast<Ring*>(shared)), cursors_(static_cast<size_t>(worldSize), 0) {
    for (int q = 0; q < worldSize; ++q) {
      cursors_[q] = rings_[q].written.load(std::memory_order_acquire);
    }
  }

  // Only this rank writes its ring, from one thread at a time.
  void publish(const RetiredSegment& s) {
    Ring& ring = rings_[rank_];
    const uint64_t w = ring.written.load(std::memory_order_relaxed);
    Entry& e = ring.entries[w % kEntries];
    e.kind.store(s.kind, std::memory_order_relaxed);
    e.id.store(s.id, std::memory_order_relaxed);
    ring.written.store(w + 1, std::memory_order_release);
  }

  // Appends what `peer` retired since the last call. False when the peer retired more than the ring holds since:
  // some were lost, and the caller must drop every mapping of that peer that it can.
  bool readNew(int peer, std::vector<RetiredSegment>* out) {
    Ring& ring = rings_[peer];
    uint64_t& cursor = cursors_[peer];
    const uint64_t written = ring.written.load(std::memory_order_acquire);
    if (written - cursor > kEntries) {
      cursor = written;
      return false;
    }
    const size_t first = out->size();
    for (uint64_t i = cursor; i < written; ++i) {
      const Entry& e = ring.entries[i % kEntries];
      out->push_back(
          {static_cast<uint32_t>(e.kind.load(std::memory_order_relaxed)), e.id.load(std::memory_order_relaxed)});
    }
    // The owner may have lapped the entries while they were read.
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t after = ring.written.load(std::memory_order_relaxed);
    if (after - cursor > kEntries) {
      out->resize(first);
      cursor = after;
      return false;
    }
    cursor = written;
    return true;
  }

 private:
  struct Entry {
    std::atomic<uint64_t> kind;
    std::atomic<uint64_t> id;
  };
  struct alignas(64) Ring {
    std::atomic<uint64_t> written;
    Entry entries[kEntries];
  };
  static_assert(std::atomic<uint64_t>::is_always_lock_free, "the rings are shared between processes");

  const int rank_;
  Ring* rings_;
  std::vector<uint64_t> cursors_;
};

}  // namespace sdma
