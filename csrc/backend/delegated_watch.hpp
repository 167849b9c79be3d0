// Collectives handed to the inner backend (NCCL, gloo), watched on the group's call board until every peer went past
// them: where a peer posted another call for the same sequence number and this rank did not see it when it posted
// (call_board.hpp), the inner backend would wait for that peer until its own timeout, in its own words. The watcher
// fails the call instead, within milliseconds, in the board's words, and the backend aborts the inner communicator so
// that no stream stays stuck in it.
//
// The inner backend's Work is handed to the caller inside a DelegatedWork, which answers as the inner one does
// (isCompleted, wait, getFuture, result, synchronize, ...) until the watcher fails it: then its wait() throws the
// board's words at once, also where the inner wait would block the CPU (gloo), and isCompleted() says true.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>

#include "runner/guarded_thread.hpp"
#include "transport/call_board.hpp"

namespace sdma {

class DelegatedWork : public c10d::Work {
 public:
  // `blocksCpu`: the inner wait() blocks the calling thread until the collective ends (gloo), rather than ordering
  // the caller's stream after it (NCCL). `board`, `seq`, `post`: where the call was posted, read once more when the
  // inner wait throws (a peer that refused the call and exited may be gone before the watcher looked).
  DelegatedWork(c10::intrusive_ptr<c10d::Work> inner, bool blocksCpu, const CallBoard& board, uint64_t seq,
                const CallPost& post, int groupSize);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override {
    return inner_->sourceRank();
  }
  std::vector<at::Tensor> result() override {
    return inner_->result();
  }
  void synchronize() override {
    inner_->synchronize();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void blockCurrentStream() override {
    inner_->blockCurrentStream();
  }
  void abort() override {
    inner_->abort();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFutureResult() override {
    return inner_->getFutureResult();
  }
  float getDuration() const override {
    return inner_->getDuration();
  }
  uint64_t getSequencenumber() const override {
    return inner_->getSequencenumber();
  }

  // From the watcher: the call differs across ranks; wait() and the future raise `error` from now on.
  void fail(std::exception_ptr error);

 private:
  std::exception_ptr failure() const;
  void innerFinished();
  // The board's words where a peer posted another call for seq_, else null.
  std::exception_ptr boardSaysDiffering() const;

  const c10::intrusive_ptr<c10d::Work> inner_;
  const bool blocksCpu_;
  const CallBoard& board_;
  const uint64_t seq_;
  const CallPost post_;
  const int groupSize_;
  mutable std::mutex m_;
  std::condition_variable released_;
  std::exception_ptr failure_;
  bool innerDone_ = false;
  bool armed_ = false;                                   // a callback on the inner future tells when it is done
  c10::intrusive_ptr<c10::ivalue::Future> innerFuture_;  // the one armed, set before armed_ is seen
  c10::intrusive_ptr<c10::ivalue::Future> future_;       // blocksCpu_: ours, completed by the inner one or failed by us
};

class DelegatedWatch {
 public:
  struct Call {
    uint64_t seq = 0;
    CallPost post;
    c10::intrusive_ptr<DelegatedWork> work;  // null where the inner backend returned none (a synchronous NCCL call)
    // The inner backend that runs the call, aborted where it differs. Not read from the post's route: a call posted
    // for the copy engines goes to the inner backend where the runner's path says so after connecting (an exchange
    // with TORCH_SDMA_DIRECT=0).
    c10::intrusive_ptr<c10d::Backend> inner;
    std::chrono::steady_clock::time_point deadline;
  };
  // Called on the watcher's thread when `call` differs across ranks, with the board's words.
  using OnDiffering = std::function<void(const Call& call, const std::string& words)>;

  DelegatedWatch(const CallBoard& board, OnDiffering onDiffering);
  ~DelegatedWatch();

  // Watches `call` until every peer went past it, or its deadline passes (the inner backend's timeout speaks then).
  void watch(Call call);
  // Stops the watcher; calls still watched are let go.
  void stop();

 private:
  void loop();

  const CallBoard& board_;
  const OnDiffering onDiffering_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Call> calls_;
  bool asleep_ = false;  // waiting without a deadline: a new call must wake it
  bool stop_ = false;
  GuardedThread thread_;
};

}  // namespace sdma
