// Device memory of this process that peers map by file descriptor (VMM memory exported as a POSIX descriptor): the
// communication buffer pool's segments and the direct path's bounce areas, under one id space (a peer's mappings
// are keyed by id, so no two of them may share one). The direct path's exporter looks a buffer up here before it falls
// back to legacy IPC, which cannot export this memory.
#pragma once

#include <cstddef>

#include "gpu/gpu_api.hpp"
#include "transport/arrival_mailbox.hpp"

namespace sdma {

// Process-wide, thread-safe.
void rememberShareable(const gpu::SharedAllocation& allocation);
// False when `ptr` is not the start of a remembered allocation.
bool forgetShareable(const void* ptr, gpu::SharedAllocation* allocation);
// True, with how a peer maps it, when [ptr, ptr + bytes) lies in a remembered allocation.
bool findShareable(const void* ptr, size_t bytes, ExportedSegment* out);

}  // namespace sdma
