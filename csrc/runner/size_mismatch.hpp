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

}  // namespace sdma
