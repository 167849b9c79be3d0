#include "backend/self_exchange.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <string>

#include "collective/allgather_inputs.hpp"

namespace sdma {

c10::intrusive_ptr<c10d::Work> SelfExchange::send(const std::vector<at::Tensor>& tensors, int tag) {
  return post(c10d::OpType::SEND, tensors, tag);
}

c10::intrusive_ptr<c10d::Work> SelfExchange::recv(const std::vector<at::Tensor>& tensors, int tag) {
  return post(c10d::OpType::RECV, tensors, tag);
}

c10::intrusive_ptr<c10d::Work> SelfExchange::post(c10d::OpType opType, const std::vector<at::Tensor>& tensors,
                                                  int tag) {
  checkOneInput(tensors);
  const at::Tensor& t = tensors.front();
  TORCH_CHECK_WITH(ValueError, t.is_contiguous(t.suggest_memory_format()), "Tensors must be contiguous");
  const bool isSend = opType == c10d::OpType::SEND;
  auto match = std::make_shared<SelfMatch>();
  if (holding_) {
    match->held = true;
    held_.push_back({isSend, t, tag, match});
  } else {
    matchOrQueue(isSend, t, tag, match);
  }
  const std::string what = std::string(isSend ? "send to" : "recv from") + " rank " + std::to_string(rank_) +
                           " (this rank itself), tag " + std::to_string(tag);
  return c10::make_intrusive<SelfP2PWork>(rank_, opType, tensors, std::move(match), what);
}

void SelfExchange::matchOrQueue(bool isSend, const at::Tensor& t, int tag, const std::shared_ptr<SelfMatch>& match) {
  auto& mine = isSend ? sends_[tag] : recvs_[tag];
  auto& theirs = isSend ? recvs_[tag] : sends_[tag];
  while (!theirs.empty() && theirs.front().match->abandoned) {
    theirs.pop_front();
  }
  if (!theirs.empty()) {
    Posted other = std::move(theirs.front());
    theirs.pop_front();
    if (isSend) {
      copy(t, other.tensor, *other.match);  // into the waiting recv
      markCopied(t.device(), *match);
    } else {
      if (other.match->copied) {  // the kept copy was made on the sender's stream
        c10::impl::VirtualGuardImpl impl(t.device().type());
        other.match->copied->block(impl.getStream(t.device()));
      }
      copy(other.tensor, t, *match);  // from the send's kept copy
    }
  } else if (isSend) {
    // Keep the bytes as they are now (the caller may reuse the tensor once this send is done).
    at::Tensor kept = at::empty_like(t);
    copy(t, kept, *match);
    mine.push_back({kept, match});
  } else {
    mine.push_back({t, match});
  }
}

void SelfExchange::beginBatch() {
  dropBatch("the batch it was posted in failed before it ended");
  holding_ = true;
}

void SelfExchange::commitBatch() {
  holding_ = false;
  std::vector<Held> batch;
  batch.swap(held_);
  for (auto& h : batch) {
    h.match->held = false;
    matchOrQueue(h.isSend, h.tensor, h.tag, h.match);
  }
}

void SelfExchange::dropBatch(const std::string& why) {
  holding_ = false;
  for (auto& h : held_) {
    h.match->held = false;
    h.match->abandoned = true;
    h.match->dropped = why;
  }
  held_.clear();
}

void SelfExchange::copy(const at::Tensor& from, const at::Tensor& to, SelfMatch& match) {
  const int64_t sent = from.numel() * from.element_size();
  const int64_t room = to.numel() * to.element_size();
  TORCH_CHECK_WITH(ValueError, sent == room, "torch_sdma: a send to this rank itself carries ", sent,
                   " bytes, but the recv it matches takes ", room);
  TORCH_CHECK_WITH(ValueError, from.device() == to.device(), "torch_sdma: a send to this rank itself is on ",
                   from.device(), ", the recv it matches on ", to.device());
  byteView(to).copy_(byteView(from));
  markCopied(to.device(), match);
}

void SelfExchange::markCopied(const c10::Device& device, SelfMatch& match) {
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    match.copied.emplace(device.type());
    match.copied->record(impl.getStream(device));
  }
  match.matched = true;
}

}  // namespace sdma
