// The direct path's view of buffers across processes. A rank exports the allocation a buffer lies in, once per
// allocation (legacy IPC for the caching allocator's cudaMalloc segments; a file descriptor for VMM memory of its
// own); a peer maps each allocation once and finds later buffers in it by offset. Allocations are keyed by an id
// their owner never reuses, so a mapping is never stale: a freed and reallocated range arrives under a new id.
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

namespace sdma {

// This rank's side: how a peer maps the allocation of a buffer (the communication buffer pool's by descriptor,
// cudaMalloc memory by legacy IPC).
class SegmentExporter {
 public:
  // False when peers cannot map [ptr, ptr + bytes) (memory legacy IPC cannot export, e.g. expandable segments).
  bool exportRange(const void* ptr, size_t bytes, ExportedSegment* out);

 private:
  // cudaIpcGetMemHandle is a driver call: once per allocation. Forgotten wholesale past a bound, as ids of freed
  // allocations accumulate.
  std::unordered_map<uint64_t, gpu::IpcHandle> handles_;
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
  const ExportedSegment& segment() const {
    return segment_;
  }

 private:
  gpu::SharedAllocation alloc_;
  ExportedSegment segment_;
};

// The peers' side: their allocations mapped into this process, at most kMaxMappingsPerPeer each (the least recently
// used goes first, once no collective in flight uses it).
class PeerSegmentMap {
 public:
  PeerSegmentMap(int device, std::vector<int> peerPids);

  // This process's address for `address` of `peer`'s process, which lies in `segment`. Maps the segment on first
  // sight; throws when it cannot. `holds` receives the mapping: keep it until the copies through it are done.
  char* locate(int peer, const ExportedSegment& segment, uint64_t address, std::vector<std::shared_ptr<void>>* holds);

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

  const int device_;
  const std::vector<int> peerPids_;
  std::map<Key, Entry> maps_;
  std::vector<size_t> perPeer_;
  uint64_t uses_ = 0;
};

}  // namespace sdma
