// The vendor layer: the only place that names the GPU vendor's runtime. Everything above it speaks of streams,
// events, copies, flag writes and flag waits; gpu_api_cuda.cpp implements it for CUDA, and the HIP build
// translates this layer (hipMemcpyAsync with hipMemcpyDeviceToDeviceNoCU, hipStreamWaitValue32, hipIpc*), nothing
// else. (Code above it may use torch's own device API, c10::cuda, which torch translates for ROCm itself.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sdma {
namespace gpu {

using Stream = void*;  // cudaStream_t / hipStream_t
using Event = void*;   // cudaEvent_t / hipEvent_t

constexpr size_t kIpcHandleBytes = 64;
struct IpcHandle {
  char bytes[kIpcHandleBytes];
};

// Throws c10::Error with the runtime's message when a call fails.
std::string pciBusId(int device);
// Device ordinal in this process for a PCI bus id, or -1 when that GPU is not visible here.
int deviceByPciBusId(const std::string& busId);
bool canAccessPeer(int device, int peerDevice);

void* mallocDevice(size_t bytes);
void freeDevice(void* ptr);
// Pinned host memory the device writes through stream memory operations (FlagOp, at `*deviceAddress`) and the host
// reads with plain loads: what a thread may watch without calling the driver, which can hold every other thread's
// call while one thread blocks in a copy into pageable memory.
void* mallocMappedHost(size_t bytes, void** deviceAddress);
void freeMappedHost(void* ptr);
// Fills and waits on `stream` alone, so it never waits for (or trips over) another stream's graph capture.
void memsetSync(void* ptr, int value, size_t bytes, Stream stream);

// Device memory that other processes on this host can map (VMM, exported as a POSIX file descriptor). Pushes into
// it run at full NVLink speed; legacy IPC mappings (below) reached ~75% of it on H200.
struct SharedAllocation {
  void* ptr = nullptr;
  size_t bytes = 0;
  unsigned long long handle = 0;
  int fd = -1;  // the exported descriptor, owner side only
};
// "" on success, else why this device cannot share memory that way.
std::string allocateShareable(int device, size_t bytes, SharedAllocation* out);
// Maps another process's allocation (fd already duplicated into this process; consumed) for `device`.
std::string importShareable(int device, int fd, size_t bytes, SharedAllocation* out);
void freeShareable(SharedAllocation* alloc);

// The allocation a device pointer lies in: for the direct path, which maps the peers' own buffers rather than a
// staging area. `id` is unique for the process's lifetime (a freed and reallocated range gets a new one), so a
// mapping keyed by it is never stale. `legacyIpc`: exportIpc(base) works (cudaMalloc memory; not VMM memory such as
// the caching allocator's expandable segments).
struct AllocationRange {
  char* base = nullptr;
  size_t bytes = 0;
  uint64_t id = 0;
  bool legacyIpc = false;
};
// False when `ptr` is not device memory of this process's runtime.
bool describeAllocation(const void* ptr, AllocationRange* out);

IpcHandle exportIpc(void* base);
void* importIpc(const IpcHandle& handle);
void closeIpc(void* ptr);

// A copy that runs on a DMA engine: device-to-device, local or into a peer's mapped memory.
void copyAsync(void* dst, const void* src, size_t bytes, Stream stream);
void copyFromHostAsync(void* dst, const void* src, size_t bytes, Stream stream);

// Stream memory operations: no kernel, no SM. A FlagOp either writes `value` to `flag` (after all prior work on
// the stream, with a memory barrier; the flag may be in a peer's memory) or holds the stream until
// (int32_t)(*flag - value) >= 0, a cyclic compare so serials may wrap. The ops run in array order, in one
// driver call.
struct FlagOp {
  bool write;
  uint32_t* flag;
  uint32_t value;
};
void flagOps(Stream stream, const FlagOp* ops, int count);
// "" when the driver offers the stream memory operations above, else why not.
std::string streamMemOpsUnavailableReason();

Stream createStream();
// How many hardware queues the driver spreads this process's streams of a device over, as the environment sets it
// (CUDA_DEVICE_MAX_CONNECTIONS; GPU_MAX_HW_QUEUES on HIP), else the driver's default: the budget streams share.
int hardwareQueues();
// True while `stream` is being captured into a graph.
bool streamCapturing(Stream stream);
// While `capturing` is being captured: `release(object)` runs once the graph being captured, and every executable
// graph made from it, is destroyed and their launches are done, on a runtime thread that may not call the GPU
// runtime. Where the runtime cannot attach it: false, and release has run at once. Either way it runs once.
bool releaseWithCapturedGraph(Stream capturing, void* object, void (*release)(void*));

// Graph capture in global mode (torch.cuda.graph's default) forbids "unsafe" calls, such as an event query or an
// allocation, on every thread of the process, and such a call invalidates the capture. Threads of ours call this
// once at their start: their calls then concern their own captures only (none), as ProcessGroupNCCL's watchdog does.
void ignoreOtherThreadsCaptures();
// For its lifetime, lets this thread allocate and map memory while one of its streams is being captured (the
// caching allocator does the same for graph pools).
class CaptureRelaxedScope {
 public:
  CaptureRelaxedScope();
  ~CaptureRelaxedScope();
  CaptureRelaxedScope(const CaptureRelaxedScope&) = delete;
  CaptureRelaxedScope& operator=(const CaptureRelaxedScope&) = delete;

 private:
  int previous_;
};
void destroyStream(Stream stream);
void syncStream(Stream stream);
// Copies host bytes into `device`'s memory from a context of the device's own, beside the primary one that every
// stream of the process (torch's too) belongs to. The primary context's streams share its hardware queues (all of
// them with CUDA_DEVICE_MAX_CONNECTIONS=1, two of them by chance with more), so a copy on any of its streams may sit
// for good behind a stream memory wait, even a wait for the very word it writes; this context's queues are its own.
// Reaches VMM memory (allocateShareable, importShareable): a copy into cudaMalloc memory is still served behind the
// primary context's queues. Synchronous; the thread's current context is as it was. The context is created at the
// first call (tens of milliseconds, and device memory) and kept for the life of the process: destroying it would wait
// for the primary context's work, which is what may be held. For failure paths.
void copyFromHostBesideStreams(int device, void* dst, const void* src, size_t bytes);
// Every stream of `device`: before memory that work on any of them may still touch is unmapped.
void syncDevice(int device);

Event createEvent();
void destroyEvent(Event event);
void recordEvent(Event event, Stream stream);
bool eventDone(Event event);  // never blocks
void streamWaitEvent(Stream stream, Event event);

}  // namespace gpu
}  // namespace sdma
