#include "runner/gpu_rail_allgather.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace sdma {

GpuRailAllgather::GpuRailAllgather(CopyEngineTransport& transport, std::shared_ptr<const HierarchicalSetup> setup,
                                   int device, gpu::Stream network)
    : transport_(transport),
      setup_(std::move(setup)),
      device_(device),
      network_(network),
      segmentBytes_(transport.geometry().chunkBytes) {
  TORCH_CHECK(setup_, "torch_sdma: the hierarchical all-gather on GPU ", device_,
              " has no setup (a bug in torch_sdma)");
  setup_->checkDescribes(transport.rank(), transport.geometry().worldSize);
  // From torch's caching allocator, on the network stream, rather than cudaMalloc: freeing it then never
  // synchronizes the device (the watchdog may free it, and must never wait on a stuck stream), and no other stream
  // is handed the memory while a gather on the network stream could still write it.
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
  buffer_ = static_cast<char*>(c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
      static_cast<size_t>(transport.geometry().slots) * segmentBytes_, static_cast<cudaStream_t>(network_)));
  lanePassed_ = gpu::createEvent();
  for (int s = 0; s < transport.geometry().slots; ++s) {
    landed_.push_back(gpu::createEvent());
  }
}

GpuRailAllgather::~GpuRailAllgather() {
  for (gpu::Event e : landed_) {
    gpu::destroyEvent(e);
  }
  gpu::destroyEvent(lanePassed_);
  c10::cuda::CUDACachingAllocator::raw_delete(buffer_);
}

void GpuRailAllgather::gather(int slot, Lane after, const std::vector<ByteSpan>& mine, size_t bytes) {
  // The schedule gathers chunks of at least a byte; an empty list would leave `in` below undefined.
  TORCH_CHECK(bytes > 0 && !mine.empty(), "torch_sdma: a gather between nodes of ", bytes, " bytes in ", mine.size(),
              " pieces (a bug in torch_sdma)");
  gpu::recordEvent(lanePassed_, transport_.laneStream(after));
  gpu::streamWaitEvent(network_, lanePassed_);
  char* out = gathered(slot);
  const char* in = mine.front().ptr;
  if (mine.size() > 1) {
    // A chunk that spans several tensors of a coalesced form: packed into its own place in the gathered buffer,
    // which NCCL then gathers in place.
    char* own = out + static_cast<size_t>(railRank()) * bytes;
    for (const ByteSpan& piece : mine) {
      gpu::copyAsync(own, piece.ptr, piece.bytes, network_);
      own += piece.bytes;
    }
    in = out + static_cast<size_t>(railRank()) * bytes;
  }
  const auto options = at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_);
  const auto n = static_cast<int64_t>(bytes);
  at::Tensor output = at::from_blob(out, {n * railSize()}, options);
  at::Tensor input = at::from_blob(const_cast<char*>(in), {n}, options);
  // From our own thread, outside any NCCL group the caller has open (group_free_caller.hpp). NCCL enqueues on the
  // current stream for a synchronous call, and wait() orders the current stream after the work wherever NCCL ran
  // it; neither blocks the CPU.
  railCaller_.run([&] {
    c10::cuda::CUDAGuard onDevice(static_cast<c10::DeviceIndex>(device_));
    c10::cuda::CUDAStreamGuard onNetwork(
        c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(network_), static_cast<c10::DeviceIndex>(device_)));
    c10d::AllgatherOptions opts;  // the rail backend's timeout: the group's
    opts.asyncOp = false;
    // ProcessGroupNCCL returns no Work for a synchronous call (torch >= 2.8): its gather is on the network stream
    // already, which is all the schedule needs. Calling wait() through the null Work crashed every rank.
    const auto work = setup_->rail->_allgather_base(output, input, opts);
    if (work) {
      work->wait();
    }
  });
  gpu::recordEvent(landed_[slot], network_);
}

void GpuRailAllgather::awaitGathered(Lane lane, int slot) {
  gpu::streamWaitEvent(transport_.laneStream(lane), landed_[slot]);
}

}  // namespace sdma
