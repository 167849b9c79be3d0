#include "transport/peer_segments.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "transport/peer_rendezvous.hpp"
#include "transport/shareable_allocations.hpp"

namespace sdma {
bool SegmentExporter::exportRange(const void* ptr, size_t bytes, ExportedSegment* out) {
  if (findShareable(ptr, bytes, out)) {
    remember(out->base, {out->kind, out->id});
    return true;  // the communication buffer pool's memory
  }
  gpu::AllocationRange range;
  if (!gpu::describeAllocation(ptr, &range) || !range.legacyIpc ||
      static_cast<const char*>(ptr) + bytes > range.base + range.bytes) {
    return false;
  }
  auto it = handles_.find(range.id);
  if (it == handles_.end()) {
    it = handles_.emplace(range.id, gpu::exportIpc(range.base)).first;
  }
  remember(reinterpret_cast<uint64_t>(range.base), {ExportedSegment::kLegacyIpc, range.id});
  out->kind = ExportedSegment::kLegacyIpc;
  out->fd = -1;
  out->id = range.id;
  out->base = reinterpret_cast<uint64_t>(range.base);
  out->bytes = range.bytes;
  static_assert(sizeof(out->ipcHandle) == gpu::kIpcHandleBytes, "IPC handle size");
  memcpy(out->ipcHandle, it->second.bytes, gpu::kIpcHandleBytes);
  return true;
}

void SegmentExporter::remember(uint64_t base, const Exported& e) {
  auto [it, added] = exported_.emplace(base, e);
  if (!added && (it->second.kind != e.kind || it->second.id != e.id)) {
    // Freed and reallocated at the same address without the free being seen (no allocator hook): the old id goes.
    replaced_.push_back({it->second.kind, it->second.id});
    forgetHandle(it->second);
    it->second = e;
  }
}

void SegmentExporter::forgetHandle(const Exported& e) {
  if (e.kind == ExportedSegment::kLegacyIpc) {
    handles_.erase(e.id);
  }
}

bool SegmentExporter::stillLive(uint64_t base, const Exported& e) {
  const void* p = reinterpret_cast<const void*>(base);
  if (e.kind == ExportedSegment::kLegacyIpc) {
    gpu::AllocationRange range;
    return gpu::describeAllocation(p, &range) && range.id == e.id;
  }
  ExportedSegment s;
  return findShareable(p, 1, &s) && s.id == e.id;
}

void SegmentExporter::collectFreed(std::vector<RetiredSegment>* retired) {
  retired->insert(retired->end(), replaced_.begin(), replaced_.end());
  replaced_.clear();
  std::vector<uint64_t> bases;
  const bool complete = freed_.readNew(&bases);
  auto retire = [&](std::map<uint64_t, Exported>::iterator it) {
    retired->push_back({it->second.kind, it->second.id});
    forgetHandle(it->second);
    return exported_.erase(it);
  };
  for (uint64_t base : bases) {
    auto it = exported_.find(base);
    if (it != exported_.end()) {
      retire(it);
    }
  }
  if (!complete || exported_.size() > sweepPast_) {  // frees went unseen: ask the driver and the registry
    for (auto it = exported_.begin(); it != exported_.end();) {
      it = stillLive(it->first, it->second) ? std::next(it) : retire(it);
    }
    sweepPast_ = std::max(kSweepExportedPast, 2 * exported_.size());
  }
}

BounceArea::BounceArea(int device, size_t bytes) {
  const std::string error = gpu::allocateShareable(device, bytes, &alloc_);
  TORCH_CHECK(error.empty(), "torch_sdma: allocating ", bytes,
              " bytes for the direct path's bounce area failed: ", error);
  // Registered with the pool's segments, so that its id is unique among every allocation peers map by descriptor
  // and the exporter finds it like theirs.
  rememberShareable(alloc_);
}

BounceArea::~BounceArea() {
  gpu::SharedAllocation registered;
  forgetShareable(alloc_.ptr, &registered);
  gpu::freeShareable(&alloc_);
}

struct PeerSegmentMap::Mapping {
  uint32_t kind = ExportedSegment::kNone;
  char* local = nullptr;
  size_t bytes = 0;
  gpu::SharedAllocation shared;  // kShareableFd

