#include "runner/captured_lanes.hpp"

#include "runner/graph_held_transports.hpp"
#include "work/gpu_work.hpp"

namespace sdma {

std::shared_ptr<CopyEngineTransport> connectCapturedTransport(c10d::Store& store, int rank, int size, int device,
                                                              const StagingGeometry& geometry,
                                                              const std::vector<MemberIdentity>& members) {
  gpu::CaptureRelaxedScope relaxed;
  return CopyEngineTransport::connect(store, rank, size, device, geometry, members);
}

CapturedLanes::CapturedLanes() {
  push_ = gpu::createStream();
  fork_ = gpu::createEvent();
  join_ = gpu::createEvent();
}

// The push stream only ever records into captures: no work of its own can still run on it.
CapturedLanes::~CapturedLanes() {
  gpu::destroyEvent(fork_);
  gpu::destroyEvent(join_);
  gpu::destroyStream(push_);
}

void CapturedLanes::run(gpu::Stream caller, bool pipelined, const std::shared_ptr<CopyEngineTransport>& transport,
                        const std::function<void(CopyEngineTransport&)>& schedule) {
  gpu::Stream push = pipelined ? push_ : caller;
  if (pipelined) {
    gpu::recordEvent(fork_, caller);
    gpu::streamWaitEvent(push, fork_);
  }
  transport->bindLanes(push, caller);
  schedule(*transport);
  transport->flush();
  holdWhileGraphLives(caller, transport);
  if (pipelined) {
    gpu::recordEvent(join_, push);
    gpu::streamWaitEvent(caller, join_);
  }
}

c10::intrusive_ptr<c10d::Work> capturedWork(gpu::Stream caller, const std::shared_ptr<EventPool>& endEvents,
                                            const CollectiveInfo& info, at::Device device,
                                            std::vector<at::Tensor> outputs) {
  gpu::Event end = endEvents->take();
  gpu::recordEvent(end, caller);
  auto completion = std::make_shared<GpuCompletion>(end, endEvents, std::vector<at::Tensor>{}, /*captured=*/true);
  return c10::make_intrusive<GpuWork>(info, device, std::move(outputs), completion);
}

}  // namespace sdma
