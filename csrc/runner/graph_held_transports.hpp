// The captured schedule's transport lives as long as a graph that may replay it: a replay in flight when its group is
// destroyed, or one launched after, finds its staging and flags still mapped rather than faulting the GPU context
// (docs/design.md, "Failures"). The runtime tells when the last graph that captured it is gone, on a thread of its
// own that may not call the GPU runtime; the transport is then freed later by a thread that may.
#pragma once

#include <memory>

#include "gpu/gpu_api.hpp"
#include "transport/copy_engine_transport.hpp"

namespace sdma {

// While `capturing` is being captured: the graph holds `transport` until it and its executable graphs are destroyed
// and their launches done. Where the runtime cannot attach it, the transport is kept for the life of the process.
void holdWhileGraphLives(gpu::Stream capturing, const std::shared_ptr<CopyEngineTransport>& transport);

// Frees the transports whose graphs are gone; from a thread that may call the GPU runtime. Cheap when none is.
void freeTransportsOfDestroyedGraphs();

}  // namespace sdma
