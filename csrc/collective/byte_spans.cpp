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

std::vector<ByteSpan> piecesOf(const std::vector<ByteSpan>& region, uint64_t offset, uint64_t bytes) {
  std::vector<ByteSpan> out;
  for (const ByteSpan& s : region) {
    if (bytes == 0) {
      break;
    }
    if (offset >= s.bytes) {
      offset -= s.bytes;
      continue;
    }
    const uint64_t n = std::min<uint64_t>(bytes, s.bytes - offset);
    out.push_back({s.ptr + offset, n});
    offset = 0;
    bytes -= n;
  }
  return out;
}

bool spansOverlap(const std::vector<ByteSpan>& a, const std::vector<ByteSpan>& b) {
  for (const ByteSpan& x : a) {
    for (const ByteSpan& y : b) {
      if (x.bytes > 0 && y.bytes > 0 && x.ptr < y.ptr + y.bytes && y.ptr < x.ptr + x.bytes) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace sdma
