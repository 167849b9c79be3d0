// What the backend asks of a device's all-gather runner, and how it gets one. A runner owns a transport, the
// threads that watch it and the per-group serials; the backend never sees which device's runner it holds.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <string>

#include "collective/allgather_inputs.hpp"
#include "collective/collective_info.hpp"
#include "collective/collective_path.hpp"
#include "transport/staging_geometry.hpp"

namespace sdma {

class AllgatherRunner {
 public:
  virtual ~AllgatherRunner() = default;

  // The DMA path (or a variant of it) when this collective can run here, else the inner backend and why.
  virtual CollectivePath pathFor(const PlannedAllgather& planned) = 0;
  // Enqueues the collective; never blocks on the peers. Consumes planned's tensors.
  virtual c10::intrusive_ptr<c10d::Work> run(PlannedAllgather& planned, bool asyncOp, const CollectiveInfo& info) = 0;
  virtual size_t stagingBytes() const = 0;
};

// Copy engines, for CUDA tensors (copy_engine_runner.cpp; a build without CUDA says why not).
// Collective, at group creation: "" when the group's CUDA all-gathers can take the copy engines, else why not.
std::string copyEnginePathProblem(c10d::Store& store, int rank, int size);
// Collective, at the group's first eligible CUDA all-gather: null, with the reason in *whyNot, when the
// transport cannot connect (every member then agrees).
// `geometry`: the cap; the runner sizes staging to what the group needs, up to it.
std::unique_ptr<AllgatherRunner> connectCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                         int size, int device, const StagingGeometry& geometry,
                                                         std::string* whyNot);

// Shared memory, for CPU tensors (shared_memory_runner.cpp).
std::string sharedMemoryPathProblem(c10d::Store& store, int rank, int size);
std::unique_ptr<AllgatherRunner> connectSharedMemoryRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                           int size, const StagingGeometry& geometry, bool direct,
                                                           const std::string& groupName, std::string* whyNot);

}  // namespace sdma
