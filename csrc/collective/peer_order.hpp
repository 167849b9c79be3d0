// The order a rank visits its peers in: its next neighbour first, q = (me + k) % size for k = 1 .. size - 1. With
// every rank starting one further on, the k-th copies of all ranks go to k different destinations at once; in one
// order for all (peer 0 first), every rank would write into one GPU while the others' links idle.
#pragma once

namespace sdma {

// The peer `k` places after `me` (1 <= k < size).
inline int peerAtDistance(int me, int k, int size) {
  return (me + k) % size;
}

// Calls visit(q) for every peer q of `me`, nearest first.
template <class Visit>
void forEachPeerFrom(int me, int size, Visit&& visit) {
  for (int k = 1; k < size; ++k) {
    visit(peerAtDistance(me, k, size));
  }
}

}  // namespace sdma
