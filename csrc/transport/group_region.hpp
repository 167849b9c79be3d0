// Host memory every member of a group maps together (host_shared_memory.hpp), owned: mapped by the constructor,
// which every member calls together, and unmapped when the object goes. The direct path's mailbox and
// retired-allocation log, the call board and the fault board each live in one.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/util/Exception.h>

#include <cstddef>
#include <string>
#include <utility>

#include "transport/host_shared_memory.hpp"

namespace sdma {

class GroupRegion {
 public:
  GroupRegion() = default;
  // Collective: `bytes` of zeroed memory, the same on every member. Throws, naming `what`, on every member where
  // some member could not map it.
  GroupRegion(c10d::Store& store, const std::string& key, int rank, int size, size_t bytes, const std::string& what)
      : bytes_(bytes) {
    std::string why;
    base_ = mapGroupRegion(store, key, rank, size, bytes, &why);
    TORCH_CHECK(base_, "torch_sdma: ", what, " could not be shared: ", why);
  }
  ~GroupRegion() {
    unmapSegment(base_, bytes_);
  }
  GroupRegion(GroupRegion&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  GroupRegion& operator=(GroupRegion&& other) noexcept {
    if (this != &other) {
      unmapSegment(base_, bytes_);
      base_ = std::exchange(other.base_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  GroupRegion(const GroupRegion&) = delete;
  GroupRegion& operator=(const GroupRegion&) = delete;

  char* data() const {
    return base_;
  }
  size_t bytes() const {
    return bytes_;
  }

 private:
  char* base_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace sdma
