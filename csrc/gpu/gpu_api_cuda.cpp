// CUDA implementation of gpu_api.hpp. Links only the CUDA runtime (shipped with torch); driver entry points
// (stream memory operations) are resolved at run time so that the module imports on machines with no driver.
#include "gpu/gpu_api.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include <mutex>
#include <vector>

namespace sdma {
namespace gpu {
namespace {

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "torch_sdma: ", what, " failed: ", cudaGetErrorString(err));
}

void checkDriver(CUresult res, const char* what) {
  TORCH_CHECK(res == CUDA_SUCCESS, "torch_sdma: ", what, " failed with CUresult ", static_cast<int>(res));
}

using BatchMemOpFn = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
// Context entry points by their ABI, which the headers' names follow to newer versions (cuCtxCreate is _v4 in 13).
using CtxCreateFn = CUresult (*)(CUcontext*, unsigned int, CUdevice);
using CtxPushFn = CUresult (*)(CUcontext);
using CtxPopFn = CUresult (*)(CUcontext*);
using CtxSynchronizeFn = CUresult (*)();
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using MemcpyHtoDFn = CUresult (*)(CUdeviceptr, const void*, size_t);
struct DriverEntryPoints {
  BatchMemOpFn batchMemOp = nullptr;
  decltype(&cuMemCreate) memCreate = nullptr;
  decltype(&cuMemGetAllocationGranularity) memGranularity = nullptr;
  decltype(&cuMemAddressReserve) memReserve = nullptr;
  decltype(&cuMemMap) memMap = nullptr;
  decltype(&cuMemSetAccess) memSetAccess = nullptr;
  decltype(&cuMemExportToShareableHandle) memExport = nullptr;
  decltype(&cuMemImportFromShareableHandle) memImport = nullptr;
  decltype(&cuMemUnmap) memUnmap = nullptr;
  decltype(&cuMemAddressFree) memAddressFree = nullptr;
  decltype(&cuMemRelease) memRelease = nullptr;
  decltype(&cuPointerGetAttributes) pointerGetAttributes = nullptr;
};

template <typename Fn>
void resolve(const char* name, Fn* fn, unsigned int version = 12000) {
  cudaDriverEntryPointQueryResult q;
  void* p = nullptr;
  check(cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q), name);
  TORCH_CHECK(q == cudaDriverEntryPointSuccess && p, "torch_sdma: the driver lacks ", name);
  *fn = reinterpret_cast<Fn>(p);
}

// Version 12000 binds the _v2 memop entry points; the unversioned symbol can bind v1, which older drivers
// refuse with "operation not supported".
const DriverEntryPoints& driver() {
  static DriverEntryPoints entry;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("cuStreamBatchMemOp", &entry.batchMemOp);
    resolve("cuMemCreate", &entry.memCreate);
    resolve("cuMemGetAllocationGranularity", &entry.memGranularity);
    resolve("cuMemAddressReserve", &entry.memReserve);
    resolve("cuMemMap", &entry.memMap);
    resolve("cuMemSetAccess", &entry.memSetAccess);
    resolve("cuMemExportToShareableHandle", &entry.memExport);
    resolve("cuMemImportFromShareableHandle", &entry.memImport);
    resolve("cuMemUnmap", &entry.memUnmap);
    resolve("cuMemAddressFree", &entry.memAddressFree);
    resolve("cuMemRelease", &entry.memRelease);
    resolve("cuPointerGetAttributes", &entry.pointerGetAttributes);
  });
  return entry;
}

// Resolved apart, at their first use: only a failure path needs them.
struct ContextEntryPoints {
  CtxCreateFn ctxCreate = nullptr;
  CtxPushFn ctxPush = nullptr;
  CtxPopFn ctxPop = nullptr;
  CtxSynchronizeFn ctxSynchronize = nullptr;
  DeviceGetFn deviceGet = nullptr;
  MemcpyHtoDFn memcpyHtoD = nullptr;
};

