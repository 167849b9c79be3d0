// What every schedule captured into a CUDA graph needs of the runner (docs/design.md, "Captured"): a transport of its
// own, connected during the capture with the capture mode relaxed; lanes forked from the capturing stream and joined
// back into it before the call returns, the transport held by every graph that captured it; and a Work that the
// watchdog never sees. Shared by the group's captured collectives (copy_engine_runner.cpp) and the pairs' captured
// point-to-point (captured_p2p_pairs.hpp).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <vector>

#include "collective/collective_info.hpp"
#include "gpu/gpu_api.hpp"
#include "transport/copy_engine_transport.hpp"
#include "work/gpu_completion.hpp"

namespace sdma {

// Collective over `members` (every one calls it together): a transport for captured schedules. Allocating and
// mapping memory is refused during a global-mode capture unless this thread relaxes it for the moment, as the caching
// allocator does for graph pools. `store` must be fresh per connection.
std::shared_ptr<CopyEngineTransport> connectCapturedTransport(c10d::Store& store, int rank, int size, int device,
                                                              const StagingGeometry& geometry,
                                                              const std::vector<MemberIdentity>& members);

// The lanes of captured schedules on one GPU: a push stream of their own (never an eager lane's, which would join
// the capture) and the events that fork it from the capturing stream and join it back.
class CapturedLanes {
 public:
  CapturedLanes();  // on the current device
  ~CapturedLanes();
  CapturedLanes(const CapturedLanes&) = delete;
  CapturedLanes& operator=(const CapturedLanes&) = delete;

  // Runs `schedule` on `transport`: its Push lane forked from `caller` where `pipelined` (else both lanes on `caller`,
  // where program order runs a round's pushes before its drains, which no hardware queue can reverse), and all of it
  // joined back into `caller` before this returns: a graph may not end with a stream it forked still outside it, and
  // the caller may never wait(). The graph being captured holds `transport` for as long as it may replay.
  void run(gpu::Stream caller, bool pipelined, const std::shared_ptr<CopyEngineTransport>& transport,
           const std::function<void(CopyEngineTransport&)>& schedule);

 private:
  gpu::Stream push_ = nullptr;
  gpu::Event fork_ = nullptr;
  gpu::Event join_ = nullptr;
};

// The Work of what was just captured on `caller`: complete at once for the CPU (its copies run only in replays), and
// never handed to a watchdog, as ProcessGroupNCCL keeps captured works from its watchdog. The graph's memory pool and
// the caller keep the tensors.
c10::intrusive_ptr<c10d::Work> capturedWork(gpu::Stream caller, const std::shared_ptr<EventPool>& endEvents,
                                            const CollectiveInfo& info, at::Device device,
                                            std::vector<at::Tensor> outputs);

}  // namespace sdma
