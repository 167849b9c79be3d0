// Walking span lists: the schedules move chunks that may start and end anywhere inside the tensors of a form.
#pragma once

#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/transport.hpp"

namespace sdma {

// Walks a span list front to back, handing out consecutive byte ranges as lists of contiguous pieces.
class SpanCursor {
 public:
  explicit SpanCursor(const std::vector<ByteSpan>& spans) : spans_(&spans) {}

  std::vector<ByteSpan> take(size_t bytes);

 private:
  const std::vector<ByteSpan>* spans_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

// One cursor per rank's output spans, each starting at its first byte.
std::vector<SpanCursor> cursorsOver(const std::vector<std::vector<ByteSpan>>& spansByRank);

// The contiguous pieces of bytes [offset, offset + bytes) of a region laid out as `region`.
std::vector<ByteSpan> piecesOf(const std::vector<ByteSpan>& region, uint64_t offset, uint64_t bytes);

// Whether any byte of `a` is also a byte of `b`.
bool spansOverlap(const std::vector<ByteSpan>& a, const std::vector<ByteSpan>& b);

// Copies src pieces into dst pieces of the same total length on `lane`, skipping ranges that already alias
// (in place).
void copyPieces(Transport& t, Lane lane, const std::vector<ByteSpan>& dst, const std::vector<ByteSpan>& src);

}  // namespace sdma
