// A build without CUDA (TORCH_SDMA_CUDA unset, e.g. a CPU-only torch): CUDA all-gathers go to the inner backend.
#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>

#include "runner/collective_runner.hpp"
#include "runner/p2p_runner.hpp"

namespace sdma {
namespace {
constexpr const char* kWhy = "torch_sdma was built without CUDA";
}  // namespace

std::string copyEnginePathProblem(c10d::Store&, int, int) {
  return kWhy;
}

// The user's allocator setting, read as the CUDA build reads it (c10 parses it in every build): the group's options
// then come out the same on a CPU torch as on a CUDA one, so a setting that differs between ranks is agreed on, or
// refused, the same way wherever the tests run.
bool cachingAllocatorUsesExpandableSegments() {
  return c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
}

std::unique_ptr<CollectiveRunner> connectCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>&, int, int, int,
                                                          const StagingGeometry&, const DirectPathOptions&,
                                                          std::string* whyNot) {
  *whyNot = kWhy;
  return nullptr;
}

std::unique_ptr<CollectiveRunner> connectHierarchicalCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>&, int,
                                                                      const StagingGeometry&, HierarchicalSetup,
                                                                      std::string* whyNot) {
  *whyNot = kWhy;
  return nullptr;
}

std::unique_ptr<P2pRunner> makeCopyEngineP2pRunner(c10::intrusive_ptr<c10d::Store>, int, int, CallBoard*,
                                                   const DirectPathOptions&, const StagingGeometry&) {
  TORCH_CHECK(false, "torch_sdma: ", kWhy);
}

}  // namespace sdma
