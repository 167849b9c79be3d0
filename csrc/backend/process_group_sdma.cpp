#include "backend/process_group_sdma.hpp"

#include <torch/csrc/distributed/c10d/debug.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Logging.h>

#ifdef TORCH_SDMA_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include <algorithm>

#include "backend/settings_agreement.hpp"
#include "runner/async_error_exit.hpp"
#include "runner/group_failure.hpp"
#include "work/coalesced_work.hpp"

namespace sdma {
namespace {

// Collectives a rank's CPU may run ahead of a peer's before it waits for it (call_board.hpp). Below the arrival
// mailboxes' depth (1024), so that a rank that got past the board never waits for a mailbox's ring.
constexpr int kCallBoardDepth = 512;

std::string scalarTypeName(uint8_t dtype) {
  return c10::toString(static_cast<c10::ScalarType>(dtype));
}

int64_t tensorBytes(const std::vector<at::Tensor>& ts) {
  int64_t b = 0;
  for (const auto& t : ts) {
    b += t.numel() * t.element_size();
  }
  return b;
}

// What record_param_comms says of the group's ranks, as ProcessGroupNCCL derives it: the first global rank and
// the stride between them when they are evenly spaced, -1 when not.
TracedGroup traceGroupOf(const SdmaOptions& options, int rank, int size) {
  TracedGroup g{options.groupName, rank, size, 0, 1};
  const auto& ranks = options.globalRanks;
  if (!ranks.empty()) {
    g.globalRankStart = static_cast<int>(ranks[0]);
    g.globalRankStride = ranks.size() > 1 ? static_cast<int>(ranks[1] - ranks[0]) : 1;
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i] - ranks[i - 1] != g.globalRankStride) {
        g.globalRankStart = g.globalRankStride = -1;
        break;
      }
    }
  }
  return g;
}

}  // namespace

ProcessGroupSDMA::ProcessGroupSDMA(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   SdmaOptions options, c10::intrusive_ptr<c10d::Backend> innerCpu,
                                   c10::intrusive_ptr<c10d::Backend> innerCuda, std::string cudaUnavailable,
                                   InnerBackendFactory railBackends)
    : Backend(rank, size),
      sdmaStore_(c10::make_intrusive<GroupTimeoutStore>("sdma/", store, options.timeout)),
      options_(std::move(options)),
      innerCpu_(std::move(innerCpu)),
      innerCuda_(std::move(innerCuda)),
      cudaUnavailable_(std::move(cudaUnavailable)),
      railBackends_(std::move(railBackends)),
      traceGroup_(traceGroupOf(options_, rank, size)),
      self_(rank) {
  // Before anything is mapped or connected, so that a refused group leaves nothing behind.
  agreeOnSettings(*sdmaStore_, rank, size, options_);
  if (!options_.disable) {
    // The node layout follows from this one exchange alone, by one rule, so every member derives the same.
    members_ = exchangeIdentities(*sdmaStore_, "members", rank, size, "", options_.testPseudoNode);
    std::vector<std::string> nodeOfRank;
    for (const auto& m : members_) {
      nodeOfRank.push_back(m.nodeIdentity());
    }
    layout_ = NodeLayout::group(nodeOfRank);
    createCallBoard();
  }
  // Every member runs these exchanges at creation, so the group's log line can say which path it will take.
  if (innerCuda_) {
    cudaPath_.atCreation = predictPath(/*cuda=*/true);
  }
  if (innerCpu_) {
    hostPath_.atCreation = predictPath(/*cuda=*/false);
  }
}

CollectivePath ProcessGroupSDMA::predictPath(bool cuda) {
  if (options_.disable) {
    return CollectivePath::inner("TORCH_SDMA_DISABLE=1");
  }
  if (!spansNodes()) {
    const std::string problem = cuda ? copyEnginePathProblem(*sdmaStore_, getRank(), getSize())
                                     : sharedMemoryPathProblem(*sdmaStore_, getRank(), getSize());
    return problem.empty() ? CollectivePath::dma() : CollectivePath::inner(problem);
  }
  std::string problem = layout_.hierarchyProblem();
  if (!problem.empty()) {
    return CollectivePath::inner(problem);  // the same on every member, as the layout is
  }
  const int local = layout_.localIndexOf(getRank());
  const int perNode = layout_.ranksPerNode();
  auto node = nodeStore(cuda);
  problem = cuda ? copyEnginePathProblem(*node, local, perNode) : sharedMemoryPathProblem(*node, local, perNode);
  // Each node answered for itself; all must take the path, or none.
  problem = agreeOnPath(*sdmaStore_, std::string("hier/") + (cuda ? "cuda" : "cpu") + "/create", getRank(), getSize(),
                        problem);
  return problem.empty() ? CollectivePath::dma("hierarchical") : CollectivePath::inner(problem);
}

c10::intrusive_ptr<c10d::Store> ProcessGroupSDMA::nodeStore(bool cuda) const {
  return c10::make_intrusive<c10d::PrefixStore>(
      std::string("hier/") + (cuda ? "cuda" : "cpu") + "/node/" + std::to_string(layout_.nodeOf(getRank())) + "/",
      sdmaStore_);
}

ProcessGroupSDMA::~ProcessGroupSDMA() {
  delegatedWatch_.reset();  // its thread calls back into this object
}