const ContextEntryPoints& contextDriver() {
  static ContextEntryPoints entry;
  static std::once_flag once;
  std::call_once(once, [] {
    resolve("cuCtxCreate", &entry.ctxCreate, 3020);  // (context, flags, device): later versions take more
    resolve("cuCtxPushCurrent", &entry.ctxPush);
    resolve("cuCtxPopCurrent", &entry.ctxPop);
    resolve("cuCtxSynchronize", &entry.ctxSynchronize);
    resolve("cuDeviceGet", &entry.deviceGet);
    resolve("cuMemcpyHtoD", &entry.memcpyHtoD);
  });
  return entry;
}

cudaStream_t raw(Stream s) {
  return static_cast<cudaStream_t>(s);
}

}  // namespace

std::string pciBusId(int device) {
  char buf[64] = {0};
  check(cudaDeviceGetPCIBusId(buf, sizeof(buf), device), "cudaDeviceGetPCIBusId");
  return std::string(buf);
}

int deviceByPciBusId(const std::string& busId) {
  int d = -1;
  if (cudaDeviceGetByPCIBusId(&d, busId.c_str()) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

bool canAccessPeer(int device, int peerDevice) {
  if (device == peerDevice) {
    return true;
  }
  int can = 0;
  check(cudaDeviceCanAccessPeer(&can, device, peerDevice), "cudaDeviceCanAccessPeer");
  return can != 0;
}

void* mallocDevice(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc of the staging buffer");
  return p;
}

void freeDevice(void* ptr) {
  if (ptr) {
    (void)cudaFree(ptr);
  }
}

void* mallocMappedHost(size_t bytes, void** deviceAddress) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc of a mapped host word");
  std::memset(p, 0, bytes);
  check(cudaHostGetDevicePointer(deviceAddress, p, 0), "cudaHostGetDevicePointer");
  return p;
}

void freeMappedHost(void* ptr) {
  if (ptr) {
    (void)cudaFreeHost(ptr);
  }
}

void memsetSync(void* ptr, int value, size_t bytes, Stream stream) {
  check(cudaMemsetAsync(ptr, value, bytes, raw(stream)), "cudaMemsetAsync");
  check(cudaStreamSynchronize(raw(stream)), "cudaStreamSynchronize");
}

namespace {

CUmemAllocationProp shareableProp(int device) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// Rounds *bytes up to the size VMM maps `device`'s memory in; leaves it as is when the driver will not say.
CUresult roundUpToGranularity(int device, size_t* bytes) {
  CUmemAllocationProp prop = shareableProp(device);
  size_t granularity = 0;
  const CUresult r = driver().memGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r == CUDA_SUCCESS && granularity) {
    *bytes = (*bytes + granularity - 1) / granularity * granularity;
  }
  return r;
}

std::string driverError(const char* what, CUresult r) {
  return std::string(what) + " failed with CUresult " + std::to_string(static_cast<int>(r));
}

// Reserves address space for `handle`, maps it and lets `device` read and write it.
std::string mapForDevice(int device, size_t bytes, SharedAllocation* a) {
  const auto& d = driver();
  CUdeviceptr ptr = 0;
  CUresult r = d.memReserve(&ptr, bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    return driverError("cuMemAddressReserve", r);
  }
  r = d.memMap(ptr, bytes, 0, a->handle, 0);
  if (r != CUDA_SUCCESS) {
    d.memAddressFree(ptr, bytes);
    return driverError("cuMemMap", r);
  }
  CUmemAccessDesc access;
  memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = d.memSetAccess(ptr, bytes, &access, 1);
  if (r != CUDA_SUCCESS) {
    d.memUnmap(ptr, bytes);
    d.memAddressFree(ptr, bytes);
    return driverError("cuMemSetAccess", r);
  }
  a->ptr = reinterpret_cast<void*>(ptr);
  a->bytes = bytes;
  return "";
}

}  // namespace

