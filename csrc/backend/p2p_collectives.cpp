// Point-to-point (send, recv, batch_isend_irecv): the route, then the pair's steps on the device's P2pRunner or the
// inner backend (docs/design.md, "Point-to-point"). Both members of a pair take the same route: it depends only on
// the group's settings, agreed at creation, on the bytes both sides pass, and on what the device's runner decides
// for the pair alike on both members (the copy engines' connect, settled together; the host's setting that bars
// reading a peer's memory). A send or recv to oneself keeps its own path (self_exchange.hpp); recvAnysource goes to
// the inner backend where a send of its bytes would, and is refused where a send would take the DMA path.
#include <c10/util/Exception.h>

#include <algorithm>

#ifdef TORCH_SDMA_CUDA
#include <c10/cuda/CUDAStream.h>

#include "gpu/gpu_api.hpp"
#endif

#include "backend/process_group_sdma.hpp"
#include "runner/group_failure.hpp"
#include "work/coalesced_work.hpp"

namespace sdma {
namespace {

constexpr CollectiveNames kSend{"send", "send", "send"};
constexpr CollectiveNames kRecv{"recv", "recv", "recv"};
constexpr CollectiveNames kRecvAnysource{"recvAnysource", "recv_anysource", "recvAnySource"};
const std::vector<at::Tensor> kNoTensors;

int64_t bytesOf(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * t.element_size() : 0;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const TracedCollective traced{kSend, tensors, kNoTensors, kNoSplits, kNoSplits, nullptr, "->", getRank(), dstRank};
  refuseIfDestroyed("send");
  return pointToPoint(kSend, traced, tensors, dstRank, /*isSend=*/true, tag,
                      [&](c10d::Backend& b) { return b.send(tensors, dstRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const TracedCollective traced{kRecv, kNoTensors, tensors, kNoSplits, kNoSplits, nullptr, "<-", getRank(), srcRank};
  refuseIfDestroyed("recv");
  return pointToPoint(kRecv, traced, tensors, srcRank, /*isSend=*/false, tag,
                      [&](c10d::Backend& b) { return b.recv(tensors, srcRank, tag); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  refuseIfDestroyed("recvAnysource");
  TORCH_CHECK_VALUE(tensors.size() == 1, "torch_sdma: recv takes exactly one tensor, got ", tensors.size());
  // A send of these bytes takes the DMA path, where a recv names its peer (the pair's mailbox): it would never meet a
  // recv from any source on the inner backend, and both would wait out the group's timeout. Refused at once, as NCCL
  // refuses it; for CUDA tensors the inner backend (NCCL, RCCL) refuses it as well, so a named source is the only way.
  const CollectivePath route = p2pRoute(tensors[0]);
  TORCH_CHECK_NOT_IMPLEMENTED(
      !route.isDma(), "torch_sdma: recv without a source (recv_anysource) on group '", options_.groupName,
      "': a send of ", bytesOf(tensors[0]), " bytes takes the DMA path, which matches a recv with the rank it names; ",
      tensors[0].is_cuda() ? "pass src= (the inner NCCL refuses a recv without a source too)"
                           : "pass src=, or set TORCH_SDMA_DELEGATE=send,recv on every rank to hand both to the inner "
                             "backend (gloo), which receives from any source");
  return delegateP2p(kRecvAnysource, {kRecvAnysource, kNoTensors, tensors}, tensors,
                     [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); });
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::delegateP2p(const CollectiveNames& names,
                                                             const TracedCollective& traced,
                                                             const std::vector<at::Tensor>& tensors,
                                                             InnerCall&& innerCall) {
  auto& inner = innerFor(tensors, names.stats);
  recordPath(std::string("delegated:") + names.stats, bytesOf(tensors[0]));
  // Only the pair calls: nothing goes on the group's call board.
  return runTraced(traceGroup_, getGroupDesc(), ++p2pSeq_, traced, [&] {
    auto work = innerCall(*inner);
    // Inside a coalescing block NCCL collects its own works; gloo's run at once, so endCoalescing must return them.
    return inner == innerCuda_ ? work : trackCoalesced(work);
  });
}

CollectivePath ProcessGroupSDMA::p2pRoute(const at::Tensor& tensor) const {
  if (options_.disable) {
    return CollectivePath::inner("TORCH_SDMA_DISABLE=1");
  }
  if (delegatedByName("send") || delegatedByName("recv")) {
    return CollectivePath::inner("TORCH_SDMA_DELEGATE");
  }
  const bool cuda = tensor.is_cuda();
  // CPU tensors take the pair's shared memory at every size: gloo, their inner backend, ends the receiving process
  // (SIGABRT from its I/O thread) where a send's size differs from its recv's, which the pair's post check refuses.
  if (cuda && bytesOf(tensor) < std::max<int64_t>(0, options_.minBytesCuda)) {
    return CollectivePath::inner("below TORCH_SDMA_MIN_BYTES");
  }
  if (cuda) {
#ifdef TORCH_SDMA_CUDA
    if (gpu::streamCapturing(c10::cuda::getCurrentCUDAStream(tensor.device().index()).stream())) {
      // Through the pair's captured staging (docs/design.md, "Captured point-to-point"), which needs no direct path.
      if (spansNodes()) {
        return CollectivePath::inner("the group spans nodes");
      }
      const CollectivePath& atCreation = cudaPath_.atCreation;
      if (!atCreation.isDma()) {
        return atCreation.isInner() ? atCreation : CollectivePath::inner("the group does not serve the device");
      }
      return CollectivePath::dma(CollectivePath::kCaptured);
    }
#endif
    if (!options_.directCuda) {
      return CollectivePath::inner("the direct path is off (TORCH_SDMA_DIRECT, or expandable segments)");
    }
  }
  if (spansNodes()) {
    return CollectivePath::inner("the group spans nodes");
  }
  const CollectivePath& atCreation = (cuda ? cudaPath_ : hostPath_).atCreation;
  if (!atCreation.isDma()) {
    return atCreation.isInner() ? atCreation : CollectivePath::inner("the group does not serve the device");
  }
  return CollectivePath::dma(CollectivePath::kDirect);
}

CollectivePath ProcessGroupSDMA::connectP2pPair(const at::Device& device, int peer, const char* op) {
  DevicePath& path = devicePath(device);
  if (!path.p2p) {
    path.p2p = device.is_cuda() ? makeCopyEngineP2pRunner(sdmaStore_, getRank(), device.index(), board_.get(),
                                                          directPathOptions(), geometry(device))
                                : makeHostP2pRunner(sdmaStore_, getRank(), board_.get());
    p2pDevice_ = device.index();
  }
  TORCH_CHECK_VALUE(!device.is_cuda() || device.index() == p2pDevice_, "torch_sdma: ", op, " on ", device.str(),
                    ": this group's point-to-point runs on cuda:", static_cast<int>(p2pDevice_),
                    " (a group's point-to-point uses one GPU, as NCCL's communicator does)");
  try {
    return path.p2p->connectPair(peer);
  } catch (const std::exception& e) {
    std::string why = messageOf(e);
    const std::string prefix = "torch_sdma: ";
    if (why.rfind(prefix, 0) == 0) {
      why = why.substr(prefix.size());
    }
    C10_THROW_ERROR(DistBackendError, "torch_sdma: " + std::string(op) + " with group rank " + std::to_string(peer) +
                                          " on group '" + options_.groupName +
                                          "' failed while connecting the pair: " + why);
  }
}

void ProcessGroupSDMA::recordP2pPath(const char* op, const at::Device& device, const CollectivePath& path,
                                     int64_t bytes) {
  if (path.isDma()) {
    recordOpPath(op, device, path.key(), bytes);
    return;
  }
  // Counted as delegated by delegate(); group_path(op=) still says why.
  std::lock_guard<std::mutex> lock(statsMutex_);
  lastOpPath_[device.is_cuda() ? 1 : 0][op] = path.key();
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::pointToPoint(const CollectiveNames& names,
                                                              const TracedCollective& traced,
                                                              const std::vector<at::Tensor>& tensors, int peer,
                                                              bool isSend, int tag, InnerCall&& innerCall) {
  if (!coalescing_) {
    return issueP2p(names, traced, tensors, peer, isSend, tag, std::forward<InnerCall>(innerCall));
  }
  try {
    return issueP2p(names, traced, tensors, peer, isSend, tag, std::forward<InnerCall>(innerCall));
  } catch (const std::exception&) {
    // Raised at the block's end instead (p2pBatchFailure_).
    if (!p2pBatchFailure_) {
      p2pBatchFailure_ = std::current_exception();
    }
    return c10::make_intrusive<BatchedP2pWork>(getRank(), isSend ? c10d::OpType::SEND : c10d::OpType::RECV,
                                               p2pBatchOutcome_);
  }
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::issueP2p(const CollectiveNames& names, const TracedCollective& traced,
                                                          const std::vector<at::Tensor>& tensors, int peer, bool isSend,
                                                          int tag, InnerCall&& innerCall) {
  if (peer == getRank()) {
    recordPath(std::string("self:") + names.stats, bytesOf(tensors.empty() ? at::Tensor() : tensors[0]));
    return runTraced(traceGroup_, getGroupDesc(), ++p2pSeq_, traced,
                     [&] { return trackCoalesced(isSend ? self_.send(tensors, tag) : self_.recv(tensors, tag)); });
  }
  TORCH_CHECK_VALUE(tensors.size() == 1, "torch_sdma: ", names.stats, " takes exactly one tensor, got ",
                    tensors.size());
  TORCH_CHECK_VALUE(peer >= 0 && peer < getSize(), "torch_sdma: ", names.stats, ": invalid group rank ", peer,
                    " for a group of ", getSize());
  const at::Tensor& tensor = tensors[0];
  CollectivePath path = p2pRoute(tensor);
  if (path.isDma()) {
    if (!tensor.is_contiguous() || tensor.is_sparse()) {
      refuseP2p({P2pOp{peer, isSend, tensor, tag}}, names.stats, "Tensors must be contiguous and dense");
    }
    if (coalescing_) {
      // Connected at the batch's end, in pair order (p2p_batch.hpp): here, in call order, a ring would wait in a
      // cycle of connects.
      p2pBatch_.push_back({peer, isSend, tensor, tag});
      return runTraced(traceGroup_, getGroupDesc(), ++p2pSeq_, traced, [&] {
        return c10::make_intrusive<BatchedP2pWork>(getRank(), isSend ? c10d::OpType::SEND : c10d::OpType::RECV,
                                                   p2pBatchOutcome_);
      });
    }
    path = connectP2pPair(tensor.device(), peer, names.stats);
  }
  recordP2pPath(names.stats, tensor.device(), path, bytesOf(tensor));
  if (path.isInner()) {
    return delegateP2p(names, traced, tensors, std::forward<InnerCall>(innerCall));
  }
  return runTraced(traceGroup_, getGroupDesc(), ++p2pSeq_, traced, [&] {
    return runP2p({P2pOp{peer, isSend, tensor, tag}}, names.stats, isSend ? c10d::OpType::SEND : c10d::OpType::RECV);
  });
}

void ProcessGroupSDMA::refuseP2p(std::vector<P2pOp> ops, const char* op, const std::string& words) {
  const std::string why = "torch_sdma: " + std::string(op) + ": " + words;
  if (coalescing_) {
    if (!p2pBatchFailure_) {
      p2pBatchFailure_ =
          std::make_exception_ptr(c10::ValueError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, why));
      p2pBatchRefusal_ = why;
    }
    return;
  }
  postP2pRefusals(ops, op, why);
  C10_THROW_ERROR(ValueError, why);
}

void ProcessGroupSDMA::postP2pRefusals(const std::vector<P2pOp>& ops, const char* op, const std::string& why) {
  // Each pair of an op on the DMA path takes its serial as refused, in the pairs' one order, per device (a pair of
  // CPU tensors and one of CUDA tensors count apart), so that the peer's matching op fails naming this rank.
  std::vector<P2pOp> posted;
  for (const P2pOp& o : ops) {
    if (o.tensor.defined() && o.peer != getRank() && p2pRoute(o.tensor).isDirect()) {
      posted.push_back(o);
    }
  }
  if (posted.empty()) {
    return;
  }
  const CollectiveInfo info{c10d::OpType::UNKNOWN, op, ++p2pSeq_, options_.groupName, getRank(), getSize(),
                            options_.timeout};
  for (const bool cuda : {false, true}) {
    std::vector<P2pOp> onDevice;
    for (const P2pOp& o : posted) {
      if (o.tensor.is_cuda() == cuda) {
        onDevice.push_back(o);
      }
    }
    int last = -1;
    for (const PairStep& step : pairStepsOf(onDevice, getRank())) {
      if (step.peer == last) {
        continue;  // one serial per pair: the refusal fails the group, so no later step of the pair meets anything
      }
      last = step.peer;
      const at::Device device = (step.send.defined() ? step.send : step.recv).device();
      try {
        if (connectP2pPair(device, step.peer, op).isDma()) {
          devicePath(device).p2p->refuse(step.peer, directionsOf(step), why, info, seq_ + 1);
        }
      } catch (const std::exception& e) {
        LOG(WARNING) << "torch_sdma: " << info.describe() << ": this rank's refusal did not reach group rank "
                     << step.peer << ": " << messageOf(e);
      }
    }
  }
}

void ProcessGroupSDMA::failP2pBatch() {
  std::exception_ptr failure;
  failure.swap(p2pBatchFailure_);
  std::string why;  // the refusal's words, else the failure's
  why.swap(p2pBatchRefusal_);
  std::vector<P2pOp> ops;
  ops.swap(p2pBatch_);
  coalescedWorks_.clear();
  if (why.empty()) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      why = messageOf(e);
    }
  }
  if (p2pBatchOutcome_) {
    p2pBatchOutcome_->failed = failure;
  }
  self_.dropBatch("the batch it was posted in failed: " + why);
  if (innerCuda_) {
    try {
      (void)innerCuda_->endCoalescing();
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: the inner backend's batch around a failed op: " << messageOf(e);
    }
  }
  postP2pRefusals(ops, "batch_isend_irecv", why);
  std::rethrow_exception(failure);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::runP2p(const std::vector<P2pOp>& ops, const char* op,
                                                        c10d::OpType opType) {
  const CollectiveInfo info{opType, op, p2pSeq_, options_.groupName, getRank(), getSize(), options_.timeout};
  return devicePath(ops.front().tensor.device()).p2p->run(pairStepsOf(ops, getRank()), info, seq_ + 1);
}

void ProcessGroupSDMA::beginP2pBatch() {
  p2pBatch_.clear();  // a batch that never ended: nothing of it was enqueued
  p2pBatchOutcome_ = std::make_shared<P2pBatchOutcome>();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::endP2pBatch() {
  std::vector<P2pOp> ops;
  ops.swap(p2pBatch_);
  auto outcome = std::move(p2pBatchOutcome_);
  if (ops.empty()) {
    return nullptr;
  }
  try {
    // Each pair connects in the one pair order every rank follows; a pair that cannot take the DMA path (both members
    // found the same) hands its operations to the inner backend, which runs gloo's at once.
    std::vector<P2pOp> direct;
    std::vector<c10::intrusive_ptr<c10d::Work>> inner;
    const at::Device device = ops.front().tensor.device();
    for (const P2pOp& op : ops) {
      if (op.tensor.device() != device) {
        refuseP2p(ops, "batch_isend_irecv",
                  "with tensors on " + device.str() + " and " + op.tensor.device().str() +
                      "; a batch's tensors must be on one device");
      }
    }
    CollectivePath dmaPath = CollectivePath::dma(CollectivePath::kDirect);  // or captured: alike for every pair
    for (const PairStep& step : pairStepsOf(ops, getRank())) {
      const CollectivePath path = connectP2pPair(device, step.peer, "batch_isend_irecv");
      if (path.isDma()) {
        dmaPath = path;
        continue;
      }
      for (const P2pOp& op : ops) {
        if (op.peer == step.peer) {
          std::vector<at::Tensor> ts{op.tensor};
          auto& backend = innerFor(op.tensor.device(), op.isSend ? "send" : "recv");
          recordP2pPath(op.isSend ? "send" : "recv", op.tensor.device(), path, bytesOf(op.tensor));
          recordPath(op.isSend ? "delegated:send" : "delegated:recv", bytesOf(op.tensor));
          inner.push_back(op.isSend ? backend->send(ts, op.peer, op.tag) : backend->recv(ts, op.peer, op.tag));
        }
      }
      ops.erase(std::remove_if(ops.begin(), ops.end(), [&](const P2pOp& op) { return op.peer == step.peer; }),
                ops.end());
    }
    if (!ops.empty()) {
      for (const P2pOp& op : ops) {
        recordP2pPath(op.isSend ? "send" : "recv", op.tensor.device(), dmaPath, bytesOf(op.tensor));
      }
      inner.push_back(runP2p(ops, "batch_isend_irecv", c10d::OpType::COALESCED));
    }
    outcome->work = inner.size() == 1
                        ? inner[0]
                        : c10::intrusive_ptr<c10d::Work>(c10::make_intrusive<CoalescedWork>(std::move(inner)));
  } catch (const std::exception&) {
    outcome->failed = std::current_exception();
    throw;
  }
  return outcome->work;
}

}  // namespace sdma
