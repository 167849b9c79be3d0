#include "collective/staging_allgather.hpp"

#include <algorithm>

#include "collective/byte_spans.hpp"

namespace sdma {

size_t chunkBytesFor(const AllgatherPlan& plan, const StagingGeometry& geometry) {
  return chunkBytesFor(plan.bytesPerRank, geometry);
}

size_t chunkBytesFor(size_t bytes, const StagingGeometry& geometry) {
  if (geometry.pipelineChunkBytes > 0) {  // TORCH_SDMA_CHUNK_BYTES
    return std::min(geometry.chunkBytes, geometry.pipelineChunkBytes);
  }
  // Above 8 MiB a rank a message is cut in two, so that the second chunk's push overlaps the first one's drain.
  // Measured on 2x H200 with 32 hardware queues (docs/results/2xH200.md, chunk sweep): 32 MiB of output took
  // 88.2 us in one chunk, 80.7 in two and 93.3 in four (NCCL 91.9); 64 MiB 130 in two, 142 in four and 174 in
  // eight (NCCL 159). At 8 MiB a rank two chunks gained nothing (57.1 against 56.7 us), and one chunk keeps a
  // synchronous call on the caller's stream alone, so smaller messages stay whole.
  constexpr size_t kCutAbove = size_t{8} << 20;
  if (bytes <= kCutAbove) {
    return geometry.chunkBytes;
  }
  const size_t half = roundUp((bytes + 1) / 2, kPageBytes);
  return std::min(geometry.chunkBytes, half);
}

size_t chunkCount(const AllgatherPlan& plan, const StagingGeometry& geometry) {
  return divCeil(plan.bytesPerRank, chunkBytesFor(plan, geometry));
}

void pushChunkToPeers(Transport& t, Lane lane, int slot, std::vector<ByteSpan> pieces, size_t len) {
  if (pieces.size() > 1 && t.geometry().hasPackSegment()) {
    // A coalesced chunk spans several tensors: pack it once locally, then push one contiguous copy per peer.
    char* packed = t.packSegment(slot);
    copyPieces(t, lane, {{packed, len}}, pieces);
    pieces = {{packed, len}};
  }
  size_t at = 0;
  for (const ByteSpan& piece : pieces) {
    t.pushChunkToPeers(lane, slot, piece.ptr, piece.bytes, at);
    at += piece.bytes;
  }
}

void drainChunkFromPeers(Transport& t, Lane lane, int slot, std::vector<SpanCursor>& outputs, size_t len) {
  for (int q = 0; q < t.geometry().worldSize; ++q) {
    std::vector<ByteSpan> dst = outputs[q].take(len);  // our own stream's range too, to keep the cursors aligned
    if (q != t.rank()) {
      copyPieces(t, lane, dst, {{t.localSegment(slot, q), len}});
    }
  }
}

void scheduleStagingAllgather(Transport& t, const AllgatherPlan& plan, uint64_t& chunkCount) {
  const StagingGeometry& g = t.geometry();
  const int me = t.rank();
  const uint32_t slots = static_cast<uint32_t>(g.slots);
  const size_t chunkBytes = chunkBytesFor(plan, g);

  // With one chunk everything runs on one stream, so the own-slot copy costs the same wherever it sits; at the
  // end it lets the Ready signal and the Ready wait share one flag batch (one driver call fewer) and hands the
  // staging slot back to the peers sooner. With several chunks it runs on the drain lane while the first chunk
  // travels.
  const bool ownSlotLast = plan.bytesPerRank <= chunkBytes;
  SpanCursor input(plan.input);
  std::vector<SpanCursor> outputs = cursorsOver(plan.outputByRank);

  for (size_t offset = 0; offset < plan.bytesPerRank; offset += chunkBytes) {
    const size_t len = std::min(chunkBytes, plan.bytesPerRank - offset);
    const uint64_t count = ++chunkCount;
    const uint32_t serial = static_cast<uint32_t>(count);
    const int slot = static_cast<int>(serial & (slots - 1));

    // Push: wait until every peer drained this slot's previous chunk, send, then announce.
    if (count > slots) {
      t.waitPeers(Lane::Push, Flag::Credit, slot, serial - slots);
    }
    pushChunkToPeers(t, Lane::Push, slot, input.take(len), len);
    t.signalPeers(Lane::Push, Flag::Ready, slot, serial);

    if (offset == 0 && !ownSlotLast) {
      // Own contribution, while the first chunk travels: a local copy, or nothing when the input already is
      // the output's own slot (FSDP2, ZeRO-3).
      copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);
    }

    // Drain: wait for every peer's chunk, move it to the output, hand the slot back.
    t.waitPeers(Lane::Drain, Flag::Ready, slot, serial);
    drainChunkFromPeers(t, Lane::Drain, slot, outputs, len);
    t.signalPeers(Lane::Drain, Flag::Credit, slot, serial);
  }
  if (ownSlotLast) {
    copyPieces(t, Lane::Drain, plan.outputByRank[me], plan.input);
  }
}

}  // namespace sdma
