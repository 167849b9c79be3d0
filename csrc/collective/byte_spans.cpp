#include "collective/byte_spans.hpp"

#include <algorithm>

namespace sdma {

std::vector<ByteSpan> SpanCursor::take(size_t bytes) {
  std::vector<ByteSpan> pieces;
  while (bytes > 0) {
    const ByteSpan& s = (*spans_)[index_];
    const size_t n = std::min(bytes, s.bytes - offset_);
    if (n > 0) {
      pieces.push_back({s.ptr + offset_, n});
    }
    offset_ += n;
    bytes -= n;
    if (offset_ == s.bytes) {
      ++index_;
      offset_ = 0;
    }
  }
  return pieces;
}

void copyPieces(Transport& t, Lane lane, const std::vector<ByteSpan>& dst, const std::vector<ByteSpan>& src) {
  size_t di = 0, si = 0, doff = 0, soff = 0;
  while (di < dst.size() && si < src.size()) {
    const size_t n = std::min(dst[di].bytes - doff, src[si].bytes - soff);
    char* d = dst[di].ptr + doff;
    const char* s = src[si].ptr + soff;
    if (n > 0 && d != s) {
      t.copyLocal(lane, d, s, n);
    }
    doff += n;
    soff += n;
    if (doff == dst[di].bytes) {
      ++di;
      doff = 0;
    }
    if (soff == src[si].bytes) {
      ++si;
      soff = 0;
    }
  }
}

std::vector<SpanCursor> cursorsOver(const std::vector<std::vector<ByteSpan>>& spansByRank) {
  std::vector<SpanCursor> cursors;
  cursors.reserve(spansByRank.size());
  for (const auto& spans : spansByRank) {
    cursors.emplace_back(spans);
  }
  return cursors;
}

}  // namespace sdma
