// A group's collectives take effect in call order whichever thread runs them. Each gets a ticket when it is issued
// and starts only once every earlier ticket has finished. The worker runs its queue in order by itself; the tickets
// order it against a caller that runs a synchronous collective on its own thread (TORCH_SDMA_TEST_SYNC_ON_CALLER):
// the caller first waits for the group's earlier work on the worker, as a GPU caller's stream must wait for the
// group's internal stream, and the worker starts nothing later until the caller's collective has finished.
// Otherwise both would move the same flag words and staging slots at once: values rolled back, waits that hang or
// end early. Guarded by the runner's mutex.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "runner/group_failure.hpp"

namespace sdma {

class CallTickets {
 public:
  // `enforced` false (TORCH_SDMA_TEST_UNORDERED): tickets are handed out but nobody waits for their turn.
  explicit CallTickets(bool enforced) : enforced_(enforced) {}

  uint64_t issue() {
    return issued_++;
  }
  // Blocks, releasing `lock`, until every ticket before `ticket` has finished, or the group failed: the collective
  // is then not run (GroupFailure), and order no longer matters.
  void awaitTurn(std::unique_lock<std::mutex>& lock, uint64_t ticket, const GroupFailure& failure) {
    if (enforced_ && finished_ < ticket && !failure.happened()) {
      turn_.wait(lock, [&] { return finished_ >= ticket || failure.happened(); });
    }
  }
  void finish(uint64_t ticket) {
    finished_ = std::max(finished_, ticket + 1);
    turn_.notify_all();
  }
  // The group failed without finishing its tickets (its worker died): whoever waits for a turn sees that.
  void wakeAll() {
    turn_.notify_all();
  }

 private:
  const bool enforced_;
  uint64_t issued_ = 0;
  uint64_t finished_ = 0;  // every ticket below it has finished (in order, while enforced)
  std::condition_variable turn_;
};

}  // namespace sdma
