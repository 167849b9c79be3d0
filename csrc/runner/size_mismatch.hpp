// Two ranks passed different sizes to the same all-gather on the GPU (the direct path's mailbox or staging's size
// board showed it): the rank that reads the other's post throws this before it enqueues anything; the other one's
// watchdog finds the same post and fails the collective.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace sdma {

struct SizeMismatch : std::runtime_error {
  // Group ranks, so that a node's ranks (hierarchical) are named as the user knows them.
  SizeMismatch(int peer, uint64_t peerBytes, uint64_t ownBytes)
      : std::runtime_error("sizes differ between ranks"), peer(peer), peerBytes(peerBytes), ownBytes(ownBytes) {}
  // In the words of the other paths' size checks (docs/errors.md), both sizes in group-rank order.
  std::string describe(int rank) const {
    const bool peerFirst = peer < rank;
    const auto entry = [](int r, uint64_t bytes) {
      return "group rank " + std::to_string(r) + " " + std::to_string(bytes) + " bytes";
    };
    return "the ranks passed inputs of different sizes (bytes per rank: " +
           (peerFirst ? entry(peer, peerBytes) + ", " + entry(rank, ownBytes)
                      : entry(rank, ownBytes) + ", " + entry(peer, peerBytes)) +
           "); every rank must pass the same size";
  }
  int peer;
  uint64_t peerBytes;
  uint64_t ownBytes;
};

// An exchange's pair disagrees (collective/exchange_plan.hpp): what one rank sends the other is not what the other
// expects from it. Found, like SizeMismatch, by the rank that reads the other's post, before it enqueues anything.
struct RangeMismatch : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A point-to-point op that one rank refused on its own arguments takes its pair's serial all the same (P2pRunner::
// refuse): its post carries this bit and the directions the op would have moved in the bytes word, no buffers. The
// peer's op of that serial reads it and fails naming that rank, instead of meeting the rank's next op.
constexpr uint64_t kRefusedPost = uint64_t{1} << 63;
struct PeerRefusedPost : std::runtime_error {
  PeerRefusedPost(int peer, uint64_t serial, uint64_t directions)
      : std::runtime_error("the peer refused the operation"), peer(peer), serial(serial), directions(directions) {}
  int peer;  // the pair member that refused
  uint64_t serial;
  uint64_t directions;
};

// The words for a pair whose sizes differ, or "" where `theirs` (what group rank `peer` posted about its pair with
// `rank`) agrees with what `rank` sends it and expects from it.
inline std::string pairDisagreement(int rank, int peer, uint64_t sendBytes, uint64_t recvBytes, uint64_t peerSends,
                                    uint64_t peerExpects) {
  const auto pair = [](int from, uint64_t sends, int to, uint64_t expects) {
    return "group rank " + std::to_string(from) + " sends " + std::to_string(sends) + " bytes to group rank " +
           std::to_string(to) + ", which expects " + std::to_string(expects) + " bytes from it";
  };
  if (sendBytes != peerExpects) {
    return pair(rank, sendBytes, peer, peerExpects);
  }
  if (peerSends != recvBytes) {
    return pair(peer, peerSends, rank, recvBytes);
  }
  return "";
}

}  // namespace sdma
