// The exchange collectives (all-to-all, broadcast, gather, scatter): the choice of path, then the runner's direct
// schedule or the inner backend. Every rank takes the same route for a call (docs/design.md, "Exchange"): the route
// depends only on what every rank passes alike (the op, the agreed bytes, the root, the group's settings), and the
// call board compares the route, the root and the agreed bytes across ranks.
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "backend/process_group_sdma.hpp"
#include "collective/exchange_inputs.hpp"

namespace sdma {
namespace {

// Stats, trace and record_param_comms names (the last two as ProcessGroupNCCL names them after its "nccl:" prefix).
constexpr CollectiveNames kAlltoallSingle{"all_to_all_single", "all_to_all", "all_to_allv", CallOp::kAlltoallSingle};
constexpr CollectiveNames kAlltoall{"all_to_all", "all_to_all", "all_to_all", CallOp::kAlltoall};
constexpr CollectiveNames kBroadcast{"broadcast", "broadcast", "broadcast", CallOp::kBroadcast};
constexpr CollectiveNames kGather{"gather", "gather", "gather", CallOp::kGather};
constexpr CollectiveNames kScatter{"scatter", "scatter", "scatter", CallOp::kScatter};

const std::vector<at::Tensor> kNone;

std::chrono::milliseconds timeoutOr(std::chrono::milliseconds given, std::chrono::milliseconds group) {
  return given.count() > 0 ? given : group;
}

int64_t bytesOf(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) {
    n += static_cast<int64_t>(t.numel()) * t.element_size();
  }
  return n;
}

// all_to_all_single has no in-place form: a peer may write this rank's output while another still reads its input,
// and NCCL gives no right bytes for it either. An input that shares memory with the output is read from a copy of it,
// made here on the caller's current stream, so every rank gets the bytes it was sent. A non-contiguous input stays as
// it is, for the check that refuses it.
at::Tensor apartFromOutput(const at::Tensor& input, const at::Tensor& output) {
  if (!input.defined() || !output.defined() || input.numel() == 0 || !input.is_contiguous()) {
    return input;
  }
  return at::get_overlap_status(input, output) == at::MemOverlapStatus::No ? input : input.clone();
}

// NCCL runs every CUDA exchange but broadcast as sends and receives (gloo connects every pair at its creation).
bool runsAsInnerSendsAndReceives(const PlannedExchange& planned) {
  return planned.device.is_cuda() && !planned.broadcast;
}

// The directions `planned` moves bytes in with group rank q: bit 0 sends to it, bit 1 receives from it.
uint8_t directionsWith(const ExchangePlan& p, size_t q) {
  return (p.sendTo[q].bytes > 0 ? 1 : 0) | (p.recvFrom[q].bytes > 0 ? 2 : 0);
}

}  // namespace

bool ProcessGroupSDMA::delegatedByKnob(CallOp op) const {
  return delegatedByName(op == CallOp::kAlltoallSingle ? "all_to_all" : callOpName(op));
}

bool ProcessGroupSDMA::delegatedByName(const std::string& name) const {
  const std::string& list = options_.delegate;
  size_t at = 0;
  while (at <= list.size()) {
    const size_t comma = std::min(list.find(',', at), list.size());
    if (list.compare(at, comma - at, name) == 0 && name.size() == comma - at) {
      return true;
    }
    at = comma + 1;
  }
  return false;
}

CollectivePath ProcessGroupSDMA::exchangeRoute(const PlannedExchange& planned, CallOp op) const {
  if (!planned.notForDma.empty()) {
    return CollectivePath::inner(planned.notForDma);
  }
  if (options_.disable) {
    return CollectivePath::inner("TORCH_SDMA_DISABLE=1");
  }
  if (delegatedByKnob(op)) {
    return CollectivePath::inner("TORCH_SDMA_DELEGATE");
  }
  const bool cuda = planned.device.is_cuda();
  if (planned.routeBytes >= 0 && planned.routeBytes < collectiveMinBytes(cuda)) {
    return CollectivePath::inner("below TORCH_SDMA_MIN_BYTES");
  }
  const CollectivePath& decided = (cuda ? cudaPath_ : hostPath_).decided;
  if (decided.isInner()) {
    return decided;  // connecting failed on every member alike
  }
  return CollectivePath::dma(CollectivePath::kDirect);
}

