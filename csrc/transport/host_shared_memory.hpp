// Host memory that the members of a group on one host map together: POSIX shared memory under a random name that
// lives only until every member has mapped it.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstddef>
#include <string>

namespace sdma {

// "/torch_sdma.<32 hex digits>".
std::string randomSegmentName();

// Maps `name`, creating it (exclusively, 0600, with its memory reserved so a full /dev/shm fails here rather
// than with SIGBUS later) when `create`. Returns null with *error set on failure.
char* mapSegment(const std::string& name, size_t bytes, bool create, std::string* error);

// Collective: `bytes` of zeroed memory created by group rank 0 and mapped by every member, or null on every member
// with the reason in *whyNot. Unmap with unmapSegment.
char* mapGroupRegion(c10d::Store& store, const std::string& key, int rank, int size, size_t bytes, std::string* whyNot);
void unmapSegment(char* base, size_t bytes);

}  // namespace sdma
