// HIP implementation of gpu_api.hpp, a function-by-function translation of gpu_api_cuda.cpp (diff the two).
// Calls are direct, not resolved at run time as the CUDA layer's driver calls are: that layer avoids linking
// libcuda, which exists only where a driver is installed, whereas HIP has no separate driver library. Streams,
// copies, stream memory operations and VMM all live in libamdhip64, which a ROCm build of torch links and loads
// on import anyway, with or without GPUs; a call that the machine cannot serve fails when made, with an error.
#include "gpu/gpu_api.hpp"

#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include <unistd.h>

namespace sdma {
namespace gpu {
namespace {

void check(hipError_t err, const char* what) {
  TORCH_CHECK(err == hipSuccess, "torch_sdma: ", what, " failed: ", hipGetErrorString(err));
}

// The HIP runtime that is loaded, in HIP_VERSION's encoding (60241134 is 6.2.41134); 0 when it will not say. What
// a call accepts is the loaded runtime's business, which need not be the release of the headers built against.
int runtimeVersion() {
  static const int version = [] {
    int v = 0;
    if (hipRuntimeGetVersion(&v) != hipSuccess) {
      (void)hipGetLastError();
      v = 0;
    }
    return v;
  }();
  return version;
}

hipStream_t raw(Stream s) {
  return static_cast<hipStream_t>(s);
}

// A plain device-to-device copy on one GPU runs as a blit kernel on the compute units (and so does a peer copy
// below ROC_P2P_SDMA_SIZE); hipMemcpyDeviceToDeviceNoCU, new in HIP 6.1, puts every one on an SDMA engine.
// Older headers lack the kind and older runtimes refuse it.
hipMemcpyKind deviceToDeviceKind() {
#if HIP_VERSION >= 60100000
  static const hipMemcpyKind kind =
      runtimeVersion() >= 60100000 ? hipMemcpyDeviceToDeviceNoCU : hipMemcpyDeviceToDevice;
  return kind;
#else
  return hipMemcpyDeviceToDevice;
#endif
}

// The interface waits until (int32_t)(*flag - value) >= 0, CUDA's GEQ stream wait. HIP's nearest condition,
// hipStreamWaitValueGte, does not wrap: it holds until *flag >= value as unsigned numbers. The two agree when the
// flag and the value lie on the same side of the wrap at 2^32, which is so for every value at least kWrapZone
// from it: the transports keep a flag within their staging slots' worth of serials of any value waited on it
// (kWrapZone must exceed TORCH_SDMA_SLOTS). Close to the wrap:
// - a value just past it (< kWrapZone) with a flag still behind it, which reads as huge: first wait until the
//   flag has wrapped too (top bit clear), then compare. Exact.
// - a value just before it (>= 2^32 - kWrapZone) with a flag already past it, which reads as small: the wait
//   holds where CUDA's passes. No chain of HIP wait conditions can fix that: one that passes at a flag of 0 and at
//   2^32 - 1 passes everywhere. So the wait stays as it is, since a stream that stalls shows up as a stuck
//   collective and one that runs early corrupts data silently. A first round's wait on serial - slots (below
//   zero) against a flag still at 0 would be such a wait; the staging schedule issues none (a slot's first use
//   waits for no credit).
constexpr uint32_t kWrapZone = 1u << 10;
constexpr uint32_t kTopBit = 1u << 31;

}  // namespace

std::string pciBusId(int device) {
  char buf[64] = {0};
  check(hipDeviceGetPCIBusId(buf, sizeof(buf), device), "hipDeviceGetPCIBusId");
  return std::string(buf);
}

int deviceByPciBusId(const std::string& busId) {
  int d = -1;
  if (hipDeviceGetByPCIBusId(&d, busId.c_str()) != hipSuccess) {
    (void)hipGetLastError();
    return -1;
  }
  return d;
}

bool canAccessPeer(int device, int peerDevice) {
  if (device == peerDevice) {
    return true;
  }
  int can = 0;
  check(hipDeviceCanAccessPeer(&can, device, peerDevice), "hipDeviceCanAccessPeer");
  return can != 0;
}

void* mallocDevice(size_t bytes) {
  void* p = nullptr;
  check(hipMalloc(&p, bytes), "hipMalloc of the staging buffer");
  return p;
}

void freeDevice(void* ptr) {
  if (ptr) {
    (void)hipFree(ptr);
  }
}

void* mallocMappedHost(size_t bytes, void** deviceAddress) {
  void* p = nullptr;
  check(hipHostMalloc(&p, bytes, hipHostMallocMapped | hipHostMallocPortable), "hipHostMalloc of a mapped host word");
  std::memset(p, 0, bytes);
  check(hipHostGetDevicePointer(deviceAddress, p, 0), "hipHostGetDevicePointer");
  return p;
}

void freeMappedHost(void* ptr) {
  if (ptr) {
    (void)hipHostFree(ptr);
  }
}

void memsetSync(void* ptr, int value, size_t bytes, Stream stream) {
  check(hipMemsetAsync(ptr, value, bytes, raw(stream)), "hipMemsetAsync");
  check(hipStreamSynchronize(raw(stream)), "hipStreamSynchronize");
}

namespace {

static_assert(sizeof(hipMemGenericAllocationHandle_t) <= sizeof(SharedAllocation::handle),
              "a VMM handle must fit SharedAllocation::handle");

hipMemGenericAllocationHandle_t vmmHandle(unsigned long long h) {
  return reinterpret_cast<hipMemGenericAllocationHandle_t>(static_cast<uintptr_t>(h));
}

unsigned long long storedHandle(hipMemGenericAllocationHandle_t h) {
  return reinterpret_cast<uintptr_t>(h);
}

hipMemAllocationProp shareableProp(int device) {
  hipMemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = hipMemAllocationTypePinned;
  prop.location.type = hipMemLocationTypeDevice;
  prop.location.id = device;
  prop.requestedHandleType = hipMemHandleTypePosixFileDescriptor;
  return prop;
}

// Rounds *bytes up to the size VMM maps `device`'s memory in; leaves it as is when the runtime will not say.
hipError_t roundUpToGranularity(int device, size_t* bytes) {
  hipMemAllocationProp prop = shareableProp(device);
  size_t granularity = 0;
  const hipError_t r = hipMemGetAllocationGranularity(&granularity, &prop, hipMemAllocationGranularityRecommended);
  if (r == hipSuccess && granularity) {
    *bytes = (*bytes + granularity - 1) / granularity * granularity;
  }
  return r;
}

std::string runtimeError(const char* what, hipError_t r) {
  return std::string(what) + " failed: " + hipGetErrorString(r);
}

// ROCm 7.1 and later take the descriptor as the pointer's value, as CUDA does; earlier runtimes read an int
// through the pointer (and would fault on a descriptor passed by value). torch's symmetric memory draws the same
// line.
hipError_t importDescriptor(hipMemGenericAllocationHandle_t* handle, int fd) {
  void* osHandle =
      runtimeVersion() >= 70100000 ? reinterpret_cast<void*>(static_cast<uintptr_t>(fd)) : static_cast<void*>(&fd);
  return hipMemImportFromShareableHandle(handle, osHandle, hipMemHandleTypePosixFileDescriptor);
}

// Reserves address space for `handle`, maps it and lets `device` read and write it.
std::string mapForDevice(int device, size_t bytes, SharedAllocation* a) {
  void* ptr = nullptr;
  hipError_t r = hipMemAddressReserve(&ptr, bytes, 0, nullptr, 0);
  if (r != hipSuccess) {
    return runtimeError("hipMemAddressReserve", r);
  }
  r = hipMemMap(ptr, bytes, 0, vmmHandle(a->handle), 0);
  if (r != hipSuccess) {
    (void)hipMemAddressFree(ptr, bytes);
    return runtimeError("hipMemMap", r);
  }
  hipMemAccessDesc access;
  memset(&access, 0, sizeof(access));
  access.location.type = hipMemLocationTypeDevice;
  access.location.id = device;
  access.flags = hipMemAccessFlagsProtReadWrite;
  r = hipMemSetAccess(ptr, bytes, &access, 1);
  if (r != hipSuccess) {
    (void)hipMemUnmap(ptr, bytes);
    (void)hipMemAddressFree(ptr, bytes);
    return runtimeError("hipMemSetAccess", r);
  }
  a->ptr = ptr;
  a->bytes = bytes;
  return "";
}

}  // namespace

std::string allocateShareable(int device, size_t bytes, SharedAllocation* out) {
  const std::string unavailable = streamMemOpsUnavailableReason();
  if (!unavailable.empty()) {
    return unavailable;
  }
  hipError_t r = roundUpToGranularity(device, &bytes);
  if (r != hipSuccess) {
    return runtimeError("hipMemGetAllocationGranularity", r);
  }
  const hipMemAllocationProp prop = shareableProp(device);
  SharedAllocation a;
  hipMemGenericAllocationHandle_t handle = nullptr;
  r = hipMemCreate(&handle, bytes, &prop, 0);
  if (r != hipSuccess) {
    return runtimeError("hipMemCreate", r);
  }
  a.handle = storedHandle(handle);
  std::string err = mapForDevice(device, bytes, &a);
  if (err.empty()) {
    r = hipMemExportToShareableHandle(&a.fd, handle, hipMemHandleTypePosixFileDescriptor, 0);
    if (r != hipSuccess) {
      err = runtimeError("hipMemExportToShareableHandle", r);
    }
  }
  if (!err.empty()) {
    freeShareable(&a);
    return err;
  }
  *out = a;
  return "";
}

// The runtime binds an imported handle to the current device, not to `device`: callers hold a device guard.
std::string importShareable(int device, int fd, size_t bytes, SharedAllocation* out) {
  SharedAllocation a;
  hipMemGenericAllocationHandle_t handle = nullptr;
  hipError_t r = importDescriptor(&handle, fd);
  close(fd);  // the handle now holds the memory
  if (r != hipSuccess) {
    return runtimeError("hipMemImportFromShareableHandle", r);
  }
  a.handle = storedHandle(handle);
  (void)roundUpToGranularity(device, &bytes);  // as the exporter did
  std::string err = mapForDevice(device, bytes, &a);
  if (!err.empty()) {
    (void)hipMemRelease(handle);
    return err;
  }
  *out = a;
  return "";
}

void freeShareable(SharedAllocation* a) {
  if (a->ptr) {
    (void)hipMemUnmap(a->ptr, a->bytes);
    (void)hipMemAddressFree(a->ptr, a->bytes);
  }
  if (a->handle) {
    (void)hipMemRelease(vmmHandle(a->handle));
  }
  if (a->fd >= 0) {
    close(a->fd);
  }
  *a = SharedAllocation{};
}

bool describeAllocation(const void* ptr, AllocationRange* out) {
  hipPointer_attribute attributes[] = {HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, HIP_POINTER_ATTRIBUTE_RANGE_SIZE,
                                       HIP_POINTER_ATTRIBUTE_BUFFER_ID,
                                       HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE};
  hipDeviceptr_t base = nullptr;
  size_t bytes = 0;
  unsigned long long id = 0;
  int legacyIpc = 0;
  void* values[] = {&base, &bytes, &id, &legacyIpc};
  if (hipDrvPointerGetAttributes(4, attributes, values, reinterpret_cast<hipDeviceptr_t>(const_cast<void*>(ptr))) !=
          hipSuccess ||
      base == nullptr) {
    return false;
  }
  *out = AllocationRange{static_cast<char*>(base), bytes, id, legacyIpc != 0};
  return true;
}

IpcHandle exportIpc(void* base) {
  static_assert(sizeof(hipIpcMemHandle_t) <= kIpcHandleBytes, "IPC handle size");
  hipIpcMemHandle_t h;
  check(hipIpcGetMemHandle(&h, base), "hipIpcGetMemHandle");
  IpcHandle out{};
  memcpy(out.bytes, &h, sizeof(h));
  return out;
}

void* importIpc(const IpcHandle& handle) {
  hipIpcMemHandle_t h;
  memcpy(&h, handle.bytes, sizeof(h));
  void* p = nullptr;
  check(hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess), "hipIpcOpenMemHandle");
  return p;
}

void closeIpc(void* ptr) {
  if (ptr) {
    (void)hipIpcCloseMemHandle(ptr);
  }
}

void copyAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  check(hipMemcpyAsync(dst, src, bytes, deviceToDeviceKind(), raw(stream)), "hipMemcpyAsync");
}

void copyFromHostAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  check(hipMemcpyAsync(dst, src, bytes, hipMemcpyHostToDevice, raw(stream)), "hipMemcpyAsync H2D");
}

// HIP headers as old as 5.2 have no batched memory operation, so each op is its own call, in array order; stream
// order keeps them in sequence. The ROCm runtime runs each wait and each write as a one-work-item kernel (a wait
// polls): these take a wave slot on a compute unit, not an SDMA engine. GPU_STREAMOPS_CP_WAIT=1 would wait on the
// command processor instead, but only on hipMallocSignalMemory words, which these flags are not.
void flagOps(Stream stream, const FlagOp* ops, int count) {
  const hipStream_t s = raw(stream);
  for (int i = 0; i < count; ++i) {
    const FlagOp& op = ops[i];
    if (op.write) {
      // Flags 0: the default write, ordered after all prior work on the stream (reserved in HIP 5.2's headers).
      check(hipStreamWriteValue32(s, op.flag, op.value, 0), "hipStreamWriteValue32");
      continue;
    }
    if (op.value < kWrapZone) {
      check(hipStreamWaitValue32(s, op.flag, 0, hipStreamWaitValueEq, kTopBit), "hipStreamWaitValue32 (wrapped)");
    }
    check(hipStreamWaitValue32(s, op.flag, op.value, hipStreamWaitValueGte, 0xFFFFFFFFu), "hipStreamWaitValue32");
  }
}

