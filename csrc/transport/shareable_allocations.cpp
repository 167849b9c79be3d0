#include "transport/shareable_allocations.hpp"

#include <map>
#include <mutex>

#include "transport/freed_allocations.hpp"

namespace sdma {
namespace {

struct Registry {
  std::mutex mutex;
  struct Entry {
    gpu::SharedAllocation allocation;
    ExportedSegment segment;
  };
  std::map<const char*, Entry> byBase;
  uint64_t ids = 0;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: allocators may free into it during exit
  return *r;
}

}  // namespace

void rememberShareable(const gpu::SharedAllocation& a) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  ExportedSegment s;
  s.kind = ExportedSegment::kShareableFd;
  s.fd = a.fd;
  s.id = ++r.ids;
  s.base = reinterpret_cast<uint64_t>(a.ptr);
  s.bytes = a.bytes;
  r.byBase[static_cast<const char*>(a.ptr)] = {a, s};
}

bool forgetShareable(const void* ptr, gpu::SharedAllocation* allocation) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.byBase.find(static_cast<const char*>(ptr));
  if (it == r.byBase.end()) {
    return false;
  }
  *allocation = it->second.allocation;
  r.byBase.erase(it);
  noteAllocationFreed(reinterpret_cast<uint64_t>(ptr));  // peers that mapped it drop their mappings
  return true;
}

bool findShareable(const void* ptr, size_t bytes, ExportedSegment* out) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const char* p = static_cast<const char*>(ptr);
  auto it = r.byBase.upper_bound(p);
  if (it == r.byBase.begin()) {
    return false;
  }
  --it;
  const ExportedSegment& s = it->second.segment;
  if (p + bytes > it->first + s.bytes) {
    return false;
  }
  *out = s;
  return true;
}

}  // namespace sdma
