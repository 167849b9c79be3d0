#include "transport/peer_segments.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "transport/peer_rendezvous.hpp"
#include "transport/shareable_allocations.hpp"

namespace sdma {
namespace {

constexpr size_t kMaxRememberedHandles = 4096;

}  // namespace

bool SegmentExporter::exportRange(const void* ptr, size_t bytes, ExportedSegment* out) {
  if (findShareable(ptr, bytes, out)) {
    return true;  // the communication buffer pool's memory
  }
  gpu::AllocationRange range;
  if (!gpu::describeAllocation(ptr, &range) || !range.legacyIpc ||
      static_cast<const char*>(ptr) + bytes > range.base + range.bytes) {
    return false;
  }
  auto it = handles_.find(range.id);
  if (it == handles_.end()) {
    if (handles_.size() >= kMaxRememberedHandles) {
      handles_.clear();
    }
    it = handles_.emplace(range.id, gpu::exportIpc(range.base)).first;
  }
  out->kind = ExportedSegment::kLegacyIpc;
  out->fd = -1;
  out->id = range.id;
  out->base = reinterpret_cast<uint64_t>(range.base);
  out->bytes = range.bytes;
  static_assert(sizeof(out->ipcHandle) == gpu::kIpcHandleBytes, "IPC handle size");
  memcpy(out->ipcHandle, it->second.bytes, gpu::kIpcHandleBytes);
  return true;
}

BounceArea::BounceArea(int device, size_t bytes) {
  const std::string error = gpu::allocateShareable(device, bytes, &alloc_);
  TORCH_CHECK(error.empty(), "torch_sdma: allocating ", bytes,
              " bytes for the direct path's bounce area failed: ", error);
  // Registered with the pool's segments, so that its id is unique among every allocation peers map by descriptor.
  rememberShareable(alloc_);
  findShareable(alloc_.ptr, alloc_.bytes, &segment_);
}

BounceArea::~BounceArea() {
  gpu::SharedAllocation registered;
  forgetShareable(alloc_.ptr, &registered);
  gpu::freeShareable(&alloc_);
}

struct PeerSegmentMap::Mapping {
  uint32_t kind = ExportedSegment::kNone;
  char* local = nullptr;
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
    maps_.erase(oldest);
    --perPeer_[peer];
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
  }
  it->second.lastUse = ++uses_;
  holds->push_back(it->second.mapping);
  return it->second.mapping->local + (address - segment.base);
}

}  // namespace sdma
