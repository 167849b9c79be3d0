#include "process_group_sdma.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Logging.h>

#include <algorithm>

#include "host_allgather_runner.hpp"
#include "host_shm_transport.hpp"

#ifdef TORCH_SDMA_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "copy_engine_transport.hpp"
#include "cuda_allgather_runner.hpp"
#else
namespace sdma {
class CudaAllgatherRunner {};  // a CPU-only build never creates one
}  // namespace sdma
#endif

namespace sdma {
namespace {

// What endCoalescing returns when a coalescing block issued several works of its own: done when all are.
class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts)
      : Work(-1, c10d::OpType::COALESCED), parts_(std::move(parts)) {}
  bool isCompleted() override {
    return std::all_of(parts_.begin(), parts_.end(), [](auto& w) { return w->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(parts_.begin(), parts_.end(), [](auto& w) { return w->isSuccess(); });
  }
  std::exception_ptr exception() const override {
    for (auto& w : parts_) {
      if (auto e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }
  void synchronize() override {
    for (auto& w : parts_) {
      w->synchronize();
    }
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : parts_) {
      w->wait(timeout);
    }
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return parts_.back()->getFuture();
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

int64_t tensorBytes(const std::vector<at::Tensor>& ts) {
  int64_t b = 0;
  for (const auto& t : ts) {
    b += t.numel() * t.element_size();
  }
  return b;
}

}  // namespace

ProcessGroupSDMA::ProcessGroupSDMA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> innerCpu,
                                   c10::intrusive_ptr<c10d::Backend> innerCuda, SdmaConfig config,
                                   std::string groupName)
    : Backend(rank, size),
      store_(store),
      timeout_(timeout),
      innerCpu_(std::move(innerCpu)),
      innerCuda_(std::move(innerCuda)),
      config_(std::move(config)),
      groupName_(std::move(groupName)) {
  // Every member runs these exchanges at creation, so the group's log line can say which path it will take.
  auto sdmaStore = c10::make_intrusive<c10d::PrefixStore>("sdma/", store_);
  if (innerCuda_) {
    if (config_.disable) {
      cudaVerdict_ = "inner:TORCH_SDMA_DISABLE=1";
    } else {
#ifdef TORCH_SDMA_CUDA
      const std::string why =
          CopyEngineTransport::checkGroupReachable(*sdmaStore, "ce/create", rank, size, c10::cuda::current_device());
      cudaVerdict_ = why.empty() ? "dma" : "inner:" + why;
#else
      cudaVerdict_ = "inner:torch_sdma was built without CUDA";
#endif
    }
  }
  if (innerCpu_) {
    if (config_.disable) {
      hostVerdict_ = "inner:TORCH_SDMA_DISABLE=1";
    } else {
      const std::string why = HostShmTransport::checkSameHost(*sdmaStore, "shm/create", rank, size);
      hostVerdict_ = why.empty() ? "dma" : "inner:" + why;
    }
  }
}

ProcessGroupSDMA::~ProcessGroupSDMA() = default;

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupSDMA::getBackendOptions() {
  // split_group deep-copies these and hands them back to split(); the inner NCCL backend needs its own kind.
  if (innerCuda_) {
    return innerCuda_->getBackendOptions();
  }
  if (innerCpu_) {
    return innerCpu_->getBackendOptions();
  }
  auto opts = c10::make_intrusive<Options>("sdma", timeout_);
  opts->group_name = groupName_;
  return opts;
}

StagingGeometry ProcessGroupSDMA::geometry(const at::Device& device) const {
  StagingGeometry g;
  g.worldSize = getSize();
  g.slots = config_.slots;
  const int64_t staging = device.is_cuda() ? config_.stagingBytesCuda : config_.stagingBytesCpu;
  const size_t perSegment = static_cast<size_t>(staging) / (g.slots * static_cast<size_t>(g.segmentsPerSlot()));
  g.chunkBytes = std::max(kPageBytes, perSegment / kPageBytes * kPageBytes);
  g.pipelineChunkBytes = static_cast<size_t>(config_.chunkBytes);
  return g;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch to the inner backends.

c10::intrusive_ptr<c10d::Backend>& ProcessGroupSDMA::innerFor(const at::Device& device, const char* op) {
  if (device.is_cuda()) {
    TORCH_CHECK(innerCuda_, "torch_sdma: ", op, " on CUDA tensors cannot run in this process: ",
                config_.cudaUnavailable.empty() ? "no CUDA backend was created for this group"
                                                : config_.cudaUnavailable);
    return innerCuda_;
  }
  TORCH_CHECK(innerCpu_, "torch_sdma: ", op, " on ", device.str(),
              " tensors: this group's sdma backend serves CUDA only; pass \"cpu:gloo,cuda:sdma\" or \"sdma\"");
  return innerCpu_;
}

c10::intrusive_ptr<c10d::Backend>& ProcessGroupSDMA::innerFor(const std::vector<at::Tensor>& tensors,
                                                              const char* op) {
  TORCH_CHECK(!tensors.empty(), "torch_sdma: ", op, " needs at least one tensor");
  return innerFor(tensors[0].device(), op);
}

void ProcessGroupSDMA::recordPath(const std::string& path, int64_t bytes) {
  std::lock_guard<std::mutex> lock(statsMutex_);
  auto& s = stats_[path];
  s.first += 1;
  s.second += bytes;
}

void ProcessGroupSDMA::countDelegated(const char* op, int64_t bytes) {
  ++seq_;
  recordPath(std::string("delegated:") + op, bytes);
}

// Inside a coalescing block NCCL collects its own works; gloo's run at once, so endCoalescing must return them.
#define SDMA_DELEGATE(op, tensors, bytes, call)                 \
  do {                                                          \
    auto& inner = innerFor(tensors, op);                        \
    countDelegated(op, bytes);                                  \
    auto work = inner->call;                                    \
    return inner == innerCuda_ ? work : trackCoalesced(work);   \
  } while (0)

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  SDMA_DELEGATE("broadcast", tensors, tensorBytes(tensors), broadcast(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  SDMA_DELEGATE("allreduce", tensors, tensorBytes(tensors), allreduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  SDMA_DELEGATE("allreduce_sparse", tensors, 0, allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  SDMA_DELEGATE("allreduce_coalesced", tensors, tensorBytes(tensors), allreduce_coalesced(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  SDMA_DELEGATE("reduce", tensors, tensorBytes(tensors), reduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  SDMA_DELEGATE("gather", inputs, tensorBytes(inputs), gather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  SDMA_DELEGATE("scatter", outputs, tensorBytes(outputs), scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  SDMA_DELEGATE("reduce_scatter", outputs, tensorBytes(outputs), reduce_scatter(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  std::vector<at::Tensor> ts{output};
  SDMA_DELEGATE("reduce_scatter_tensor", ts, tensorBytes(ts), _reduce_scatter_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  SDMA_DELEGATE("reduce_scatter_tensor_coalesced", outputs, tensorBytes(outputs),
                reduce_scatter_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                               std::vector<int64_t>& outputSplitSizes,
                                                               std::vector<int64_t>& inputSplitSizes,
                                                               const c10d::AllToAllOptions& opts) {
  std::vector<at::Tensor> ts{output};
  SDMA_DELEGATE("alltoall_base", ts, tensorBytes(ts),
                alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  SDMA_DELEGATE("alltoall", outputs, tensorBytes(outputs), alltoall(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  SDMA_DELEGATE("send", tensors, tensorBytes(tensors), send(tensors, dstRank, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  SDMA_DELEGATE("recv", tensors, tensorBytes(tensors), recv(tensors, srcRank, tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  SDMA_DELEGATE("recvAnysource", tensors, tensorBytes(tensors), recvAnysource(tensors, tag));
}

#undef SDMA_DELEGATE

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::barrier(const c10d::BarrierOptions& opts) {
  // NCCL's barrier is an all-reduce on a GPU; prefer it when the caller names a GPU or there is no CPU backend.
  const bool onGpu = innerCuda_ && (!innerCpu_ || !opts.device_ids.empty() || (opts.device && opts.device->is_cuda()));
  auto& inner = innerFor(at::Device(onGpu ? at::kCUDA : at::kCPU), "barrier");
  countDelegated("barrier");
  return inner->barrier(opts);
}

void ProcessGroupSDMA::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  auto& inner = innerCpu_ ? innerCpu_ : innerFor(at::Device(at::kCUDA), "monitoredBarrier");
  countDelegated("monitoredBarrier");
  inner->monitoredBarrier(opts, waitAllRanks);
}

// ---------------------------------------------------------------------------------------------------------------
// All-gather.

CollectiveInfo ProcessGroupSDMA::describe(const char* op, c10d::OpType opType, const c10d::AllgatherOptions& opts) {
  return CollectiveInfo{opType, op, ++seq_, groupName_, getRank(), getSize(),
                        opts.timeout.count() > 0 ? opts.timeout : timeout_};
}

std::string ProcessGroupSDMA::dmaRefusal(const at::Device& device, const PlannedAllgather& planned) {
  if (!planned.notForDma.empty()) {
    return planned.notForDma;
  }
  if (config_.disable) {
    return "TORCH_SDMA_DISABLE=1";
  }
  if (static_cast<int64_t>(planned.outputBytes) < (device.is_cuda() ? config_.minBytesCuda : config_.minBytesCpu)) {
    return "below TORCH_SDMA_MIN_BYTES";
  }
  if (device.is_cuda()) {
#ifdef TORCH_SDMA_CUDA
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(device.index()).stream(), &capture) == cudaSuccess &&
        capture != cudaStreamCaptureStatusNone) {
      return "CUDA graph capture";
    }
    if (cudaPath_ == "unknown") {
      c10::cuda::CUDAGuard guard(device.index());
      std::string why;
      auto store = c10::make_intrusive<c10d::PrefixStore>("sdma/", store_);
      auto transport =
          CopyEngineTransport::connect(*store, getRank(), getSize(), device.index(), geometry(device), &why);
      if (transport) {
        cudaRunner_ = std::make_unique<CudaAllgatherRunner>(std::move(transport), device.index());
        cudaDevice_ = device.index();
        cudaPath_ = "dma";
      } else {
        cudaPath_ = "inner:" + why;
        LOG(WARNING) << "torch_sdma: group '" << groupName_ << "' sends CUDA all-gathers to the inner backend: "
                     << why;
      }
    }
    if (!cudaRunner_) {
      return cudaPath_.substr(std::string("inner:").size());
    }
    if (device.index() != cudaDevice_) {
      return "tensor on another GPU than the group's first all-gather";
    }
    return "";
#else
    return "torch_sdma was built without CUDA";
#endif
  }
  if (hostPath_ == "unknown") {
    std::string why;
    auto store = c10::make_intrusive<c10d::PrefixStore>("sdma/", store_);
    auto transport =
        HostShmTransport::connect(*store, getRank(), getSize(), geometry(device), config_.direct, &why);
    if (transport && config_.direct && !transport->directUnavailable().empty()) {
      LOG(WARNING) << "torch_sdma: group '" << groupName_ << "' runs CPU all-gathers through staging, not "
                   << "directly: " << transport->directUnavailable();
    }
    if (transport) {
      hostRunner_ = std::make_unique<HostAllgatherRunner>(std::move(transport));
      hostPath_ = "dma";
    } else {
      hostPath_ = "inner:" + why;
      LOG(WARNING) << "torch_sdma: group '" << groupName_ << "' sends CPU all-gathers to gloo: " << why;
    }
  }
  return hostRunner_ ? "" : hostPath_.substr(std::string("inner:").size());
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::runDma(const char* op, c10d::OpType opType,
                                                        const at::Device& device, PlannedAllgather& planned,
                                                        const c10d::AllgatherOptions& opts) {
  const CollectiveInfo info = describe(op, opType, opts);
  c10::intrusive_ptr<WorkSDMA> work;
  if (device.is_cuda()) {
#ifdef TORCH_SDMA_CUDA
    work = cudaRunner_->run(planned.plan, opts.asyncOp, info, std::move(planned.outputs),
                            std::move(planned.keepAlive));
#endif
  } else {
    work = hostRunner_->run(planned.plan, info, std::move(planned.outputs), std::move(planned.keepAlive));
  }
  recordPath("dma", static_cast<int64_t>(planned.outputBytes));
  return trackCoalesced(work);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::trackCoalesced(c10::intrusive_ptr<c10d::Work> work) {
  if (coalescing_ && work) {
    coalescedWorks_.push_back(work);
  }
  return work;
}

// Each form: check with NCCL's words, decide the path, then either run the schedule or hand over.
#define SDMA_ALLGATHER(op, opType, device, planExpr, innerCall)                    \
  do {                                                                            \
    PlannedAllgather planned = planExpr;                                          \
    const std::string refusal = dmaRefusal(device, planned);                      \
    if (refusal.empty()) {                                                        \
      return runDma(op, opType, device, planned, opts);                           \
    }                                                                             \
    auto& inner = innerFor(device, op);                                           \
    ++seq_;                                                                       \
    recordPath("inner:" + refusal, static_cast<int64_t>(planned.outputBytes));    \
    return inner->innerCall;                                                      \
  } while (0)

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  SDMA_ALLGATHER("all_gather_into_tensor", c10d::OpType::_ALLGATHER_BASE, input.device(),
                 planAllgatherIntoTensor(output, input, getRank(), getSize()),
                 _allgather_base(output, input, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "torch_sdma: all_gather needs an input tensor");
  SDMA_ALLGATHER("all_gather", c10d::OpType::ALLGATHER, inputs[0].device(),
                 planAllgatherList(outputs, inputs, getRank(), getSize()), allgather(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(!inputs.empty(), "torch_sdma: allgather_into_tensor_coalesced needs at least one input tensor");
  SDMA_ALLGATHER("allgather_into_tensor_coalesced", c10d::OpType::COALESCED, inputs[0].device(),
                 planAllgatherIntoTensorCoalesced(outputs, inputs, getRank(), getSize()),
                 allgather_into_tensor_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  TORCH_CHECK_WITH(ValueError, !inputs.empty(), "allgather_coalesced: requires a non-empty input tensor list");
  SDMA_ALLGATHER("allgather_coalesced", c10d::OpType::ALLGATHER_COALESCED, inputs[0].device(),
                 planAllgatherCoalesced(outputLists, inputs, getRank(), getSize()),
                 allgather_coalesced(outputLists, inputs, opts));
}

#undef SDMA_ALLGATHER

// ---------------------------------------------------------------------------------------------------------------
// Control.

void ProcessGroupSDMA::startCoalescing() {
  coalescing_ = true;
  coalescedWorks_.clear();
  if (innerCuda_) {
    innerCuda_->startCoalescing();
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::endCoalescing() {
  std::vector<c10::intrusive_ptr<c10d::Work>> parts;
  parts.swap(coalescedWorks_);
  coalescing_ = false;
  if (innerCuda_) {
    if (auto innerWork = innerCuda_->endCoalescing()) {
      parts.push_back(innerWork);
    }
  }
  if (parts.empty()) {
    return nullptr;
  }
  if (parts.size() == 1) {
    return parts[0];
  }
  return c10::make_intrusive<CoalescedWork>(std::move(parts));
}

bool ProcessGroupSDMA::supportsSplitting() const {
  return innerCuda_ && innerCuda_->supportsSplitting();
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupSDMA::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                          const std::vector<int>& ranks,
                                                          const c10::intrusive_ptr<Options>& opts) {
  // One object may be registered for two device types; ProcessGroup::splitGroup then asks it twice.
  auto cached = splits_.find(opts->group_name);
  if (cached != splits_.end()) {
    return cached->second;
  }
  c10::intrusive_ptr<c10d::Backend> cuda, cpu;
  if (innerCuda_ && innerCuda_->supportsSplitting()) {
    cuda = innerCuda_->split(c10::make_intrusive<c10d::PrefixStore>("nccl/", store), ranks, opts);
  }
  if (innerCpu_ && innerCpu_->supportsSplitting()) {
    cpu = innerCpu_->split(c10::make_intrusive<c10d::PrefixStore>("gloo/", store), ranks,
                           innerCpu_->getBackendOptions());
  }
  c10::intrusive_ptr<c10d::Backend> result;
  const auto me = std::find(ranks.begin(), ranks.end(), getRank());
  if (me != ranks.end()) {
    result = c10::make_intrusive<ProcessGroupSDMA>(
        c10::make_intrusive<c10d::PrefixStore>(opts->group_name + "/", store),
        static_cast<int>(me - ranks.begin()), static_cast<int>(ranks.size()), opts->timeout, cpu, cuda, config_,
        opts->group_name);
  }
  splits_[opts->group_name] = result;
  return result;
}

void ProcessGroupSDMA::setSequenceNumberForGroup() {
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->setSequenceNumberForGroup();
    }
  }
}

uint64_t ProcessGroupSDMA::getSequenceNumberForGroup() {
  return seq_;
}

void ProcessGroupSDMA::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda() && innerCuda_) {
    innerCuda_->eagerConnectSingleDevice(device);
  }
}

void ProcessGroupSDMA::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      try {
        (*inner)->setTimeout(timeout);
      } catch (const c10::Error&) {
        // torch < 2.14 gloo has no setTimeout; our own collectives still use the new value.
      }
    }
  }
}

void ProcessGroupSDMA::abort() {
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->abort();
    }
  }
}

void ProcessGroupSDMA::shutdown() {
  // The runners' destructors wait for collectives in flight (bounded by the timeout), then free staging.
#ifdef TORCH_SDMA_CUDA
  cudaRunner_.reset();
#endif
  hostRunner_.reset();
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->shutdown();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Introspection.

std::map<std::string, std::pair<int64_t, int64_t>> ProcessGroupSDMA::stats() const {
  std::lock_guard<std::mutex> lock(statsMutex_);
  return stats_;
}

void ProcessGroupSDMA::resetStats() {
  std::lock_guard<std::mutex> lock(statsMutex_);
  stats_.clear();
}

std::string ProcessGroupSDMA::pathFor(c10::DeviceType device) const {
  if (config_.disable) {
    return "inner:TORCH_SDMA_DISABLE=1";
  }
  return device == c10::DeviceType::CUDA ? cudaPath_ : hostPath_;
}

std::string ProcessGroupSDMA::creationVerdict(c10::DeviceType device) const {
  return device == c10::DeviceType::CUDA ? cudaVerdict_ : hostVerdict_;
}

int64_t ProcessGroupSDMA::stagingBytesInUse() const {
  int64_t b = 0;
#ifdef TORCH_SDMA_CUDA
  if (cudaRunner_) {
    b += static_cast<int64_t>(cudaRunner_->stagingBytes());
  }
#endif
  if (hostRunner_) {
    b += static_cast<int64_t>(hostRunner_->stagingBytes());
  }
  return b;
}

}  // namespace sdma
