#include "work/self_p2p_work.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace sdma {

SelfP2PWork::SelfP2PWork(int rank, c10d::OpType opType, std::vector<at::Tensor> tensors,
                         std::shared_ptr<SelfMatch> match, std::string description)
    : Work(rank, opType),
      tensors_(std::move(tensors)),
      match_(std::move(match)),
      description_(std::move(description)) {}

bool SelfP2PWork::isCompleted() {
  return match_->matched && (!match_->copied || match_->copied->query());
}

void SelfP2PWork::synchronize() {
  TORCH_CHECK(match_->dropped.empty(), "torch_sdma: ", description_, " never ran: ", match_->dropped);
  TORCH_CHECK(!match_->held, "torch_sdma: ", description_,
              " was posted inside a batch (batch_isend_irecv, _coalescing_manager) that has not ended; a batch that "
              "raised leaves its group inside it, as with NCCL, until the next batch starts");
  if (!match_->matched) {
    match_->abandoned = true;
  }
  TORCH_CHECK(match_->matched, "torch_sdma: ", description_,
              " was waited on before its other half was posted: post the send and the recv to this rank itself "
              "first, then wait (batch_isend_irecv does), as NCCL would otherwise hang");
  if (match_->copied) {
    const c10::Device device = tensors_.front().device();
    c10::impl::VirtualGuardImpl impl(device.type());
    match_->copied->block(impl.getStream(device));
  }
}

bool SelfP2PWork::wait(std::chrono::milliseconds) {
  synchronize();
  return true;
}

}  // namespace sdma
