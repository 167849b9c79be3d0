// Point-to-point between a rank and itself: send/recv/isend/irecv to one's own rank, alone or inside
// batch_isend_irecv. Matched here, in posting order per tag as NCCL matches them inside a group, the bytes copied on
// the caller's current stream. A send that finds no recv waiting keeps a copy of its tensor and is done at once, so a
// blocking send to oneself returns (NCCL's would wait for a recv the same thread cannot post); a recv that finds no
// send waits for one, and waiting on it first is an error, never a hang. The inner backends are never asked: gloo has
// no send to self.
//
// Inside a batch (a coalescing block) the posts are held and matched when the batch ends, as NCCL matches a group's
// operations at ncclGroupEnd: a batch that fails before its end (an invalid peer, an inner backend that refuses)
// leaves nothing behind for a later recv to meet.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "work/self_p2p_work.hpp"

namespace sdma {

class SelfExchange {
 public:
  explicit SelfExchange(int rank) : rank_(rank) {}

  c10::intrusive_ptr<c10d::Work> send(const std::vector<at::Tensor>& tensors, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const std::vector<at::Tensor>& tensors, int tag);

  // A batch starts: posts are held until commitBatch(). Posts still held from a batch that never ended are dropped.
  void beginBatch();
  // The batch ended and its other operations were accepted: the held posts are matched, in posting order.
  void commitBatch();
  // The batch failed at its end: the held posts are dropped, and waiting on one says why.
  void dropBatch(const std::string& why);

 private:
  struct Posted {
    at::Tensor tensor;
    std::shared_ptr<SelfMatch> match;
  };
  struct Held {
    bool isSend;
    at::Tensor tensor;
    int tag;
    std::shared_ptr<SelfMatch> match;
  };
  c10::intrusive_ptr<c10d::Work> post(c10d::OpType opType, const std::vector<at::Tensor>& tensors, int tag);
  // Pairs `t` with the oldest waiting post of the other kind under `tag`, or queues it; `match` is its Work's.
  void matchOrQueue(bool isSend, const at::Tensor& t, int tag, const std::shared_ptr<SelfMatch>& match);
  static void copy(const at::Tensor& from, const at::Tensor& to, SelfMatch& match);
  // The copy that completes `match` was enqueued on `device`'s current stream (or done, on the CPU).
  static void markCopied(const c10::Device& device, SelfMatch& match);

  const int rank_;
  std::map<int, std::deque<Posted>> sends_;  // by tag, oldest first
  std::map<int, std::deque<Posted>> recvs_;
  bool holding_ = false;
  std::vector<Held> held_;  // posts of the current batch, in posting order
};

}  // namespace sdma
