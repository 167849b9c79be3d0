// Memory a failed call may still be written into or read from by a peer, for which no end can be seen: never given
// back (docs/design.md, "Failures"). Bounded: a group that fails runs no further calls, so each failure adds at most
// the calls it had posted and the memory of that one group. torch_sdma.stats() shows the total.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace sdma {

// Tensors whose addresses a rank posted to its peers for a call it then refused: a peer that read the post may copy
// into and out of them once this rank's failure released its waits.
void keepTensorsForLife(std::vector<at::Tensor> tensors);
// A destroyed group's memory that lanes or peers may still reach (`bytes` of it), with whatever owns it.
void keepForLife(std::shared_ptr<void> owner, size_t bytes);

struct KeptForLife {
  size_t bytes = 0;
  size_t items = 0;
};
KeptForLife keptForLife();

}  // namespace sdma
