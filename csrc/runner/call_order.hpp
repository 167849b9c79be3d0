// A group's collectives take effect on the GPU in call order, whatever stream each runs on, as NCCL orders a
// communicator's operations. A synchronous all-gather runs its Drain lane on the caller's current stream and an
// async one on the group's own, so two consecutive collectives of a group may have their Drain lanes on different
// streams; then the later one's Drain lane first waits for the earlier one's end. Every flag a schedule writes is
// written on the Drain lane, or (staging's Ready) only after a wait on a flag the Drain lane wrote, so flag words
// only ever grow, and a wait for serial s is satisfied by call s itself (docs/design.md, "Ordering across streams").
//
// Kept apart from the runner, templated on what a stream is, so that the schedule simulation
// (tests/cpp/schedule_simulation.cpp) runs the same rule over its own queues.
#pragma once

namespace sdma {

template <typename Stream>
class CallOrder {
 public:
  // Whether a collective whose Drain lane runs on `drain` must first wait for the previous collective's end.
  bool mustWaitForPrevious(Stream drain) const {
    return any_ && drain != lastDrain_;
  }
  // The collective just enqueued ended on `drain` (all its lanes joined there).
  void ended(Stream drain) {
    lastDrain_ = drain;
    any_ = true;
  }

 private:
  Stream lastDrain_{};
  bool any_ = false;
};

}  // namespace sdma
