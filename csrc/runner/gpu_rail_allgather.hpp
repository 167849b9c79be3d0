// The step between nodes of the hierarchical all-gather for CUDA tensors: NCCL on this rank's rail, on a stream of
// its own, so that one chunk's gather (NCCL's kernels and the network) runs while the chunk before fans out inside
// the node on the copy engines. It meets the node transport's lanes only through events.
//
// One per node transport: its buffers have that transport's segment size, and stay alive as long as a collective
// in flight that used them (the runner keeps both in its record of the collective).
#pragma once

#include <memory>
#include <vector>

#include "collective/inner_allgather.hpp"
#include "gpu/gpu_api.hpp"
#include "runner/collective_runner.hpp"
#include "runner/group_free_caller.hpp"
#include "transport/copy_engine_transport.hpp"

namespace sdma {

class GpuRailAllgather : public InnerAllgather {
 public:
  // `network`: the stream every gather of the group runs on (the runner's, so that gathers stay in call order
  // across transports).
  GpuRailAllgather(CopyEngineTransport& transport, std::shared_ptr<const HierarchicalSetup> setup, int device,
                   gpu::Stream network);
  ~GpuRailAllgather() override;
  GpuRailAllgather(const GpuRailAllgather&) = delete;
  GpuRailAllgather& operator=(const GpuRailAllgather&) = delete;

  int railSize() const override {
    return setup_->layout.nodeCount();
  }
  int railRank() const override {
    return setup_->node();
  }
  char* gathered(int slot) override {
    return buffer_ + static_cast<size_t>(slot) * segmentBytes_;
  }
  void gather(int slot, Lane after, const std::vector<ByteSpan>& mine, size_t bytes) override;
  void awaitGathered(Lane lane, int slot) override;

 private:
  CopyEngineTransport& transport_;
  const std::shared_ptr<const HierarchicalSetup> setup_;
  const int device_;
  const gpu::Stream network_;
  const size_t segmentBytes_;
  char* buffer_ = nullptr;
  gpu::Event lanePassed_ = nullptr;
  std::vector<gpu::Event> landed_;  // per slot: its last gather
  GroupFreeCaller railCaller_;
};

}  // namespace sdma
