// What every form of all-gather reduces to before a schedule runs it: byte streams, one per rank.
#pragma once

#include <cstddef>
#include <vector>

namespace sdma {

struct ByteSpan {
  char* ptr = nullptr;
  size_t bytes = 0;
};

// Each rank contributes a byte stream of `bytesPerRank` bytes, scattered over `input`; rank q's stream lands in
// this rank's `outputByRank[q]`.
struct AllgatherPlan {
  size_t bytesPerRank = 0;
  std::vector<ByteSpan> input;
  std::vector<std::vector<ByteSpan>> outputByRank;
  // all_gather_into_tensor only (the same form on every rank, so every rank makes the same choice): the one
  // output tensor, rank q's bytes at outputBase + q * bytesPerRank. The direct path needs it.
  char* outputBase = nullptr;
};

}  // namespace sdma
