// The all-gather through staging for a CUDA graph: the same pushes and drains as staging_allgather, but a graph
// replays the flag values it was captured with, so they cannot be serials. Every flag is 1 while it means
// something and goes back to 0 once its waiter has seen it, so each replay starts from the state the last one left
// (all zero), the way NCCL's copy-engine collectives survive capture.
#pragma once

#include "collective/allgather_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Enqueues the collective on `transport`, whose staging and flags no other schedule uses (a graph may be replayed
// while eager collectives of the same group are in flight).
void scheduleCapturedAllgather(Transport& transport, const AllgatherPlan& plan);

}  // namespace sdma