  ~Mapping() {
    if (kind == ExportedSegment::kLegacyIpc) {
      gpu::closeIpc(local);
    } else {
      gpu::freeShareable(&shared);
    }
  }
};

PeerSegmentMap::PeerSegmentMap(int device, std::vector<int> peerPids)
    : device_(device), peerPids_(std::move(peerPids)), perPeer_(peerPids_.size(), 0) {}

std::shared_ptr<PeerSegmentMap::Mapping> PeerSegmentMap::mapSegment(int peer, const ExportedSegment& segment) {
  auto m = std::make_shared<Mapping>();
  if (segment.kind == ExportedSegment::kLegacyIpc) {
    gpu::IpcHandle handle;
    memcpy(handle.bytes, segment.ipcHandle, gpu::kIpcHandleBytes);
    m->local = static_cast<char*>(gpu::importIpc(handle));
    m->kind = segment.kind;
    m->bytes = segment.bytes;
    return m;
  }
  TORCH_CHECK(segment.kind == ExportedSegment::kShareableFd, "torch_sdma: group rank ", peer,
              " posted a buffer of unknown kind ", segment.kind, " for the direct path");
  std::string error;
  const int fd = duplicateDescriptorOf(peerPids_[peer], segment.fd, &error);
  if (fd >= 0) {
    error = gpu::importShareable(device_, fd, segment.bytes, &m->shared);
  }
  TORCH_CHECK(error.empty(), "torch_sdma: mapping the bounce area of group rank ", peer, " failed: ", error);
  m->kind = segment.kind;
  m->local = static_cast<char*>(m->shared.ptr);
  m->bytes = segment.bytes;
  return m;
}

void PeerSegmentMap::evictFrom(int peer) {
  auto oldest = maps_.end();
  for (auto it = maps_.begin(); it != maps_.end(); ++it) {
    // A mapping a collective in flight holds stays: it would be closed under the copies (and mapped twice).
    if (std::get<0>(it->first) == peer && it->second.mapping.use_count() == 1 &&
        (oldest == maps_.end() || it->second.lastUse < oldest->second.lastUse)) {
      oldest = it;
    }
  }
  if (oldest != maps_.end()) {
    drop(oldest);
  }
}

void PeerSegmentMap::drop(std::map<Key, Entry>::iterator it) {
  --perPeer_[std::get<0>(it->first)];
  mappedBytes_ -= it->second.mapping->bytes;
  maps_.erase(it);  // unmapped here, or by the last collective in flight that holds it
}

void PeerSegmentMap::forget(int peer, const RetiredSegment& retired) {
  auto it = maps_.find(Key{peer, retired.kind, retired.id});
  if (it != maps_.end()) {
    drop(it);
  }
}

void PeerSegmentMap::forgetUnheld(int peer) {
  for (auto it = maps_.begin(); it != maps_.end();) {
    auto next = std::next(it);
    // A held mapping may still be live; dropping it could map its allocation twice.
    if (std::get<0>(it->first) == peer && it->second.mapping.use_count() == 1) {
      drop(it);
    }
    it = next;
  }
}

char* PeerSegmentMap::locate(int peer, const ExportedSegment& segment, uint64_t address,
                             std::vector<std::shared_ptr<void>>* holds) {
  TORCH_CHECK(address >= segment.base && address - segment.base <= segment.bytes, "torch_sdma: group rank ", peer,
              " posted an address outside the allocation it exported");
  const Key key{peer, segment.kind, segment.id};
  auto it = maps_.find(key);
  if (it == maps_.end()) {
    if (perPeer_[peer] >= kMaxMappingsPerPeer) {
      evictFrom(peer);
    }
    it = maps_.emplace(key, Entry{mapSegment(peer, segment), 0}).first;
    ++perPeer_[peer];
    mappedBytes_ += segment.bytes;
  }
  it->second.lastUse = ++uses_;
  holds->push_back(it->second.mapping);
  return it->second.mapping->local + (address - segment.base);
}

}  // namespace sdma
