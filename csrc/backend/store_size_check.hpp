// Where nothing passes between the ranks per call (staging on GPUs: the CPUs only enqueue copies), a rank cannot see
// that its peers passed another size. Under TORCH_DISTRIBUTED_DEBUG=DETAIL, as ProcessGroupNCCL checks collective
// fingerprints there, every member publishes its bytes per rank and dtype through the group's store before the
// call is enqueued and the call fails on every member unless all are equal: a store round trip per call, too slow
// to do always.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/core/ScalarType.h>

#include <cstddef>

#include "collective/collective_info.hpp"

namespace sdma {

// Collective over the group: throws a DistBackendError naming every member's size unless all members passed the
// same bytes per rank and dtype to the collective `info` describes.
void compareSizesThroughStore(c10d::Store& store, const CollectiveInfo& info, size_t bytesPerRank,
                              c10::ScalarType dtype);

}  // namespace sdma