void ProcessGroupSDMA::createCallBoard() {
  const bool spans = spansNodes();
  if (spans && !layout_.hierarchyProblem().empty()) {
    return;  // no node layout to share a board by; the group's all-gathers go to the inner backend
  }
  const int member = spans ? layout_.localIndexOf(getRank()) : getRank();
  const int members = spans ? layout_.ranksPerNode() : getSize();
  std::vector<int> groupRanks;
  for (int m = 0; m < members; ++m) {
    groupRanks.push_back(spans ? layout_.rankAt(layout_.nodeOf(getRank()), m) : m);
  }
  c10d::PrefixStore store(spans ? "board/node/" + std::to_string(layout_.nodeOf(getRank())) + "/" : "board/",
                          sdmaStore_);
  try {
    boardRegion_ = GroupRegion(store, "calls", member, members, CallBoard::bytesFor(members, kCallBoardDepth),
                               "the group's call board");
  } catch (const c10::Error& e) {
    // Every member got the same answer: none of them compares its calls with the others'.
    LOG(WARNING) << "torch_sdma: group '" << options_.groupName
                 << "' does not compare its collectives across ranks: " << e.what_without_backtrace();
    return;
  }
  board_ = std::make_unique<CallBoard>(boardRegion_.data(), member, members, kCallBoardDepth, std::move(groupRanks),
                                       options_.groupName, &scalarTypeName);
}

std::string ProcessGroupSDMA::boardStopReason() const {
  const std::string failed = board_->failure();
  if (!failed.empty()) {
    return "an earlier collective on this group failed: " + failed;
  }
  for (int m = 0; m < board_->members(); ++m) {
    const int q = board_->groupRankOf(m);
    if (m != board_->member() && q < static_cast<int>(members_.size()) && !processAlive(members_[q].pid)) {
      return "group rank " + std::to_string(q) + " (pid " + std::to_string(members_[q].pid) + ") exited";
    }
  }
  return "";
}

void ProcessGroupSDMA::refuseIfCallsDiffered(const CollectiveInfo& info) const {
  if (!board_) {
    return;
  }
  const std::string failed = board_->failure();
  if (C10_UNLIKELY(!failed.empty())) {
    C10_THROW_ERROR(DistBackendError, "torch_sdma: " + info.describe() +
                                          " refused: an earlier collective on this group failed: " + failed);
  }
}

CollectiveInfo ProcessGroupSDMA::describeCall(const char* op, c10d::OpType opType, std::chrono::milliseconds timeout,
                                              const CallPost& post) {
  CollectiveInfo info{opType, op, ++seq_, options_.groupName, getRank(), getSize(), timeout};
  info.board = board_.get();
  info.post = post;
  return info;
}

void ProcessGroupSDMA::postCall(const CollectiveInfo& info, bool awaitPeers) {
  refuseIfCallsDiffered(info);
  meetPeersOnBoard(info, /*post=*/true, awaitPeers);
}

void ProcessGroupSDMA::awaitPostedPeers(const CollectiveInfo& info) {
  meetPeersOnBoard(info, /*post=*/false, /*awaitPeers=*/true);
}

void ProcessGroupSDMA::meetPeersOnBoard(const CollectiveInfo& info, bool post, bool awaitPeers) {
  if (!board_) {
    return;
  }
  std::string reason;
  try {
    const auto stop = [this] { return boardStopReason(); };
    CallBoard::Differing d = post ? board_->post(info.seq, info.post, info.timeout, stop) : CallBoard::Differing{};
    if (!d && awaitPeers) {
      d = board_->awaitPeers(info.seq, info.post, info.timeout, stop);
    }
    if (!d) {
      return;
    }
    // Nothing was enqueued: a peer that did not read this rank's post finds this one, and says the same.
    reason = info.describe() + " failed: " + board_->describe(info.seq, info.post, d);
    if (d.post.route == CallPost::kRefused) {
      const std::string key = refusalKey(info.seq, board_->groupRankOf(d.peer));
      if (sdmaStore_->check({key})) {  // set before the refusal was posted
        const std::vector<uint8_t> why = sdmaStore_->get(key);
        reason += "; its error: " + std::string(why.begin(), why.end());
      }
    }
  } catch (const CallBoard::PeerNeverPosted& e) {
    reason = info.describe() + " timed out after " + std::to_string(e.waited.count()) +
             " ms waiting for group ranks [" + std::to_string(board_->groupRankOf(e.peer)) +
             "], which never reached it";
  } catch (const std::exception& e) {
    reason = info.describe() + " failed: " + messageOf(e);
  }
  board_->fail(info.seq, reason);
  C10_THROW_ERROR(DistBackendError, "torch_sdma: " + reason);
}

std::string ProcessGroupSDMA::refusalKey(uint64_t seq, int groupRank) const {
  return "refused/" + std::to_string(seq) + "/" + std::to_string(groupRank);
}

