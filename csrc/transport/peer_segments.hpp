// The direct path's view of buffers across processes. A rank exports the allocation a buffer lies in, once per
// allocation (legacy IPC for the caching allocator's cudaMalloc segments; a file descriptor for VMM memory of its
// own); a peer maps each allocation once and finds later buffers in it by offset. Allocations are keyed by an id
// their owner never reuses, so a mapping is never stale: a freed and reallocated range arrives under a new id. The
// owner retires the ids of what it freed (retired_segments.hpp) and peers drop those mappings, so a peer maps no
// more of a rank's memory than the rank still holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "gpu/gpu_api.hpp"
#include "transport/arrival_mailbox.hpp"
#include "transport/freed_allocations.hpp"
#include "transport/retired_segments.hpp"

namespace sdma {

// This rank's side: how a peer maps the allocation of a buffer (the communication buffer pool's by descriptor,
// cudaMalloc memory by legacy IPC).
class SegmentExporter {
 public:
  // False when peers cannot map [ptr, ptr + bytes) (memory legacy IPC cannot export, e.g. expandable segments).
  bool exportRange(const void* ptr, size_t bytes, ExportedSegment* out);
  // Appends the allocations exported so far that this process has freed since (each once), and forgets them.
  void collectFreed(std::vector<RetiredSegment>* retired);

 private:
  struct Exported {
    uint32_t kind;
    uint64_t id;
  };
  void remember(uint64_t base, const Exported& e);
  void forgetHandle(const Exported& e);
  // True when the allocation at `base` is still the one exported under `e`.
  static bool stillLive(uint64_t base, const Exported& e);

  // cudaIpcGetMemHandle is a driver call: once per allocation, until the allocation is freed.
  std::unordered_map<uint64_t, gpu::IpcHandle> handles_;
  std::map<uint64_t, Exported> exported_;  // by base address
  std::vector<RetiredSegment> replaced_;   // exported at a base that was exported under another id before
  // Past this many exported allocations (and past twice as many as the last such check found live) the exporter
  // asks which are still live: frees go unseen where the caching allocator cannot be watched.
  static constexpr size_t kSweepExportedPast = 1024;
  size_t sweepPast_ = kSweepExportedPast;
  FreedAllocationReader freed_;
};

// Device memory of this rank's own that peers map by descriptor: where a buffer they cannot map is bounced.
class BounceArea {
 public:
  // Throws when the memory cannot be had.
  BounceArea(int device, size_t bytes);
  ~BounceArea();
  BounceArea(const BounceArea&) = delete;
  BounceArea& operator=(const BounceArea&) = delete;

  char* data() const {
    return static_cast<char*>(alloc_.ptr);
  }
  size_t bytes() const {
    return alloc_.bytes;
  }

 private:
  gpu::SharedAllocation alloc_;
};

// The peers' side: their allocations mapped into this process, at most kMaxMappingsPerPeer each (the least recently
// used goes first, once no collective in flight uses it).
class PeerSegmentMap {
 public:
  PeerSegmentMap(int device, std::vector<int> peerPids);

  // This process's address for `address` of `peer`'s process, which lies in `segment`. Maps the segment on first
  // sight; throws when it cannot. `holds` receives the mapping: keep it until the copies through it are done.
  char* locate(int peer, const ExportedSegment& segment, uint64_t address, std::vector<std::shared_ptr<void>>* holds);
  // `peer` freed this allocation: its mapping goes once no collective in flight holds it.
  void forget(int peer, const RetiredSegment& retired);
  // `peer`'s retirements were lost: every mapping of its memory that nothing in flight holds goes.
  void forgetUnheld(int peer);
  // Bytes of the peers' memory this map keeps mapped (a collective in flight may keep a dropped mapping a while).
  size_t mappedBytes() const {
    return mappedBytes_;
  }

  static constexpr size_t kMaxMappingsPerPeer = 64;

 private:
  struct Mapping;
  using Key = std::tuple<int, uint32_t, uint64_t>;  // peer, kind, id
  struct Entry {
    std::shared_ptr<Mapping> mapping;
    uint64_t lastUse = 0;
  };

  std::shared_ptr<Mapping> mapSegment(int peer, const ExportedSegment& segment);
  void evictFrom(int peer);
  void drop(std::map<Key, Entry>::iterator it);

  const int device_;
  const std::vector<int> peerPids_;
  std::map<Key, Entry> maps_;
  std::vector<size_t> perPeer_;
  uint64_t uses_ = 0;
  size_t mappedBytes_ = 0;
};

}  // namespace sdma
