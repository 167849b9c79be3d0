// The Work a send or recv inside a batch (batch_isend_irecv, a coalescing block) returns: the batch runs as one at
// its end (docs/design.md, "Point-to-point"), so this one stands for the batch's Work once the batch ended, and
// waiting on it before then is an error, not a hang (the batch cannot start while its caller waits).
#pragma once

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <memory>
#include <string>

namespace sdma {

struct P2pBatchOutcome {
  c10::intrusive_ptr<c10d::Work> work;  // the batch's, once it was enqueued
  std::exception_ptr failed;            // why the batch was never enqueued, or null
};

class BatchedP2pWork : public c10d::Work {
 public:
  BatchedP2pWork(int rank, c10d::OpType opType, std::shared_ptr<P2pBatchOutcome> batch)
      : Work(rank, opType), batch_(std::move(batch)) {}

  bool isCompleted() override {
    return batch_->failed || (batch_->work && batch_->work->isCompleted());
  }
  bool isSuccess() const override {
    return !batch_->failed && (!batch_->work || batch_->work->isSuccess());
  }
  std::exception_ptr exception() const override {
    return batch_->failed ? batch_->failed : batch_->work ? batch_->work->exception() : nullptr;
  }
  void synchronize() override {
    ready().synchronize();
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    return ready().wait(timeout);
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return ready().getFuture();
  }

 private:
  c10d::Work& ready() {
    if (batch_->failed) {
      std::rethrow_exception(batch_->failed);
    }
    TORCH_CHECK(batch_->work,
                "torch_sdma: a send or recv inside a batch (batch_isend_irecv, a coalescing block) was "
                "waited on before the batch ended; wait on what the batch returns");
    return *batch_->work;
  }

  std::shared_ptr<P2pBatchOutcome> batch_;
};

}  // namespace sdma