std::string allocateShareable(int device, size_t bytes, SharedAllocation* out) {
  const std::string unavailable = streamMemOpsUnavailableReason();
  if (!unavailable.empty()) {
    return unavailable;
  }
  const auto& d = driver();
  CUresult r = roundUpToGranularity(device, &bytes);
  if (r != CUDA_SUCCESS) {
    return driverError("cuMemGetAllocationGranularity", r);
  }
  const CUmemAllocationProp prop = shareableProp(device);
  SharedAllocation a;
  r = d.memCreate(&a.handle, bytes, &prop, 0);
  if (r != CUDA_SUCCESS) {
    return driverError("cuMemCreate", r);
  }
  std::string err = mapForDevice(device, bytes, &a);
  if (err.empty()) {
    r = d.memExport(&a.fd, a.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS) {
      err = driverError("cuMemExportToShareableHandle", r);
    }
  }
  if (!err.empty()) {
    freeShareable(&a);
    return err;
  }
  *out = a;
  return "";
}

std::string importShareable(int device, int fd, size_t bytes, SharedAllocation* out) {
  const auto& d = driver();
  SharedAllocation a;
  CUresult r = d.memImport(&a.handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(fd);  // the handle now holds the memory
  if (r != CUDA_SUCCESS) {
    return driverError("cuMemImportFromShareableHandle", r);
  }
  roundUpToGranularity(device, &bytes);  // as the exporter did
  std::string err = mapForDevice(device, bytes, &a);
  if (!err.empty()) {
    d.memRelease(a.handle);
    return err;
  }
  *out = a;
  return "";
}

void freeShareable(SharedAllocation* a) {
  const auto& d = driver();
  if (a->ptr) {
    d.memUnmap(reinterpret_cast<CUdeviceptr>(a->ptr), a->bytes);
    d.memAddressFree(reinterpret_cast<CUdeviceptr>(a->ptr), a->bytes);
  }
  if (a->handle) {
    d.memRelease(a->handle);
  }
  if (a->fd >= 0) {
    close(a->fd);
  }
  *a = SharedAllocation{};
}

bool describeAllocation(const void* ptr, AllocationRange* out) {
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  CUdeviceptr base = 0;
  size_t bytes = 0;
  unsigned long long id = 0;
  int legacyIpc = 0;
  void* values[] = {&base, &bytes, &id, &legacyIpc};
  if (driver().pointerGetAttributes(4, attributes, values, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS ||
      base == 0) {
    return false;
  }
  *out = AllocationRange{reinterpret_cast<char*>(base), bytes, id, legacyIpc != 0};
  return true;
}

IpcHandle exportIpc(void* base) {
  static_assert(sizeof(cudaIpcMemHandle_t) <= kIpcHandleBytes, "IPC handle size");
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle");
  IpcHandle out{};
  memcpy(out.bytes, &h, sizeof(h));
  return out;
}

void* importIpc(const IpcHandle& handle) {
  cudaIpcMemHandle_t h;
  memcpy(&h, handle.bytes, sizeof(h));
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return p;
}

void closeIpc(void* ptr) {
  if (ptr) {
    (void)cudaIpcCloseMemHandle(ptr);
  }
}

void copyAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  const cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, raw(stream));
  TORCH_CHECK(err == cudaSuccess, "torch_sdma: cudaMemcpyAsync of ", bytes, " bytes from ", src, " to ", dst,
              " failed: ", cudaGetErrorString(err));
}

void copyFromHostAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, raw(stream)), "cudaMemcpyAsync H2D");
}

void flagOps(Stream stream, const FlagOp* ops, int count) {
  if (count <= 0) {
    return;
  }
  constexpr int kInline = 32;
  CUstreamBatchMemOpParams inlineParams[kInline];
  std::vector<CUstreamBatchMemOpParams> heapParams;
  CUstreamBatchMemOpParams* params = inlineParams;
  if (count > kInline) {
    heapParams.resize(count);
    params = heapParams.data();
  }
  for (int i = 0; i < count; ++i) {
    memset(&params[i], 0, sizeof(params[i]));
    if (ops[i].write) {
      params[i].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_32;
      params[i].writeValue.address = reinterpret_cast<CUdeviceptr>(ops[i].flag);
      params[i].writeValue.value = ops[i].value;
      params[i].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
    } else {
      params[i].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_32;
      params[i].waitValue.address = reinterpret_cast<CUdeviceptr>(ops[i].flag);
      params[i].waitValue.value = ops[i].value;
      params[i].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    }
  }
  checkDriver(driver().batchMemOp(static_cast<CUstream>(stream), count, params, 0), "cuStreamBatchMemOp");
}

