// The Work of a send or recv between a rank and itself (backend/self_exchange.hpp). Both works of a pair share one
// Match: done once the second of the pair was posted and its copy enqueued; on a GPU, an event after that copy.
#pragma once

#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sdma {

struct SelfMatch {
  bool matched = false;
  bool abandoned = false;            // waited on unmatched: the caller got an error, so no later send may pair with it
  bool held = false;                 // posted inside a batch that has not ended (backend/self_exchange.hpp)
  std::string dropped;               // why its batch dropped it before matching, or ""
  std::optional<c10::Event> copied;  // GPU tensors: recorded after the copy on the stream that ran it
};

class SelfP2PWork : public c10d::Work {
 public:
  SelfP2PWork(int rank, c10d::OpType opType, std::vector<at::Tensor> tensors, std::shared_ptr<SelfMatch> match,
              std::string description);

  bool isCompleted() override;
  bool isSuccess() const override {
    return true;
  }
  // Makes the caller's current stream wait for the copy (never the CPU); refuses, instead of hanging as NCCL
  // would, when the other half of the pair was never posted.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override {
    return tensors_;
  }

 private:
  const std::vector<at::Tensor> tensors_;
  const std::shared_ptr<SelfMatch> match_;
  const std::string description_;
};

}  // namespace sdma
