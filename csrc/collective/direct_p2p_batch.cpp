#include "collective/direct_p2p_batch.hpp"

#include <algorithm>

namespace sdma {

void scheduleDirectP2pBatch(const std::vector<DirectPairStep>& steps, const P2pStepStart& onStep, P2pPeerLanes* lanes) {
  const auto start = [&](size_t i, P2pPhase phase) {
    if (onStep) {
      onStep(i, phase);
    }
  };
  // The peers in the order their steps come; each gets its lanes at its first copy.
  std::vector<const Transport*> peers;
  // Every step's buffers are open to its peer before this rank waits on anything of the batch.
  for (size_t i = 0; i < steps.size(); ++i) {
    start(i, P2pPhase::kArrive);
    const DirectPairStep& s = steps[i];
    if (s.posted.input != s.plan.input && s.plan.inputBytes > 0) {
      // A send the peer cannot map went to a bounce area of this rank's: whole before the peer may read it.
      s.transport->copyLocal(Lane::Drain, const_cast<char*>(s.posted.input), s.plan.input, s.plan.inputBytes);
      s.transport->direct()->joinLane(Lane::Push, Lane::Drain);
    }
    s.transport->direct()->signalPeer(Lane::Drain, 1 - s.transport->rank(), Flag::Arrived, 0, s.serial);
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const DirectPairStep& s = steps[i];
    if (std::find(peers.begin(), peers.end(), s.transport) == peers.end()) {
      peers.push_back(s.transport);
      if (lanes) {
        lanes->fork(peers.size() - 1, i);
      }
    }
    start(i, P2pPhase::kCopy);
    DirectTransport& d = *s.transport->direct();
    const int q = 1 - s.transport->rank();
    if (s.peer.buffers.pairing != Pairing::kPeerCameLate) {
      const ByteRange& to = s.plan.sendTo[q];
      if (to.bytes > 0) {
        d.waitPeer(Lane::Push, q, Flag::Arrived, 0, s.serial);
        d.copyToPeer(Lane::Push, q, s.peer.buffers.outputBase + s.peer.ranges.expects.offset,
                     s.posted.input + to.offset, to.bytes);
      }
      const ByteRange& from = s.plan.recvFrom[q];
      if (s.peer.buffers.pairing == Pairing::kThisCameLate && from.bytes > 0) {
        d.waitPeer(Lane::Drain, q, Flag::Arrived, 0, s.serial);
        d.copyFromPeer(Lane::Drain, q, s.posted.outputBase + from.offset,
                       s.peer.buffers.input + s.peer.ranges.sends.offset, from.bytes);
      }
    }
    d.joinLane(Lane::Drain, Lane::Push);
    d.signalPeer(Lane::Drain, q, Flag::Done, 0, s.serial);
  }
  // Complete only once every peer is done with this rank's buffers: a peer may still read a send or write a recv.
  for (size_t i = 0; i < steps.size(); ++i) {
    start(i, P2pPhase::kFinish);
    const DirectPairStep& s = steps[i];
    s.transport->direct()->waitPeer(Lane::Drain, 1 - s.transport->rank(), Flag::Done, 0, s.serial);
    if (s.posted.outputBase != s.plan.output && s.plan.outputBytes > 0) {
      s.transport->copyLocal(Lane::Drain, s.plan.output, s.posted.outputBase, s.plan.outputBytes);
    }
  }
  if (lanes && !peers.empty()) {
    lanes->join();
  }
}

}  // namespace sdma