std::string streamMemOpsUnavailableReason() {
  try {
    driver();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

Stream createStream() {
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

int hardwareQueues() {
  // Read once: the driver reads it when the context is created, so a later change moves nothing, and every direct
  // collective asks.
  static const int queues = [] {
    const char* raw = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const int set = raw ? std::atoi(raw) : 0;
    return set > 0 ? set : 8;  // the driver's default
  }();
  return queues;
}

bool streamCapturing(Stream stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(raw(stream), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

bool releaseWithCapturedGraph(Stream capturing, void* object, void (*release)(void*)) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  cudaUserObject_t held = nullptr;
  if (cudaStreamGetCaptureInfo(raw(capturing), &status, nullptr, &graph) != cudaSuccess ||
      status != cudaStreamCaptureStatusActive || !graph ||
      cudaUserObjectCreate(&held, object, release, 1, cudaUserObjectNoDestructorSync) != cudaSuccess) {
    release(object);
    return false;
  }
  // The graph takes over the one reference: instantiation and launches hold it for as long as they need it.
  if (cudaGraphRetainUserObject(graph, held, 1, cudaGraphUserObjectMove) != cudaSuccess) {
    cudaUserObjectRelease(held, 1);  // the last reference: runs release
    return false;
  }
  return true;
}

void ignoreOtherThreadsCaptures() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
}

CaptureRelaxedScope::CaptureRelaxedScope() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  previous_ = static_cast<int>(mode);
}

CaptureRelaxedScope::~CaptureRelaxedScope() {
  auto mode = static_cast<cudaStreamCaptureMode>(previous_);
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
}

void destroyStream(Stream stream) {
  if (stream) {
    (void)cudaStreamDestroy(raw(stream));
  }
}

void syncDevice(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  check(cudaSetDevice(device), "cudaSetDevice");
  const cudaError_t err = cudaDeviceSynchronize();
  cudaSetDevice(current);
  check(err, "cudaDeviceSynchronize");
}

void syncStream(Stream stream) {
  check(cudaStreamSynchronize(raw(stream)), "cudaStreamSynchronize");
}

void copyFromHostBesideStreams(int device, void* dst, const void* src, size_t bytes) {
  const auto& d = contextDriver();
  static std::mutex mutex;
  static std::vector<CUcontext> contexts;  // by device; never destroyed (see the header)
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (contexts.size() <= static_cast<size_t>(device)) {
      contexts.resize(device + 1, nullptr);
    }
    if (!contexts[device]) {
      CUdevice dev = 0;
      checkDriver(d.deviceGet(&dev, device), "cuDeviceGet");
      checkDriver(d.ctxCreate(&contexts[device], 0, dev), "cuCtxCreate of a context beside the primary one");
      // Created current on this thread: the thread's own context comes back.
      CUcontext created = nullptr;
      checkDriver(d.ctxPop(&created), "cuCtxPopCurrent");
    }
    ctx = contexts[device];
  }
  checkDriver(d.ctxPush(ctx), "cuCtxPushCurrent");
  // From pageable memory the copy may return before its DMA is done: the context's synchronize waits for that.
  CUresult r = d.memcpyHtoD(reinterpret_cast<CUdeviceptr>(dst), src, bytes);
  if (r == CUDA_SUCCESS) {
    r = d.ctxSynchronize();
  }
  CUcontext popped = nullptr;
  (void)d.ctxPop(&popped);
  checkDriver(r, "a copy from a context beside the primary one");
}

Event createEvent() {
  cudaEvent_t e;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  return e;
}

void destroyEvent(Event event) {
  if (event) {
    (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
}

void recordEvent(Event event, Stream stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event), raw(stream)), "cudaEventRecord");
}

bool eventDone(Event event) {
  cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void streamWaitEvent(Stream stream, Event event) {
  check(cudaStreamWaitEvent(raw(stream), static_cast<cudaEvent_t>(event), 0), "cudaStreamWaitEvent");
}

}  // namespace gpu
}  // namespace sdma