std::string streamMemOpsUnavailableReason() {
  int device = -1;
  int can = 0;
  hipError_t err = hipGetDevice(&device);
  if (err == hipSuccess) {
    err = hipDeviceGetAttribute(&can, hipDeviceAttributeCanUseStreamWaitValue, device);
  }
  if (err != hipSuccess) {
    (void)hipGetLastError();
    return runtimeError("hipDeviceGetAttribute(hipDeviceAttributeCanUseStreamWaitValue)", err);
  }
  return can ? "" : "GPU " + std::to_string(device) + " cannot run hipStreamWaitValue32";
}

Stream createStream() {
  hipStream_t s;
  check(hipStreamCreateWithFlags(&s, hipStreamNonBlocking), "hipStreamCreateWithFlags");
  return s;
}

int hardwareQueues() {
  // Read once: the driver reads it when the context is created, so a later change moves nothing, and every direct
  // collective asks.
  static const int queues = [] {
    const char* raw = std::getenv("GPU_MAX_HW_QUEUES");
    const int set = raw ? std::atoi(raw) : 0;
    return set > 0 ? set : 4;  // the driver's default
  }();
  return queues;
}

bool streamCapturing(Stream stream) {
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  return hipStreamIsCapturing(raw(stream), &status) == hipSuccess && status != hipStreamCaptureStatusNone;
}

