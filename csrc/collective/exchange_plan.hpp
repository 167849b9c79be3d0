// What every collective that moves each rank's bytes to chosen peers reduces to (all-to-all, broadcast, gather,
// scatter): per peer, a byte range of this rank's input region that goes to it, and a byte range of this rank's
// output region that it fills. A region is one tensor's bytes, or, for the list forms, a bounce area the schedule
// packs the pieces into before and unpacks after (or, on CPU ranks, the span of the pieces where they are).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "transport/arrival_mailbox.hpp"

namespace sdma {

struct ExchangePlan {
  // Per group rank q: what this rank sends q (of its input region) and what q sends this rank (into its output
  // region). The ranges with this rank itself are a local copy.
  std::vector<ByteRange> sendTo;
  std::vector<ByteRange> recvFrom;
  // The regions: the tensor's bytes where the form has one contiguous tensor (`input`, `output`), else null with the
  // pieces, in region order, that a bounce area stands in for.
  const char* input = nullptr;
  char* output = nullptr;
  uint64_t inputBytes = 0;
  uint64_t outputBytes = 0;
  std::vector<ByteSpan> inputPieces;
  std::vector<ByteSpan> outputPieces;
  // A broadcast relayed through the ranks (relayed_broadcast.hpp): its root, and the bytes of the chunks it moves in;
  // -1 where the plan moves every range in one hop.
  int relayRoot = -1;
  uint64_t relayChunkBytes = 0;
  // A gather whose root pulls (direct_exchange.hpp): the root, in every rank's plan; -1 where senders push.
  int pullingRoot = -1;

  bool inputPacked() const {
    return !input && inputBytes > 0;
  }
  bool outputPacked() const {
    return !output && outputBytes > 0;
  }
};

// A region as the pieces it is made of: the list form's tensors, or the tensor's bytes (a host runner's pieces posted
// in place are one region from their lowest address, their ranges rebased on it).
inline std::vector<ByteSpan> inputRegion(const ExchangePlan& p) {
  if (p.inputPacked()) {
    return p.inputPieces;
  }
  return {{const_cast<char*>(p.input), p.inputBytes}};
}

// Whether this rank pulls what peer q sends it, settled as `pairing` from this rank's side: where it came late to the
// pair (the peer enqueued nothing for it), and where it is a pulling root that knows the peer's buffers (the peer
// pushes only where the root did not wait for it).
inline bool pullsFrom(const ExchangePlan& p, int rank, int q, Pairing pairing) {
  return p.recvFrom[q].bytes > 0 &&
         (pairing == Pairing::kThisCameLate || (pairing == Pairing::kEachPushesOwn && p.pullingRoot == rank));
}

// Whether this rank pushes what it sends peer q, settled as `pairing` from this rank's side.
inline bool pushesTo(const ExchangePlan& p, int q, Pairing pairing) {
  return p.sendTo[q].bytes > 0 && pairing != Pairing::kPeerCameLate &&
         !(pairing == Pairing::kEachPushesOwn && p.pullingRoot == q);
}

inline std::vector<ByteSpan> outputRegion(const ExchangePlan& p) {
  if (p.outputPacked()) {
    return p.outputPieces;
  }
  return {{p.output, p.outputBytes}};
}

// Per peer, what this rank posts about their pair: the ranges it sends and expects.
inline std::vector<PairRanges> pairRangesOf(const ExchangePlan& plan) {
  std::vector<PairRanges> out(plan.sendTo.size());
  for (size_t q = 0; q < out.size(); ++q) {
    out[q] = {plan.sendTo[q], plan.recvFrom[q]};
  }
  return out;
}

}  // namespace sdma
