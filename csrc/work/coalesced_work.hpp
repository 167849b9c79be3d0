// What endCoalescing returns when a coalescing block issued several works of its own: done when all are.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <vector>

namespace sdma {

class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> parts)
      : Work(-1, c10d::OpType::COALESCED), parts_(std::move(parts)) {}
  bool isCompleted() override {
    return std::all_of(parts_.begin(), parts_.end(), [](auto& w) { return w->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(parts_.begin(), parts_.end(), [](auto& w) { return w->isSuccess(); });
  }
  std::exception_ptr exception() const override {
    for (auto& w : parts_) {
      if (auto e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }
  void synchronize() override {
    for (auto& w : parts_) {
      w->synchronize();
    }
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : parts_) {
      w->wait(timeout);
    }
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return parts_.back()->getFuture();
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

}  // namespace sdma