bool releaseWithCapturedGraph(Stream capturing, void* object, void (*release)(void*)) {
#if HIP_VERSION >= 50300000  // user objects came with ROCm 5.3
  hipStreamCaptureStatus status = hipStreamCaptureStatusNone;
  hipGraph_t graph = nullptr;
  hipUserObject_t held = nullptr;
  if (hipStreamGetCaptureInfo_v2(raw(capturing), &status, nullptr, &graph, nullptr, nullptr) != hipSuccess ||
      status != hipStreamCaptureStatusActive || !graph ||
      hipUserObjectCreate(&held, object, release, 1, hipUserObjectNoDestructorSync) != hipSuccess) {
    release(object);
    return false;
  }
  if (hipGraphRetainUserObject(graph, held, 1, hipGraphUserObjectMove) != hipSuccess) {
    hipUserObjectRelease(held, 1);
    return false;
  }
  return true;
#else
  (void)capturing;
  release(object);
  return false;
#endif
}

void ignoreOtherThreadsCaptures() {
  hipStreamCaptureMode mode = hipStreamCaptureModeThreadLocal;
  check(hipThreadExchangeStreamCaptureMode(&mode), "hipThreadExchangeStreamCaptureMode");
}

CaptureRelaxedScope::CaptureRelaxedScope() {
  hipStreamCaptureMode mode = hipStreamCaptureModeRelaxed;
  check(hipThreadExchangeStreamCaptureMode(&mode), "hipThreadExchangeStreamCaptureMode");
  previous_ = static_cast<int>(mode);
}

