// The step between nodes of the hierarchical all-gather for CPU tensors: the gloo backend of this rank's rail, run
// by the host runner's worker in its place among the node transport's operations. Nothing overlaps on CPU (the worker
// is serial): a gather and the fan-out inside the node take turns.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "collective/inner_allgather.hpp"
#include "runner/collective_runner.hpp"
#include "transport/host_shm_transport.hpp"

namespace sdma {

class HostRailAllgather : public InnerAllgather {
 public:
  // Gathers land in buffers of `segmentBytes` (the node transport's segment) per slot, private to this process:
  // only this rank reads them, to push into its node's staging.
  HostRailAllgather(HostShmTransport& transport, HierarchicalSetup setup, size_t segmentBytes);

  const HierarchicalSetup& setup() const {
    return setup_;
  }

  int railSize() const override {
    return setup_.layout.nodeCount();
  }
  int railRank() const override {
    return setup_.node();
  }
  char* gathered(int slot) override {
    return buffer_.get() + slot * segmentBytes_;
  }
  void gather(int slot, Lane after, const std::vector<ByteSpan>& mine, size_t bytes) override;
  void awaitGathered(Lane, int) override {}  // the worker runs everything in the order it was scheduled

 private:
  void gatherNow(int slot, const std::vector<ByteSpan>& mine, size_t bytes,
                 std::chrono::steady_clock::time_point deadline, const std::string& description);

  HostShmTransport& transport_;
  const size_t segmentBytes_;
  std::unique_ptr<char[]> buffer_;
  // After the buffers: the rail backend goes first, and its destructor waits for a gather it still runs.
  const HierarchicalSetup setup_;
};

}  // namespace sdma