void ProcessGroupSDMA::postRefusal(CallOp op, const std::exception& e) {
  if (!board_ || destroyed_ || !board_->failure().empty()) {
    return;  // no peer waits for this rank's post
  }
  CallPost post;
  post.op = op;
  post.route = CallPost::kRefused;
  const CollectiveInfo info = describeCall(callOpName(op), c10d::OpType::UNKNOWN, options_.timeout, post);
  std::string why = messageOf(e);
  if (const auto nl = why.find('\n'); nl != std::string::npos) {
    why.resize(nl);  // the first line: c10's errors append the C++ frames below it
  }
  try {
    sdmaStore_->set(refusalKey(info.seq, getRank()), why);
    const auto stop = [this] { return boardStopReason(); };
    CallBoard::Differing d = board_->post(info.seq, post, info.timeout, stop);
    if (!d) {
      // Until every peer posted this number too: one that called validly fails its call and its group, and this
      // rank's next call, on a path that may not read the peers' failure marks, would wait for it until the timeout.
      d = board_->awaitPeers(info.seq, post, info.timeout, stop);
    }
    if (d) {
      // A peer posted the call itself and may have enqueued it: its watcher finds this post and fails it. This rank
      // fails the group too, so that its next call does not wait for a peer that no longer goes on.
      board_->fail(info.seq,
                   info.describe() + " failed: " + board_->describe(info.seq, post, d) + "; its error: " + why);
    }
  } catch (const std::exception& posting) {
    LOG(WARNING) << "torch_sdma: " << info.describe()
                 << ": this rank's refusal did not meet every peer's call: " << messageOf(posting);
    board_->fail(info.seq, info.describe() + " was refused on this rank: " + why);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::watchDelegated(const CollectiveInfo& info,
                                                                const c10::intrusive_ptr<c10d::Backend>& inner,
                                                                c10::intrusive_ptr<c10d::Work> work) {
  // Every peer already went past this call, agreeing: nothing to watch (the common case of a rank that calls last).
  if (!board_ || board_->settled(info.seq)) {
    return work;
  }
  DelegatedWatch::Call call;
  call.seq = info.seq;
  call.post = info.post;
  call.deadline = std::chrono::steady_clock::now() + info.timeout;
  call.inner = inner;
  // Inside a coalescing block the inner backend's works are its own business (endCoalescing returns them).
  if (work && !coalescing_) {
    call.work = c10::make_intrusive<DelegatedWork>(std::move(work), /*blocksCpu=*/inner == innerCpu_, *board_, info.seq,
                                                   info.post, getSize());
    work = call.work;
  }
  if (!delegatedWatch_) {
    delegatedWatch_ = std::make_unique<DelegatedWatch>(
        *board_, [this](const DelegatedWatch::Call& c, const std::string& words) { onDelegatedDiffering(c, words); });
  }
  delegatedWatch_->watch(std::move(call));
  return work;
}

void ProcessGroupSDMA::onDelegatedDiffering(const DelegatedWatch::Call& call, const std::string& words) {
  const CollectiveInfo info{
      c10d::OpType::UNKNOWN, callOpName(call.post.op), call.seq, options_.groupName, getRank(), getSize(),
      options_.timeout};
  const std::string reason = info.describe() + " failed: " + words;
  board_->fail(call.seq, reason);
  // An NCCL call returned when its kernel was enqueued, and aborting its communicator ends that kernel with its output
  // unwritten: the caller's stream would run on into whatever reads it. A gloo call's wait() raises instead.
  if (call.inner && call.inner != innerCpu_ && exitsOnAsyncError()) {
    exitOnAsyncError(reason + ".", {info.describe()});
  }
  LOG(ERROR) << "torch_sdma: " << reason << "; the inner backend's communicator is aborted";
  if (call.work) {
    call.work->fail(std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + reason)));
  }
  // Its streams and threads would wait for the peer until the inner backend's own timeout.
  if (call.inner) {
    try {
      call.inner->abort();
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: aborting the inner backend failed: " << e.what();
    }
  }
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupSDMA::getBackendOptions() {
  // split_group deep-copies these and hands them back to split(); the inner NCCL backend needs its own kind.
  if (innerCuda_) {
    return innerCuda_->getBackendOptions();
  }
  if (innerCpu_) {
    return innerCpu_->getBackendOptions();
  }
  auto opts = c10::make_intrusive<Options>("sdma", options_.timeout);
  opts->group_name = options_.groupName;
  return opts;
}

StagingGeometry ProcessGroupSDMA::geometry(const at::Device& device) const {
  const int64_t staging = device.is_cuda() ? options_.stagingBytesCuda : options_.stagingBytesCpu;
  // Hierarchical: the transport spans one node.
  const int members = spansNodes() ? layout_.ranksPerNode() : getSize();
  return StagingGeometry::fit(members, options_.slots, static_cast<size_t>(staging),
                              static_cast<size_t>(options_.chunkBytes));
}

DirectPathOptions ProcessGroupSDMA::directPathOptions() const {
  DirectPathOptions direct;
  direct.enabled = options_.directCuda;
  direct.peerWait = std::chrono::microseconds(options_.directPeerWaitUs);
  direct.peerLanes = options_.peerLanes;
  return direct;
}

// ---------------------------------------------------------------------------------------------------------------
// Dispatch to the inner backends.

c10::intrusive_ptr<c10d::Backend>& ProcessGroupSDMA::innerFor(const at::Device& device, const char* op) {
  if (device.is_cuda()) {
    TORCH_CHECK(innerCuda_, "torch_sdma: ", op, " on CUDA tensors cannot run in this process: ",
                cudaUnavailable_.empty() ? "no CUDA backend was created for this group" : cudaUnavailable_);
    return innerCuda_;
  }
  TORCH_CHECK(innerCpu_, "torch_sdma: ", op, " on ", device.str(),
              " tensors: this group's sdma backend serves CUDA only; pass \"cpu:gloo,cuda:sdma\" or \"sdma\"");
  return innerCpu_;
}

c10::intrusive_ptr<c10d::Backend>& ProcessGroupSDMA::innerFor(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(!tensors.empty(), "torch_sdma: ", op, " needs at least one tensor");
  return innerFor(tensors[0].device(), op);
}

void ProcessGroupSDMA::recordOpPath(const char* op, const at::Device& device, const std::string& key, int64_t bytes) {
  const std::string opKey = std::string(op) + ":" + key;
  std::lock_guard<std::mutex> lock(statsMutex_);
  auto& s = stats_[opKey];
  s.first += 1;
  s.second += bytes;
  lastOpPath_[device.is_cuda() ? 1 : 0][op] = key;
}

std::string ProcessGroupSDMA::opPath(c10::DeviceType device, const std::string& op) const {
  std::lock_guard<std::mutex> lock(statsMutex_);
  const auto& paths = lastOpPath_[device == c10::DeviceType::CUDA ? 1 : 0];
  const auto it = paths.find(op);
  return it == paths.end() ? "unknown" : it->second;
}

void ProcessGroupSDMA::recordPath(const std::string& key, int64_t bytes) {
  std::lock_guard<std::mutex> lock(statsMutex_);
  auto& s = stats_[key];
  s.first += 1;
  s.second += bytes;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::trackCoalesced(c10::intrusive_ptr<c10d::Work> work) {
  if (coalescing_ && work) {
    coalescedWorks_.push_back(work);
  }
  return work;
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::delegate(const CollectiveNames& names, const TracedCollective& traced,
                                                          int64_t bytes, InnerCall&& innerCall) {
  refuseIfDestroyed(names.stats);
  const auto& tensors = traced.inputs.empty() ? traced.outputs : traced.inputs;
  auto& inner = innerFor(tensors, names.stats);
  const bool collective = names.call != CallOp::kNone;
  CollectiveInfo info{};
  bool connects = false;
  if (collective) {
    CallPost post;
    post.op = names.call;
    post.route = inner == innerCuda_ ? CallPost::kInnerCuda : CallPost::kInnerCpu;
    info = describeCall(callOpName(names.call), c10d::OpType::UNKNOWN, options_.timeout, post);
    connects = connectsInnerCollective(names.call, inner);
    postCall(info, /*awaitPeers=*/connects);
  }
  recordPath(std::string("delegated:") + names.stats, bytes);
  return runTraced(traceGroup_, getGroupDesc(), collective ? info.seq : ++p2pSeq_, traced, [&] {
    auto work = innerCall(*inner);
    if (connects) {
      markInnerCollectiveRan(names.call);
    }
    if (collective) {
      work = watchDelegated(info, inner, std::move(work));
    }
    // Inside a coalescing block NCCL collects its own works; gloo's run at once, so endCoalescing must return them.
    return inner == innerCuda_ ? work : trackCoalesced(work);
  });
}

namespace {

// Stats, trace and record_param_comms names of the delegated collectives (the last two as ProcessGroupNCCL names
// them after its "nccl:" prefix).
constexpr CollectiveNames kAllreduce{"allreduce", "all_reduce", "allreduce", CallOp::kAllreduce};
constexpr CollectiveNames kAllreduceSparse{"allreduce_sparse", "all_reduce_sparse", "allreduce_sparse",
                                           CallOp::kAllreduceSparse};
constexpr CollectiveNames kAllreduceCoalesced{"allreduce_coalesced", "allreduce_coalesced", "allreduce_coalesced",
                                              CallOp::kAllreduceCoalesced};
constexpr CollectiveNames kReduce{"reduce", "reduce", "reduce", CallOp::kReduce};
constexpr CollectiveNames kReduceScatter{"reduce_scatter", "reduce_scatter", "reduce_scatter", CallOp::kReduceScatter};
constexpr CollectiveNames kReduceScatterTensor{"reduce_scatter_tensor", "_reduce_scatter_base", "_reduce_scatter_base",
                                               CallOp::kReduceScatterTensor};
constexpr CollectiveNames kReduceScatterTensorCoalesced{
    "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced",
    CallOp::kReduceScatterTensorCoalesced};
constexpr CollectiveNames kBarrier{"barrier", "barrier", "barrier", CallOp::kBarrier};

const std::vector<at::Tensor> kNoTensors;

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  return refusalTakesItsNumber(CallOp::kAllreduce, [&] {
    return delegate(kAllreduce, {kAllreduce, tensors, tensors}, tensorBytes(tensors),
                    [&](c10d::Backend& b) { return b.allreduce(tensors, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                                  const c10d::AllreduceOptions& opts) {
  return delegate(kAllreduceSparse, {kAllreduceSparse, tensors, tensors}, 0,
                  [&](c10d::Backend& b) { return b.allreduce_sparse(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                     const c10d::AllreduceCoalescedOptions& opts) {
  return refusalTakesItsNumber(CallOp::kAllreduceCoalesced, [&] {
    return delegate(kAllreduceCoalesced, {kAllreduceCoalesced, tensors, tensors}, tensorBytes(tensors),
                    [&](c10d::Backend& b) { return b.allreduce_coalesced(tensors, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  return refusalTakesItsNumber(CallOp::kReduce, [&] {
    return delegate(kReduce, {kReduce, tensors, tensors}, tensorBytes(tensors),
                    [&](c10d::Backend& b) { return b.reduce(tensors, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                                const c10d::ReduceScatterOptions& opts) {
  return refusalTakesItsNumber(CallOp::kReduceScatter, [&] {
    return delegate(kReduceScatter, {kReduceScatter, inputs.empty() ? kNoTensors : inputs[0], outputs},
                    tensorBytes(outputs), [&](c10d::Backend& b) { return b.reduce_scatter(outputs, inputs, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                      const c10d::ReduceScatterOptions& opts) {
  const std::vector<at::Tensor> ins{input}, outs{output};
  return refusalTakesItsNumber(CallOp::kReduceScatterTensor, [&] {
    return delegate(kReduceScatterTensor, {kReduceScatterTensor, ins, outs}, tensorBytes(outs),
                    [&](c10d::Backend& b) { return b._reduce_scatter_base(output, input, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return refusalTakesItsNumber(CallOp::kReduceScatterTensorCoalesced, [&] {
    return delegate(kReduceScatterTensorCoalesced, {kReduceScatterTensorCoalesced, inputs, outputs},
                    tensorBytes(outputs),
                    [&](c10d::Backend& b) { return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::barrier(const c10d::BarrierOptions& opts) {
  refuseIfDestroyed("barrier");
  // NCCL's barrier is an all-reduce on a GPU; prefer it when the caller names a GPU or there is no CPU backend.
  const bool onGpu = innerCuda_ && (!innerCpu_ || !opts.device_ids.empty() || (opts.device && opts.device->is_cuda()));
  auto& inner = innerFor(at::Device(onGpu ? at::kCUDA : at::kCPU), "barrier");
  CallPost post;
  post.op = CallOp::kBarrier;
  post.route = onGpu ? CallPost::kInnerCuda : CallPost::kInnerCpu;
  const CollectiveInfo info = describeCall("barrier", c10d::OpType::BARRIER, options_.timeout, post);
  const bool connects = connectsInnerCollective(CallOp::kBarrier, inner);
  postCall(info, /*awaitPeers=*/connects);
  recordPath("delegated:barrier", 0);
  return runTraced(traceGroup_, getGroupDesc(), info.seq, {kBarrier, kNoTensors, kNoTensors}, [&] {
    auto work = inner->barrier(opts);
    if (connects) {
      markInnerCollectiveRan(CallOp::kBarrier);
    }
    return watchDelegated(info, inner, std::move(work));
  });
}

bool ProcessGroupSDMA::connectsInnerCollective(CallOp op, const c10::intrusive_ptr<c10d::Backend>& inner) const {
  return inner && inner == innerCuda_ && !innerCudaOpsUsed_.test(static_cast<size_t>(op));
}

void ProcessGroupSDMA::markInnerCollectiveRan(CallOp op) {
  innerCudaOpsUsed_.set(static_cast<size_t>(op));
}

void ProcessGroupSDMA::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  refuseIfDestroyed("monitored_barrier");
  auto& inner = innerCpu_ ? innerCpu_ : innerFor(at::Device(at::kCUDA), "monitoredBarrier");
  CallPost post;
  post.op = CallOp::kMonitoredBarrier;
  post.route = inner == innerCuda_ ? CallPost::kInnerCuda : CallPost::kInnerCpu;
  postCall(describeCall("monitored_barrier", c10d::OpType::BARRIER, options_.timeout, post), /*awaitPeers=*/false);
  recordPath("delegated:monitoredBarrier", 0);
  inner->monitoredBarrier(opts, waitAllRanks);
}

int64_t ProcessGroupSDMA::collectiveMinBytes(bool cuda) const {
  if (!cuda) {
    return options_.minBytesCpu;
  }
  if (options_.minBytesCuda >= 0) {
    return options_.minBytesCuda;
  }
  return getSize() > 2 ? kManyRanksMinBytesCuda : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// All-gather.

CallPost ProcessGroupSDMA::callPostOf(const CollectiveNames& names, const PlannedAllgather& planned) const {
  const bool cuda = planned.device.is_cuda();
  // What choosePath decides before it asks the runner, from the form, the sizes and the group's settings: alike on
  // every rank that passed the same arguments. The schedule within the DMA route follows from the form alone.
  bool inner = !planned.notForDma.empty() || options_.disable;
  if (!inner && !planned.innerLacksForm) {
    const auto bytes = static_cast<int64_t>(planned.outputBytes);
    inner = (cuda && spansNodes() && bytes < options_.minBytesCudaAcrossNodes) || bytes < collectiveMinBytes(cuda);
  }
  const DevicePath& path = cuda ? cudaPath_ : hostPath_;
  inner = inner || path.decided.isInner();  // connecting failed on every member alike
  CallPost post;
  post.op = names.call;
  post.route =
      cuda ? (inner ? CallPost::kInnerCuda : CallPost::kDmaCuda) : (inner ? CallPost::kInnerCpu : CallPost::kDmaCpu);
  post.dtype = planned.outputs.empty() ? 0 : static_cast<uint8_t>(planned.outputs.front().scalar_type());
  post.bytes = planned.plan.bytesPerRank;
  return post;
}

void ProcessGroupSDMA::connect(const at::Device& device) {
  DevicePath& path = devicePath(device);
  std::string why;
  if (spansNodes()) {
    path.runner = connectHierarchical(device, &why);
  } else {
    path.runner = device.is_cuda() ? connectCopyEngineRunner(sdmaStore_, getRank(), getSize(), device.index(),
                                                             geometry(device), directPathOptions(), &why)
                                   : connectSharedMemoryRunner(sdmaStore_, getRank(), getSize(), geometry(device),
                                                               options_.directCpu, options_.groupName, &why);
  }
  if (path.runner) {
    path.decided = spansNodes() ? CollectivePath::dma("hierarchical") : CollectivePath::dma();
    return;
  }
  path.decided = CollectivePath::inner(why);
  if (path.atCreation.isDma()) {  // otherwise the group's log line already said so
    LOG(WARNING) << "torch_sdma: group '" << options_.groupName << "' sends " << (device.is_cuda() ? "CUDA" : "CPU")
                 << " all-gathers to the inner backend: " << why;
  }
}

std::unique_ptr<CollectiveRunner> ProcessGroupSDMA::connectHierarchical(const at::Device& device, std::string* whyNot) {
  *whyNot = layout_.hierarchyProblem();
  if (!whyNot->empty()) {
    return nullptr;  // the same on every member, as the layout is
  }
  const bool cuda = device.is_cuda();
  const std::string prefix = std::string("hier/") + (cuda ? "cuda" : "cpu") + "/";
  std::unique_ptr<CollectiveRunner> runner;
  if (!railBackends_) {
    *whyNot = "the group was made without a way to create the inner backends of its rails";
  } else {
    HierarchicalSetup setup;
    setup.layout = layout_;
    setup.groupRank = getRank();
    setup.members = members_;
    const int local = setup.localIndex();
    // Each rail is a group of its own over the group's store: rail r's members share "rail/r/".
    setup.rail = railBackends_(
        c10::make_intrusive<c10d::PrefixStore>(prefix + "rail/" + std::to_string(local) + "/", sdmaStore_),
        setup.node(), layout_.nodeCount(), device.type(), options_.timeout,
        options_.groupName + ":rail" + std::to_string(local));
    runner = cuda ? connectHierarchicalCopyEngineRunner(nodeStore(true), device.index(), geometry(device),
                                                        std::move(setup), whyNot)
                  : connectHierarchicalSharedMemoryRunner(nodeStore(false), geometry(device), std::move(setup), whyNot);
  }
  // Each node connected on its own: all must take the path, or none.
  *whyNot = agreeOnPath(*sdmaStore_, prefix + "connected", getRank(), getSize(), *whyNot);
  if (!whyNot->empty()) {
    runner.reset();
  }
  return runner;
}

CollectivePath ProcessGroupSDMA::choosePath(const PlannedAllgather& planned, const CollectiveInfo& info) {
  if (!planned.notForDma.empty()) {
    return CollectivePath::inner(planned.notForDma);
  }
  if (options_.disable) {
    return CollectivePath::inner("TORCH_SDMA_DISABLE=1");
  }
  const bool cuda = planned.device.is_cuda();
  if (!planned.innerLacksForm) {
    const auto bytes = static_cast<int64_t>(planned.outputBytes);
    if (cuda && spansNodes() && bytes < options_.minBytesCudaAcrossNodes) {
      return CollectivePath::inner("below TORCH_SDMA_MIN_BYTES_ACROSS_NODES");
    }
    if (bytes < collectiveMinBytes(cuda)) {
      return CollectivePath::inner("below TORCH_SDMA_MIN_BYTES");
    }
  }
  DevicePath& path = devicePath(planned.device);
  if (path.decided.kind == CollectivePath::Kind::Unknown) {
    // The connect is collective: a peer that made another call would leave this rank waiting in it.
    postCall(info, /*awaitPeers=*/true);
    connect(planned.device);
  }
  if (!path.runner) {
    return path.decided;
  }
  return path.runner->pathFor(planned);
}

template <typename InnerCall>
c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgatherCollective(const CollectiveNames& names, c10d::OpType opType,
                                                                     PlannedAllgather planned,
                                                                     const TracedCollective& traced,
                                                                     const c10d::AllgatherOptions& opts,
                                                                     InnerCall&& innerCall) {
  refuseIfDestroyed(names.stats);
  const CollectiveInfo info = describeCall(
      names.stats, opType, opts.timeout.count() > 0 ? opts.timeout : options_.timeout, callPostOf(names, planned));
  const std::string& connectFailure = devicePath(planned.device).connectFailure;
  TORCH_CHECK(connectFailure.empty(), "torch_sdma: ", info.describe(),
              " refused: an earlier collective on this group failed: ", connectFailure);
  const auto bytes = static_cast<int64_t>(planned.outputBytes);
  // A DMA all-gather of no bytes has no other way to meet its peers, so it waits for their posts: where all agree
  // it is done on every rank, where one passed another size every rank finds it here.
  const bool nothingToMove = info.post.isDma() && planned.plan.bytesPerRank == 0;
  postCall(info, /*awaitPeers=*/nothingToMove);
  if (nothingToMove) {
    recordPath(devicePath(planned.device).decided.isDma() ? devicePath(planned.device).decided.key() : "dma", bytes);
    auto done = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    done->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    return trackCoalesced(c10d::Work::create_from_future(done));
  }
  CollectivePath path;
  try {
    path = choosePath(planned, info);
  } catch (const c10::DistBackendError& e) {
    if (board_ && !board_->failure().empty()) {
      throw;  // the call board's refusal, in its own words
    }
    // A peer that never came to the group's first all-gather, where the transport connects: named in the words
    // a later call's timeout uses. The peers may be anywhere in the connect, so the device's all-gathers end here.
    std::string why = e.what_without_backtrace();
    const std::string prefix = "torch_sdma: ";
    if (why.rfind(prefix, 0) == 0) {
      why = why.substr(prefix.size());
    }
    devicePath(planned.device).connectFailure =
        "torch_sdma: " + info.describe() + " failed while connecting the group: " + why;
    C10_THROW_ERROR(DistBackendError, devicePath(planned.device).connectFailure);
  }
  if (path.isDma()) {
    auto work = runTraced(traceGroup_, getGroupDesc(), info.seq, traced,
                          [&] { return devicePath(planned.device).runner->run(planned, path, opts.asyncOp, info); });
    recordPath(path.key(), bytes);
    return trackCoalesced(work);
  }
  auto& inner = innerFor(planned.device, names.stats);
  const bool connects = connectsInnerCollective(names.call, inner);
  if (connects) {
    awaitPostedPeers(info);
  }
  recordPath(path.key(), bytes);
  // Watched like every delegated collective: a peer that made another call fails it in the board's words, where
  // the inner backend would wait for that peer until its own timeout (NCCL's watchdog then ends the process).
  return runTraced(traceGroup_, getGroupDesc(), info.seq, traced, [&] {
    auto work = innerCall(*inner, InnerOperands(planned.innerGathersBytes));
    if (connects) {
      markInnerCollectiveRan(names.call);
    }
    return watchDelegated(info, inner, std::move(work));
  });
}

namespace {

// The first name is the one sdma's errors use, the others NCCL's profiling title and record_param_comms name.
constexpr CollectiveNames kAllgatherIntoTensor{"all_gather_into_tensor", "_allgather_base", "_allgather_base",
                                               CallOp::kAllgatherIntoTensor};
constexpr CollectiveNames kAllgatherList{"all_gather", "all_gather", "all_gather", CallOp::kAllgather};
constexpr CollectiveNames kAllgatherIntoTensorCoalesced{
    "allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced", "allgather_into_tensor_coalesced",
    CallOp::kAllgatherIntoTensorCoalesced};
constexpr CollectiveNames kAllgatherCoalesced{"allgather_coalesced", "all_gather_coalesced", "allgather_coalesced",
                                              CallOp::kAllgatherCoalesced};

// The outputs as the trace lists them; built only while a profiler listens (the trace is their only reader).
std::vector<at::Tensor> tracedOutputs(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  if (C10_LIKELY(!at::hasCallbacks())) {
    return out;
  }
  for (const auto& l : lists) {
    out.insert(out.end(), l.begin(), l.end());
  }
  return out;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                 const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> ins{input}, outs{output};
  return refusalTakesItsNumber(CallOp::kAllgatherIntoTensor, [&] {
    return allgatherCollective(kAllgatherIntoTensor, c10d::OpType::_ALLGATHER_BASE,
                               planAllgatherIntoTensor(output, input, getRank(), getSize()),
                               {kAllgatherIntoTensor, ins, outs}, opts,
                               [&](c10d::Backend& b, const InnerOperands& operands) {
                                 at::Tensor out = operands(output), in = operands(input);
                                 return b._allgather_base(out, in, opts);
                               });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> outs = tracedOutputs(outputs);
  return refusalTakesItsNumber(CallOp::kAllgather, [&] {
    return allgatherCollective(kAllgatherList, c10d::OpType::ALLGATHER,
                               planAllgatherList(outputs, inputs, getRank(), getSize()), {kAllgatherList, inputs, outs},
                               opts, [&](c10d::Backend& b, const InnerOperands& operands) {
                                 auto outs = operands(outputs);
                                 auto ins = operands(inputs);
                                 return b.allgather(outs, ins, opts);
                               });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                 std::vector<at::Tensor>& inputs,
                                                                                 const c10d::AllgatherOptions& opts) {
  return refusalTakesItsNumber(CallOp::kAllgatherIntoTensorCoalesced, [&] {
    return allgatherCollective(kAllgatherIntoTensorCoalesced, c10d::OpType::COALESCED,
                               planAllgatherIntoTensorCoalesced(outputs, inputs, getRank(), getSize()),
                               {kAllgatherIntoTensorCoalesced, inputs, outputs}, opts,
                               [&](c10d::Backend& b, const InnerOperands& operands) {
                                 auto outs = operands(outputs);
                                 auto ins = operands(inputs);
                                 return b.allgather_into_tensor_coalesced(outs, ins, opts);
                               });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                     std::vector<at::Tensor>& inputs,
                                                                     const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> outs = tracedOutputs(outputLists);
  return refusalTakesItsNumber(CallOp::kAllgatherCoalesced, [&] {
    return allgatherCollective(kAllgatherCoalesced, c10d::OpType::ALLGATHER_COALESCED,
                               planAllgatherCoalesced(outputLists, inputs, getRank(), getSize()),
                               {kAllgatherCoalesced, inputs, outs}, opts,
                               [&](c10d::Backend& b, const InnerOperands& operands) {
                                 auto outs = operands(outputLists);
                                 auto ins = operands(inputs);
                                 return b.allgather_coalesced(outs, ins, opts);
                               });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Control.

void ProcessGroupSDMA::startCoalescing() {
  refuseIfDestroyed("coalescing");
  if (innerCuda_) {
    innerCuda_->startCoalescing();  // first: where it throws, this group has not begun a block either
  }
  coalescing_ = true;
  coalescedWorks_.clear();
  p2pBatchFailure_ = nullptr;
  p2pBatchRefusal_.clear();
  self_.beginBatch();
  beginP2pBatch();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupSDMA::endCoalescing() {
  // The block ends here whatever throws below, on this group and on the inner backend alike: a block left open would
  // collect the next lone call into a batch that never runs.
  coalescing_ = false;
  if (p2pBatchFailure_) {
    failP2pBatch();
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> parts;
  parts.swap(coalescedWorks_);
  std::exception_ptr failed;
  std::string why;
  try {
    if (auto batch = endP2pBatch()) {
      parts.push_back(std::move(batch));
    }
  } catch (const std::exception& e) {
    failed = std::current_exception();
    why = std::string("the batch it was posted in failed: ") + e.what();
  }
  if (innerCuda_) {
    try {
      if (auto innerWork = innerCuda_->endCoalescing()) {
        parts.push_back(std::move(innerWork));
      }
    } catch (const std::exception& e) {
      if (!failed) {
        failed = std::current_exception();
        why = std::string("the inner backend failed the batch it was posted in: ") + e.what();
      }
    }
  }
  if (failed) {
    self_.dropBatch(why);
    std::rethrow_exception(failed);
  }
  self_.commitBatch();
  if (parts.empty()) {
    return nullptr;
  }
  if (parts.size() == 1) {
    return parts[0];
  }
  return c10::make_intrusive<CoalescedWork>(std::move(parts));
}

bool ProcessGroupSDMA::supportsTensorAlloc(c10::DeviceIndex deviceIdx) {
#ifdef TORCH_SDMA_CUDA
  return options_.directCuda && deviceIdx >= 0;
#else
  (void)deviceIdx;
  return false;
#endif
}

at::Tensor ProcessGroupSDMA::allocateTensor(long size, at::TensorOptions options) {
  TORCH_CHECK_VALUE(options.has_device() && options.device().is_cuda(),
                    "torch_sdma allocates communication buffers on CUDA devices only");
#ifdef TORCH_SDMA_CUDA
  const int device = options.device().has_index() ? options.device().index() : c10::cuda::current_device();
  TORCH_CHECK(supportsTensorAlloc(static_cast<c10::DeviceIndex>(device)),
              "torch_sdma allocates communication buffers only where the direct path is on (TORCH_SDMA_DIRECT)");
  if (!commBuffers_) {
    commBuffers_ = std::make_unique<CommBufferPool>(device);
  }
  TORCH_CHECK(commBuffers_->device() == device, "torch_sdma: the group's communication buffers are on GPU ",
              commBuffers_->device(), " but an allocation was requested on GPU ", device);
  return commBuffers_->allocate(size, options);
#else
  TORCH_CHECK(false, "torch_sdma was built without CUDA: it allocates no communication buffers");
#endif
}

bool ProcessGroupSDMA::supportsSplitting() const {
  return innerCuda_ && innerCuda_->supportsSplitting();
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupSDMA::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                          const std::vector<int>& ranks,
                                                          const c10::intrusive_ptr<Options>& opts) {
  // One object may be registered for two device types; ProcessGroup::splitGroup then asks it twice.
  auto cached = splits_.find(opts->group_name);
  if (cached != splits_.end()) {
    return cached->second;
  }
  c10::intrusive_ptr<c10d::Backend> cuda, cpu;
  if (innerCuda_ && innerCuda_->supportsSplitting()) {
    cuda = innerCuda_->split(c10::make_intrusive<c10d::PrefixStore>("nccl/", store), ranks, opts);
  }
  if (innerCpu_ && innerCpu_->supportsSplitting()) {
    cpu =
        innerCpu_->split(c10::make_intrusive<c10d::PrefixStore>("gloo/", store), ranks, innerCpu_->getBackendOptions());
  }
  c10::intrusive_ptr<c10d::Backend> result;
  const auto me = std::find(ranks.begin(), ranks.end(), getRank());
  if (me != ranks.end()) {
    SdmaOptions child = options_;
    child.timeout = opts->timeout;
    child.groupName = opts->group_name;
    child.globalRanks.clear();
    for (int r : ranks) {
      child.globalRanks.push_back(options_.globalRanks.empty() ? r : options_.globalRanks.at(r));
    }
    result = c10::make_intrusive<ProcessGroupSDMA>(
        c10::make_intrusive<c10d::PrefixStore>(opts->group_name + "/", store), static_cast<int>(me - ranks.begin()),
        static_cast<int>(ranks.size()), std::move(child), cpu, cuda, cudaUnavailable_, railBackends_);
  }
  splits_[opts->group_name] = result;
  return result;
}

void ProcessGroupSDMA::setSequenceNumberForGroup() {
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->setSequenceNumberForGroup();
    }
  }
}

uint64_t ProcessGroupSDMA::getSequenceNumberForGroup() {
  return seq_;
}

void ProcessGroupSDMA::eagerConnectSingleDevice(at::Device device) {
  if (device.is_cuda() && innerCuda_) {
    innerCuda_->eagerConnectSingleDevice(device);
  }
}

void ProcessGroupSDMA::setTimeout(std::chrono::milliseconds timeout) {
  options_.timeout = timeout;
  sdmaStore_->setGroupTimeout(timeout);
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      try {
        (*inner)->setTimeout(timeout);
      } catch (const c10::Error&) {
        // torch < 2.14 gloo has no setTimeout; our own collectives still use the new value.
      }
    }
  }
}

void ProcessGroupSDMA::abort() {
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->abort();
    }
  }
}

void ProcessGroupSDMA::refuseIfDestroyed(const char* op) const {
  // After shutdown the inner backends are gone too; calling into them crashes the process.
  TORCH_CHECK_VALUE(!destroyed_, "torch_sdma: ", op, " on group '", options_.groupName,
                    "', which was destroyed (destroy_process_group); collectives need a group that is still alive");
}

void ProcessGroupSDMA::shutdown() {
  destroyed_ = true;
  delegatedWatch_.reset();  // before the inner backends it may abort go
  // The runners' destructors wait for collectives in flight (bounded by the timeout), then free staging.
  for (auto* path : {&cudaPath_, &hostPath_}) {
    path->runner.reset();
    path->p2p.reset();
  }
  for (auto* inner : {&innerCpu_, &innerCuda_}) {
    if (*inner) {
      (*inner)->shutdown();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Introspection.

std::map<std::string, std::pair<int64_t, int64_t>> ProcessGroupSDMA::stats() const {
  std::lock_guard<std::mutex> lock(statsMutex_);
  return stats_;
}

DirectPairCounts ProcessGroupSDMA::runnerDirectPairs() const {
  return cudaPath_.runner ? cudaPath_.runner->directPairs() : DirectPairCounts{};
}

void ProcessGroupSDMA::resetStats() {
  const DirectPairCounts now = runnerDirectPairs();
  std::lock_guard<std::mutex> lock(statsMutex_);
  stats_.clear();
  pairsAtReset_ = now;
}

DirectPairCounts ProcessGroupSDMA::directPairs() const {
  const DirectPairCounts now = runnerDirectPairs();
  std::lock_guard<std::mutex> lock(statsMutex_);
  return now.since(pairsAtReset_);
}

CollectivePath ProcessGroupSDMA::pathFor(c10::DeviceType device) const {
  if (options_.disable) {
    return CollectivePath::inner("TORCH_SDMA_DISABLE=1");
  }
  return device == c10::DeviceType::CUDA ? cudaPath_.decided : hostPath_.decided;
}

CollectivePath ProcessGroupSDMA::creationVerdict(c10::DeviceType device) const {
  return device == c10::DeviceType::CUDA ? cudaPath_.atCreation : hostPath_.atCreation;
}

std::string ProcessGroupSDMA::nodeLayoutDescription() const {
  return spansNodes() ? layout_.describe() : "";
}

int64_t ProcessGroupSDMA::sumOverRunners(size_t (CollectiveRunner::*bytes)() const) const {
  int64_t b = 0;
  for (const DevicePath* path : {&cudaPath_, &hostPath_}) {
    if (path->runner) {
      b += static_cast<int64_t>(((*path->runner).*bytes)());
    }
  }
  return b;
}

int64_t ProcessGroupSDMA::stagingBytesInUse() const {
  return sumOverRunners(&CollectiveRunner::stagingBytes);
}

int64_t ProcessGroupSDMA::peerMappedBytes() const {
  return sumOverRunners(&CollectiveRunner::peerMappedBytes);
}

}  // namespace sdma