bool ProcessGroupSDMA::connectsInnerDirections(const PlannedExchange& planned, const CollectivePath& path) const {
  if (!path.isInner()) {
    return false;
  }
  if (planned.broadcast) {
    return planned.device.is_cuda() && connectsInnerCollective(CallOp::kBroadcast, innerCuda_);
  }
  if (!runsAsInnerSendsAndReceives(planned)) {
    return false;
  }
  const ExchangePlan& p = planned.plan;
  for (size_t q = 0; q < p.sendTo.size(); ++q) {
    const uint8_t used = q < innerCudaDirectionsUsed_.size() ? innerCudaDirectionsUsed_[q] : 0;
    if (static_cast<int>(q) != getRank() && (directionsWith(p, q) & ~used) != 0) {
      return true;
    }
  }
  return false;
}

void ProcessGroupSDMA::markInnerDirectionsUsed(const PlannedExchange& planned) {
  if (planned.broadcast && planned.device.is_cuda()) {
    markInnerCollectiveRan(CallOp::kBroadcast);
  }
  if (!runsAsInnerSendsAndReceives(planned)) {
    return;
  }
  const ExchangePlan& p = planned.plan;
  innerCudaDirectionsUsed_.resize(p.sendTo.size(), 0);
  for (size_t q = 0; q < p.sendTo.size(); ++q) {
    innerCudaDirectionsUsed_[q] |= directionsWith(p, q);
  }
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::exchangeCollective(const CollectiveNames& names, c10d::OpType opType,
                                                                    PlannedExchange planned,
                                                                    const TracedCollective& traced, bool asyncOp,
                                                                    std::chrono::milliseconds timeout,
                                                                    InnerCall&& innerCall) {
  refuseIfDestroyed(names.stats);
  const bool cuda = planned.device.is_cuda();
  CollectivePath path = exchangeRoute(planned, names.call);
  CallPost post;
  post.op = names.call;
  post.route = cuda ? (path.isInner() ? CallPost::kInnerCuda : CallPost::kDmaCuda)
                    : (path.isInner() ? CallPost::kInnerCpu : CallPost::kDmaCpu);
  post.bytes = planned.agreedBytes;
  post.root = planned.root;
  const CollectiveInfo info = describeCall(names.stats, opType, timeout, post);
  const int64_t bytes = bytesOf(planned.outputs);
  DevicePath& device = devicePath(planned.device);
  if (path.isDma()) {
    TORCH_CHECK(device.connectFailure.empty(), "torch_sdma: ", info.describe(),
                " refused: an earlier collective on this group failed: ", device.connectFailure);
    // Connecting is collective: the first DMA call of the device meets every peer's post first.
    const bool connects = device.decided.kind == CollectivePath::Kind::Unknown;
    postCall(info, /*awaitPeers=*/connects);
    if (connects) {
      try {
        connect(planned.device);
      } catch (const c10::DistBackendError& e) {
        std::string why = e.what_without_backtrace();
        const std::string prefix = "torch_sdma: ";
        if (why.rfind(prefix, 0) == 0) {
          why = why.substr(prefix.size());
        }
        device.connectFailure = "torch_sdma: " + info.describe() + " failed while connecting the group: " + why;
        C10_THROW_ERROR(DistBackendError, device.connectFailure);
      }
    }
    path = device.runner ? device.runner->pathFor(planned) : device.decided;
    // The runner may hand the call to NCCL (the direct path off, a tensor on another GPU): see below.
    if (!connects && connectsInnerDirections(planned, path)) {
      awaitPostedPeers(info);
    }
  } else {
    // NCCL connects a direction with a peer at its first use inside the call, on this CPU, waiting there for the
    // peer: a peer that refused the call on its own arguments or made another would hold this rank there, out of
    // every watcher's sight. Such a call meets every peer's post first (a pair peer that finds a third rank's refusal
    // fails and never connects).
    postCall(info, /*awaitPeers=*/connectsInnerDirections(planned, path));
  }
  recordOpPath(names.stats, planned.device, path.key(), bytes);
  if (path.isDma()) {
    return trackCoalesced(runTraced(traceGroup_, getGroupDesc(), info.seq, traced,
                                    [&] { return device.runner->run(planned, asyncOp, info); }));
  }
  auto& inner = innerFor(planned.device, names.stats);
  return runTraced(traceGroup_, getGroupDesc(), info.seq, traced, [&] {
    auto work = watchDelegated(info, inner, innerCall(*inner));
    markInnerDirectionsUsed(planned);
    return inner == innerCuda_ ? work : trackCoalesced(work);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::alltoall_base(at::Tensor& output, at::Tensor& given,
                                                               std::vector<int64_t>& outputSplitSizes,
                                                               std::vector<int64_t>& inputSplitSizes,
                                                               const c10d::AllToAllOptions& opts) {
  at::Tensor input = apartFromOutput(given, output);
  const std::vector<at::Tensor> ins{input}, outs{output};
  const bool even = outputSplitSizes.empty() && inputSplitSizes.empty();
  return refusalTakesItsNumber(CallOp::kAlltoallSingle, [&] {
    return exchangeCollective(
        kAlltoallSingle, c10d::OpType::ALLTOALL_BASE,
        planAlltoallSingle(output, input, outputSplitSizes, inputSplitSizes, getRank(), getSize()),
        {kAlltoallSingle, ins, outs, inputSplitSizes, outputSplitSizes, even ? kAlltoall.comms : nullptr}, opts.asyncOp,
        timeoutOr(opts.timeout, options_.timeout),
        [&](c10d::Backend& b) { return b.alltoall_base(output, input, outputSplitSizes, inputSplitSizes, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  return refusalTakesItsNumber(CallOp::kAlltoall, [&] {
    return exchangeCollective(kAlltoall, c10d::OpType::ALLTOALL, planAlltoall(outputs, inputs, getRank(), getSize()),
                              {kAlltoall, inputs, outputs}, opts.asyncOp, timeoutOr(opts.timeout, options_.timeout),
                              [&](c10d::Backend& b) { return b.alltoall(outputs, inputs, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  return refusalTakesItsNumber(CallOp::kBroadcast, [&] {
    return exchangeCollective(kBroadcast, c10d::OpType::BROADCAST,
                              planBroadcast(tensors, static_cast<int>(opts.rootRank), getRank(), getSize()),
                              {kBroadcast, tensors, tensors}, opts.asyncOp, timeoutOr(opts.timeout, options_.timeout),
                              [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                        std::vector<at::Tensor>& inputs,
                                                        const c10d::GatherOptions& opts) {
  return refusalTakesItsNumber(CallOp::kGather, [&] {
    return exchangeCollective(kGather, c10d::OpType::GATHER,
                              planGather(outputs, inputs, static_cast<int>(opts.rootRank), getRank(), getSize()),
                              {kGather, inputs, outputs.empty() ? kNone : outputs[0]}, opts.asyncOp,
                              timeoutOr(opts.timeout, options_.timeout),
                              [&](c10d::Backend& b) { return b.gather(outputs, inputs, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::scatter(std::vector<at::Tensor>& outputs,
                                                         std::vector<std::vector<at::Tensor>>& inputs,
                                                         const c10d::ScatterOptions& opts) {
  return refusalTakesItsNumber(CallOp::kScatter, [&] {
    return exchangeCollective(kScatter, c10d::OpType::SCATTER,
                              planScatter(outputs, inputs, static_cast<int>(opts.rootRank), getRank(), getSize()),
                              {kScatter, inputs.empty() ? kNone : inputs[0], outputs}, opts.asyncOp,
                              timeoutOr(opts.timeout, options_.timeout),
                              [&](c10d::Backend& b) { return b.scatter(outputs, inputs, opts); });
  });
}

}  // namespace sdma