CaptureRelaxedScope::~CaptureRelaxedScope() {
  auto mode = static_cast<hipStreamCaptureMode>(previous_);
  (void)hipThreadExchangeStreamCaptureMode(&mode);
}

void destroyStream(Stream stream) {
  if (stream) {
    (void)hipStreamDestroy(raw(stream));
  }
}

void syncDevice(int device) {
  int current = 0;
  check(hipGetDevice(&current), "hipGetDevice");
  check(hipSetDevice(device), "hipSetDevice");
  const hipError_t err = hipDeviceSynchronize();
  (void)hipSetDevice(current);
  check(err, "hipDeviceSynchronize");
}

void syncStream(Stream stream) {
  check(hipStreamSynchronize(raw(stream)), "hipStreamSynchronize");
}

// ROCm keeps one context per device: the copies go on a stream of their own at the highest priority instead, a
// hardware queue of its own while the process has no more streams than GPU_MAX_HW_QUEUES.
void copyFromHostBesideStreams(int device, void* dst, const void* src, size_t bytes) {
  static std::mutex mutex;
  static std::vector<hipStream_t> streams;  // by device; kept for the life of the process, as the CUDA layer's contexts
  hipStream_t s = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (streams.size() <= static_cast<size_t>(device)) {
      streams.resize(device + 1, nullptr);
    }
    if (!streams[device]) {
      int current = 0;
      check(hipGetDevice(&current), "hipGetDevice");
      check(hipSetDevice(device), "hipSetDevice");
      int least = 0, greatest = 0;
      hipError_t err = hipDeviceGetStreamPriorityRange(&least, &greatest);
      if (err == hipSuccess) {
        err = hipStreamCreateWithPriority(&streams[device], hipStreamNonBlocking, greatest);
      }
      (void)hipSetDevice(current);
      check(err, "hipStreamCreateWithPriority");
    }
    s = streams[device];
  }
  check(hipMemcpyAsync(dst, src, bytes, hipMemcpyHostToDevice, s), "hipMemcpyAsync");
  check(hipStreamSynchronize(s), "hipStreamSynchronize");
}

Event createEvent() {
  hipEvent_t e;
  check(hipEventCreateWithFlags(&e, hipEventDisableTiming), "hipEventCreate");
  return e;
}

void destroyEvent(Event event) {
  if (event) {
    (void)hipEventDestroy(static_cast<hipEvent_t>(event));
  }
}

void recordEvent(Event event, Stream stream) {
  check(hipEventRecord(static_cast<hipEvent_t>(event), raw(stream)), "hipEventRecord");
}

bool eventDone(Event event) {
  hipError_t err = hipEventQuery(static_cast<hipEvent_t>(event));
  if (err == hipErrorNotReady) {
    (void)hipGetLastError();
    return false;
  }
  check(err, "hipEventQuery");
  return true;
}

void streamWaitEvent(Stream stream, Event event) {
  check(hipStreamWaitEvent(raw(stream), static_cast<hipEvent_t>(event), 0), "hipStreamWaitEvent");
}

}  // namespace gpu
}  // namespace sdma
