// Point-to-point between a rank and itself: send/recv/isend/irecv to one's own rank, alone or inside
// batch_isend_irecv. Matched here, in posting order per tag as NCCL matches them inside a group, the bytes copied on
// the caller's current stream. A send that finds no recv waiting keeps a copy of its tensor and is done at once, so a
// blocking send to oneself returns (NCCL's would wait for a recv the same thread cannot post); a recv that finds no
// send waits for one, and waiting on it first is an error, never a hang. The inner backends are never asked: gloo has
// no send to self.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <deque>
#include <map>
#include <memory>

#include "work/self_p2p_work.hpp"

namespace sdma {

class SelfExchange {
 public:
  explicit SelfExchange(int rank) : rank_(rank) {}

  c10::intrusive_ptr<c10d::Work> send(const std::vector<at::Tensor>& tensors, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const std::vector<at::Tensor>& tensors, int tag);

 private:
  struct Posted {
    at::Tensor tensor;
    std::shared_ptr<SelfMatch> match;
  };
  c10::intrusive_ptr<c10d::Work> post(c10d::OpType opType, const std::vector<at::Tensor>& tensors, int tag);
  static void copy(const at::Tensor& from, const at::Tensor& to, SelfMatch& match);

  const int rank_;
  std::map<int, std::deque<Posted>> sends_;  // by tag, oldest first
  std::map<int, std::deque<Posted>> recvs_;
};

}  // namespace sdma
