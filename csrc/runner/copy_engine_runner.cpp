#include "runner/copy_engine_runner.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Logging.h>

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "collective/captured_allgather.hpp"
#include "collective/direct_exchange.hpp"
#include "collective/fault_release.hpp"
#include "collective/hierarchical_allgather.hpp"
#include "collective/rank_list.hpp"
#include "collective/relayed_broadcast.hpp"
#include "collective/staging_allgather.hpp"
#include "runner/async_error_exit.hpp"
#include "runner/captured_lanes.hpp"
#include "runner/graph_held_transports.hpp"
#include "runner/kept_for_life.hpp"
#include "runner/size_mismatch.hpp"
#include "runner/test_faults.hpp"
#include "transport/peer_rendezvous.hpp"
#include "work/gpu_work.hpp"

namespace sdma {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(5);
// How often an idle watchdog reads whether a peer failed the group, so that it fails it too (docs/design.md,
// "Failures"): the peers' lanes may be waiting for this rank's release.
constexpr auto kIdlePoll = std::chrono::milliseconds(50);

// Before a collective has been pending this long, peers are not checked for liveness (it costs syscalls).
constexpr auto kLivenessCheckAfter = std::chrono::milliseconds(1000);
// Staging grows in powers of two from here, so a group connects a handful of times at most.
constexpr size_t kSmallestSegment = size_t{1} << 20;

// What a failure that keeps the process adds to its words.
constexpr const char* kAfterFailure =
    " This group runs no further collectives; its GPU streams run on until every peer has failed it too.";

// The largest chunk `plan` is cut into at `geometry` (a message smaller than a segment is one chunk of its size).
size_t largestChunk(const AllgatherPlan& plan, const StagingGeometry& geometry) {
  return std::max(kPageBytes, std::min(chunkBytesFor(plan, geometry), roundUp(plan.bytesPerRank, kPageBytes)));
}

}  // namespace

std::string copyEnginePathProblem(c10d::Store& store, int rank, int size) {
  return CopyEngineTransport::checkGroupReachable(store, "ce/create", rank, size, c10::cuda::current_device());
}

std::unique_ptr<CollectiveRunner> connectCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int size, int device, const StagingGeometry& geometry,
                                                          const DirectPathOptions& direct, std::string* whyNot) {
  c10::cuda::CUDAGuard guard(device);
  std::vector<MemberIdentity> members;
  *whyNot = CopyEngineTransport::checkGroupReachable(*store, "ce/connect", rank, size, device, &members);
  if (!whyNot->empty()) {
    return nullptr;
  }
  // Every member must choose the same path for every all-gather, so one member without the direct path (its own
  // pg_options, or expandable segments in its allocator) keeps the whole group on staging.
  DirectPathOptions agreed = direct;
  agreed.enabled = agreeOnPath(*store, "ce/direct", rank, size, direct.enabled ? "" : "off").empty();
  return std::make_unique<CopyEngineRunner>(store, rank, size, device, std::move(members), geometry, agreed);
}

bool cachingAllocatorUsesExpandableSegments() {
  // The parsed settings themselves: CUDAAllocatorConfig::expandable_segments() is inline and, compiled outside
  // torch's own build (without PYTORCH_C10_DRIVER_API_SUPPORTED), always says false.
  return c10::CachingAllocator::AcceleratorAllocatorConfig::use_expandable_segments();
}

std::unique_ptr<CollectiveRunner> connectHierarchicalCopyEngineRunner(const c10::intrusive_ptr<c10d::Store>& nodeStore,
                                                                      int device, const StagingGeometry& nodeGeometry,
                                                                      HierarchicalSetup setup, std::string* whyNot) {
  c10::cuda::CUDAGuard guard(device);
  std::vector<MemberIdentity> nodeMembers;
  *whyNot = CopyEngineTransport::checkGroupReachable(*nodeStore, "ce/connect", setup.localIndex(),
                                                     setup.layout.ranksPerNode(), device, &nodeMembers);
  if (!whyNot->empty()) {
    return nullptr;
  }
  return std::make_unique<CopyEngineRunner>(nodeStore, device, std::move(nodeMembers), nodeGeometry, std::move(setup));
}

CopyEngineRunner::CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
                                   std::vector<MemberIdentity> members, const StagingGeometry& cap,
                                   const DirectPathOptions& direct)
    : CopyEngineRunner(std::move(store), rank, size, device, std::move(members), cap, nullptr, direct) {}

CopyEngineRunner::CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int device,
                                   std::vector<MemberIdentity> nodeMembers, const StagingGeometry& cap,
                                   HierarchicalSetup setup)
    // A copy of `setup`, not a move: the same argument list reads it, in an order C++ leaves open.
    : CopyEngineRunner(std::move(store), setup.localIndex(), setup.layout.ranksPerNode(), device,
                       std::move(nodeMembers), cap, std::make_shared<const HierarchicalSetup>(setup),
                       DirectPathOptions{}) {}

CopyEngineRunner::CopyEngineRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int size, int device,
                                   std::vector<MemberIdentity> members, const StagingGeometry& cap,
                                   std::shared_ptr<const HierarchicalSetup> hierarchy, const DirectPathOptions& direct)
    : store_(std::move(store)),
      rank_(rank),
      size_(size),
      device_(device),
      members_(std::move(members)),
      cap_(cap),
      injectWatchdogFault_(testFaultRequested("watchdog")),
      hierarchy_(std::move(hierarchy)),
      directOptions_(direct) {
  c10::cuda::CUDAGuard guard(device_);
  pushStream_ = gpu::createStream();
  drainStream_ = gpu::createStream();
  if (hierarchy_) {
    networkStream_ = gpu::createStream();
  }
  callerReady_ = gpu::createEvent();
  pushDone_ = gpu::createEvent();
  if (gpu::streamMemOpsUnavailableReason().empty()) {
    endedHost_ = static_cast<uint32_t*>(gpu::mallocMappedHost(sizeof(uint32_t), &endedDevice_));
  }
  capturedLanes_ = std::make_unique<CapturedLanes>();
  {
    c10d::PrefixStore faultStore("faults/", store_);
    faultBoardRegion_ =
        GroupRegion(faultStore, "board", rank_, size_, GroupFaultBoard::bytesFor(size_), "the board of failures");
    faultBoard_ = std::make_unique<GroupFaultBoard>(faultBoardRegion_.data(), rank_, size_);
    peerGone_.assign(size_, false);
    peerReleased_.assign(size_, false);
  }
  watchdog_ = GuardedThread(
      [this] {
        gpu::ignoreOtherThreadsCaptures();
        watchdogLoop();
      },
      [this](const std::string& why) { abandonInFlight(why); });
}

CopyEngineRunner::~CopyEngineRunner() {
  const bool lanesRanOut = drainOnShutdown();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.happened()) {
      faultBoard_->publishLeft();
    }
  }
  watchdog_.stopAndJoin(mutex_, wake_, stop_);
  if (hierarchy_) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool failed = failure_.happened();
    lock.unlock();
    hierarchy_->closeRail(failed);
  }
  c10::cuda::CUDAGuard guard(device_);
  freeTransportsOfDestroyedGraphs();
  // A graph that captured a collective of the group holds its transport for as long as it may replay.
  captured_.reset();
  if (!lanesRanOut) {
    // Lanes of this group may still wait on its flags or copy through its mappings: they stay for the life of the
    // process, with the streams they run on.
    LOG(ERROR) << "torch_sdma: a failed group was destroyed before every peer released it; its GPU memory ("
               << stagingBytes() << " bytes of staging) stays mapped for the life of the process";
    keepForLife(staging_, staging_ ? staging_->geometry().bytes() : 0);
    keepForLife(std::shared_ptr<CopyEngineDirect>(std::move(direct_)), 0);
    keepForLife(railStaging_, 0);
    return;  // endedHost_ too, which a lane may still write
  }
  gpu::freeMappedHost(endedHost_);
  for (gpu::Event e : {callerReady_, pushDone_}) {
    gpu::destroyEvent(e);
  }
  // The gather buffers and the direct path's mappings go before the streams that may still name them (nothing is
  // in flight any more).
  railStaging_.reset();
  direct_.reset();
  for (gpu::Stream s : {pushStream_, drainStream_, networkStream_}) {
    if (s) {
      gpu::destroyStream(s);
    }
  }
  for (gpu::Stream s : peerLanes_) {
    gpu::destroyStream(s);
  }
}

size_t CopyEngineRunner::stagingBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return (staging_ ? staging_->geometry().bytes() : 0) + (captured_ ? captured_->geometry().bytes() : 0) +
         (direct_ ? direct_->heldBytes() : 0);
}

size_t CopyEngineRunner::peerMappedBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return direct_ ? direct_->peerMappedBytes() : 0;
}

DirectPairCounts CopyEngineRunner::directPairs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!direct_) {
    return {};
  }
  const ArrivalMailbox::PairTally tally = direct_->pairs();
  return {tally.eachPushingOwn, tally.oneLate};
}

CollectivePath CopyEngineRunner::pathFor(const PlannedAllgather& planned) {
  if (planned.device.index() != device_) {
    return CollectivePath::inner("tensor on another GPU than the group's first all-gather");
  }
  if (gpu::streamCapturing(c10::cuda::getCurrentCUDAStream(device_).stream())) {
    if (hierarchy_) {
      return CollectivePath::inner("the hierarchical path is not captured into CUDA graphs yet");
    }
    return CollectivePath::dma(CollectivePath::kCaptured);
  }
  if (hierarchy_) {
    return CollectivePath::dma("hierarchical");
  }
  // The same choice on every member: it depends on the form and the knob only, never on this rank's buffers (an
  // all-gather of no bytes never comes here: the backend settles it on the call board).
  if (directOptions_.enabled && planned.plan.outputBase) {
    return CollectivePath::dma(CollectivePath::kDirect);
  }
  return CollectivePath::dma();
}

int CopyEngineRunner::groupRankOf(int member) const {
  return hierarchy_ ? hierarchy_->layout.rankAt(hierarchy_->node(), member) : member;
}

size_t CopyEngineRunner::chunksOf(const AllgatherPlan& plan, const CopyEngineTransport& transport) const {
  if (!hierarchy_) {
    return chunkCount(plan, transport.geometry());
  }
  return hierarchicalChunkCount(plan, transport.geometry(), hierarchy_->layout.nodeCount());
}

c10::intrusive_ptr<c10d::Store> CopyEngineRunner::nextConnectionStore() {
  return c10::make_intrusive<c10d::PrefixStore>("ce/" + std::to_string(connections_++) + "/", store_);
}

std::unique_ptr<CopyEngineTransport> CopyEngineRunner::connectTransport(const StagingGeometry& geometry) {
  return CopyEngineTransport::connect(*nextConnectionStore(), rank_, size_, device_, geometry, members_);
}

size_t CopyEngineRunner::segmentBytesFor(const AllgatherPlan& plan) const {
  return hierarchy_ ? std::max(kPageBytes, hierarchicalSegmentBytes(plan, cap_, hierarchy_->layout.nodeCount()))
                    : largestChunk(plan, cap_);
}

bool CopyEngineRunner::stagingMustGrow(const AllgatherPlan& plan) const {
  return !staging_ || staging_->geometry().chunkBytes < segmentBytesFor(plan);
}

CopyEngineTransport& CopyEngineRunner::stagingFor(const AllgatherPlan& plan) {
  const size_t needed = segmentBytesFor(plan);
  if (stagingMustGrow(plan)) {
    size_t segment = kSmallestSegment;
    while (segment < needed) {
      segment *= 2;
    }
    StagingGeometry g = cap_;
    g.chunkBytes = std::min(segment, cap_.chunkBytes);
    // The outgrown transport stays alive as long as a collective in flight holds it.
    staging_ = connectTransport(g);
    if (hierarchy_) {
      railStaging_ = std::make_shared<GpuRailAllgather>(*staging_, hierarchy_, device_, networkStream_);
    }
    chunks_ = 0;
  }
  return *staging_;
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::run(PlannedAllgather& planned, const CollectivePath& path,
                                                     bool asyncOp, const CollectiveInfo& info) {
  const AllgatherPlan& plan = planned.plan;
  c10::cuda::CUDAGuard guard(device_);
  gpu::Stream caller = c10::cuda::getCurrentCUDAStream(device_).stream();
  // One enqueue at a time, in call order. Waits on the peers' CPUs (the call board, the mailbox, a connect) hold only
  // enqueueMutex_; mutex_, which the watchdog needs, is held from the last look at the group's failure through the
  // enqueue of the GPU work, so that a failure either refuses the call or finds it in flight.
  std::lock_guard<std::mutex> enqueue(enqueueMutex_);
  refuseIfFailed(info);
  // A call that connects memory meets its peers on the call board first, without mutex_: a rank with another call
  // would connect alone.
  if (path.isCaptured() ? !captured_ : path.isDirect() ? !direct_ : stagingMustGrow(plan)) {
    meetPeersBeforeConnecting(info);
  }
  if (path.isCaptured()) {  // pathFor asked the driver about this stream a moment ago
    return enqueueCaptured(planned, info, caller);
  }
  if (path.isDirect()) {
    return enqueueDirect(planned, asyncOp, info, caller);
  }
  CopyEngineTransport& transport = stagingFor(plan);
  std::unique_lock<std::mutex> lock(mutex_);
  failure_.refuse(info);  // the group failed while this call waited on its peers: nothing of it is enqueued
  const bool pipelined = chunksOf(plan, transport) > 1;

  // One chunk needs no second lane: everything on one stream, the fewest calls. Several chunks: pushes run on
  // their own stream so that the next chunk's push overlaps this chunk's drain.
  gpu::Stream drain = asyncOp ? drainStream_ : caller;
  gpu::Stream push = pipelined ? pushStream_ : drain;
  forkFromCaller(caller, push, drain);
  transport.bindLanes(push, drain);
  const auto first = static_cast<uint32_t>(chunks_ + 1);
  if (hierarchy_) {
    // Every gather is awaited on the push lane, which the drain lane joins below: the end event covers them too.
    scheduleHierarchicalAllgather(transport, *railStaging_, hierarchy_->layout, plan, chunks_);
  } else {
    scheduleStagingAllgather(transport, plan, chunks_);
  }
  transport.flush();
  if (push != drain) {
    gpu::recordEvent(pushDone_, push);
    gpu::streamWaitEvent(drain, pushDone_);
  }
  InFlight inFlight;
  inFlight.info = info;
  inFlight.transport = staging_;
  inFlight.rail = railStaging_;
  inFlight.firstSerial = first;
  inFlight.lastSerial = static_cast<uint32_t>(chunks_);
  return track(operandsOf(planned), asyncOp, drain, std::move(inFlight), lock);
}

void CopyEngineRunner::refuseIfFailed(const CollectiveInfo& info) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = info.timeout;
  if (!failure_.happened()) {
    const int q = faultBoard_->firstFailedPeer();
    if (q >= 0) {
      failGroupLocked(peerFailure(q));
    }
  }
  failure_.refuse(info);
}

std::string CopyEngineRunner::exitedPeer() const {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && !processAlive(members_[q].pid)) {
      return "group rank " + std::to_string(groupRankOf(q)) + " (pid " + std::to_string(members_[q].pid) + ") exited";
    }
  }
  return "";
}

std::string CopyEngineRunner::peerFailure(int q) const {
  return "group rank " + std::to_string(groupRankOf(q)) + " failed the group: " + faultBoard_->reasonOf(q);
}

void CopyEngineRunner::refuseCall(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failGroupLocked(reason);
  }
  C10_THROW_ERROR(DistBackendError, "torch_sdma: " + reason);
}

void CopyEngineRunner::meetPeersBeforeConnecting(const CollectiveInfo& info) {
  if (!info.board) {
    return;
  }
  std::string reason;
  try {
    const CallBoard::Differing d =
        info.board->awaitPeers(info.seq, info.post, info.timeout, [this] { return exitedPeer(); });
    if (!d) {
      return;
    }
    // Nothing enqueued here; a peer that did not read this rank's post sees the other call in its watchdog.
    reason = info.describe() + " failed: " + info.board->describe(info.seq, info.post, d);
  } catch (const CallBoard::PeerNeverPosted& e) {
    reason = info.describe() + " timed out after " + std::to_string(e.waited.count()) +
             " ms waiting for group ranks [" + std::to_string(groupRankOf(e.peer)) + "], which never reached it";
  } catch (const std::exception& e) {
    reason = info.describe() + " failed: " + e.what();
  }
  info.board->fail(info.seq, reason);
  refuseCall(reason);
}

void CopyEngineRunner::forkFromCaller(gpu::Stream caller, gpu::Stream push, gpu::Stream drain) {
  if (drain != caller || push != caller) {
    gpu::recordEvent(callerReady_, caller);
    if (drain != caller) {
      gpu::streamWaitEvent(drain, callerReady_);
    }
    if (push != caller && push != drain) {
      gpu::streamWaitEvent(push, callerReady_);
    }
  }
  if (callOrder_.mustWaitForPrevious(drain)) {
    gpu::streamWaitEvent(drain, previous_->endEvent());
  }
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::track(Operands planned, bool asyncOp, gpu::Stream drain,
                                                       InFlight inFlight, std::unique_lock<std::mutex>& lock) {
  gpu::Event end = endEvents_->take();
  gpu::recordEvent(end, drain);
  if (endedHost_ && inFlight.endedSerial == 0) {  // not written with the schedule's flag operations
    inFlight.endedSerial = ++endedSerial_;
    const gpu::FlagOp ended{true, static_cast<uint32_t*>(endedDevice_), inFlight.endedSerial};
    gpu::flagOps(drain, &ended, 1);
  }
  auto completion = std::make_shared<GpuCompletion>(
      end, endEvents_,
      // A synchronous call ran on the caller's stream, which orders the allocator for us; an async one may
      // outlive the caller's references, so it keeps the tensors until the copies are done.
      asyncOp ? std::move(planned.keepAlive) : std::vector<at::Tensor>{});
  auto work = c10::make_intrusive<GpuWork>(inFlight.info, planned.device, std::move(planned.outputs), completion);
  callOrder_.ended(drain);
  previous_ = completion;
  // The watchdog polls slowly only while nothing is in flight; otherwise it polls on its own, and a
  // wake-up per call would cost the caller a futex syscall.
  const bool watchdogAsleep = inFlight_.empty();
  inFlight.completion = std::move(completion);
  inFlight.enqueuedAt = std::chrono::steady_clock::now();
  inFlight_.push_back(std::move(inFlight));
  lock.unlock();
  if (watchdogAsleep) {
    wake_.notify_one();
  }
  return work;
}

CopyEngineDirect& CopyEngineRunner::directPath() {
  if (!direct_) {
    // Every member makes its first direct collective together, so they connect here together.
    direct_ = std::make_unique<CopyEngineDirect>(store_, rank_, size_, device_, members_, directOptions_);
  }
  return *direct_;
}

template <typename Arrive>
CopyEngineDirect::Arrival CopyEngineRunner::arriveOrRefuse(std::vector<at::Tensor>& keepAlive,
                                                           const CollectiveInfo& info, Arrive&& arrive) {
  try {
    return arrive();
  } catch (const SizeMismatch& e) {
    // Nothing enqueued here; a peer that did not read this rank's post sees the mismatch in its watchdog, in the
    // call board's words where the board still shows the peer's post. A peer that read the post may copy with these
    // buffers once this failure released it.
    keepTensorsForLife(std::move(keepAlive));
    const std::string board = info.callMismatch();
    refuseOnBoard(info, info.describe() + " failed: " + (board.empty() ? e.describe(rank_) : board));
  } catch (const RangeMismatch& e) {
    // The same for an exchange's pair: the peer that read this rank's post finds it too; one that did not learns it
    // from the board of failures.
    keepTensorsForLife(std::move(keepAlive));
    refuseOnBoard(info, info.describe() + " failed: " + e.what());
  } catch (const std::exception& e) {
    // Posted or not, this rank's part of the pairing is lost: the group fails, and its buffers stay for any peer
    // that read the post.
    keepTensorsForLife(std::move(keepAlive));
    refuseCall(info.describe() + " failed: " + messageOf(e));
  }
}

void CopyEngineRunner::refuseOnBoard(const CollectiveInfo& info, const std::string& reason) {
  if (info.board) {
    info.board->fail(info.seq, reason);
  }
  refuseCall(reason);
}

template <typename Schedule>
c10::intrusive_ptr<c10d::Work> CopyEngineRunner::enqueueArrived(CopyEngineDirect::Arrival& arrival, Operands operands,
                                                                bool asyncOp, const CollectiveInfo& info,
                                                                gpu::Stream caller, int peerLanes,
                                                                Schedule&& schedule) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (failure_.happened()) {
    // Failed while this rank posted its buffers: a peer that read the post may copy with them once released.
    keepTensorsForLife(std::move(operands.keepAlive));
    failure_.refuse(info);
  }
  // Pushes over the links on the Push lane (the push stream, or `peerLanes` streams); pulls over them on the Drain
  // lane.
  gpu::Stream drain = asyncOp ? drainStream_ : caller;
  forkFromCaller(caller, pushStream_, drain);
  // Each stream beyond the queues' count shares a queue, where one lane's wait on a late peer holds the others behind
  // it: a quarter of the queues at most, leaving the rest to the caller's streams and the other groups. The same count
  // for every call that asks for as many, so that one peer's operations keep one stream from call to call.
  const int lanes = std::min({size_ - 1, peerLanes, gpu::hardwareQueues() / 4});
  while (static_cast<int>(peerLanes_.size()) < lanes) {
    peerLanes_.push_back(gpu::createStream());
  }
  CopyEngineTransport& transport = *arrival.transport;
  transport.bindLanes(pushStream_, drain, lanes > 1 ? peerLanes_.data() : nullptr, lanes);
  const auto serial = static_cast<uint32_t>(arrival.serial);
  schedule(transport, serial);
  uint32_t endedSerial = 0;
  if (endedHost_) {
    // With the Drain lane's last flag operations, after everything of the call on it: no driver call of its own.
    endedSerial = ++endedSerial_;
    transport.writeAfter(Lane::Drain, static_cast<uint32_t*>(endedDevice_), endedSerial);
  }
  transport.flush();
  InFlight inFlight;
  inFlight.transport = std::move(arrival.transport);
  inFlight.info = info;
  inFlight.firstSerial = inFlight.lastSerial = serial;
  inFlight.directSerial = arrival.serial;
  inFlight.endedSerial = endedSerial;
  inFlight.holds = std::move(arrival.holds);
  return track(std::move(operands), asyncOp, drain, std::move(inFlight), lock);
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::enqueueDirect(PlannedAllgather& planned, bool asyncOp,
                                                               const CollectiveInfo& info, gpu::Stream caller) {
  CopyEngineDirect& direct = directPath();
  CopyEngineDirect::Arrival arrival =
      arriveOrRefuse(planned.keepAlive, info, [&] { return direct.arrive(planned.plan, info.timeout); });
  return enqueueArrived(arrival, operandsOf(planned), asyncOp, info, caller, directOptions_.peerLanes,
                        [&](CopyEngineTransport& transport, uint32_t serial) {
                          scheduleDirectAllgather(transport, planned.plan, serial, arrival.posted, arrival.peers);
                        });
}

CollectivePath CopyEngineRunner::pathFor(const PlannedExchange& planned) {
  if (planned.device.index() != device_) {
    return CollectivePath::inner("tensor on another GPU than the group's first collective");
  }
  if (hierarchy_) {
    return CollectivePath::inner("the group spans nodes");
  }
  if (gpu::streamCapturing(c10::cuda::getCurrentCUDAStream(device_).stream())) {
    return CollectivePath::dma(CollectivePath::kCaptured);  // through staging: no direct path needed
  }
  if (!directOptions_.enabled) {
    return CollectivePath::inner("the direct path is off (TORCH_SDMA_DIRECT, or expandable segments)");
  }
  if (size_ > kMaxExchangeRanks) {
    return CollectivePath::inner("a group of more than " + std::to_string(kMaxExchangeRanks) + " ranks");
  }
  return CollectivePath::dma(relayed(planned) ? CollectivePath::kRelayed : CollectivePath::kDirect);
}

bool CopyEngineRunner::relayed(const PlannedExchange& planned) const {
  return planned.broadcast && broadcastIsRelayed(planned.agreedBytes, size_);
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::run(PlannedExchange& planned, bool asyncOp,
                                                     const CollectiveInfo& info) {
  c10::cuda::CUDAGuard guard(device_);
  gpu::Stream caller = c10::cuda::getCurrentCUDAStream(device_).stream();
  std::lock_guard<std::mutex> enqueue(enqueueMutex_);
  refuseIfFailed(info);
  if (gpu::streamCapturing(caller)) {  // pathFor asked the driver about this stream a moment ago
    return enqueueCapturedExchange(planned, info, caller);
  }
  if (!direct_) {
    meetPeersBeforeConnecting(info);
  }
  if (relayed(planned)) {
    char* region = planned.plan.output ? planned.plan.output : const_cast<char*>(planned.plan.input);
    planned.plan = relayedBroadcastPlan(region, planned.agreedBytes, planned.root, rank_, size_);
  }
  if (planned.gather) {
    // Its output list is bounced: pulled into the list's tensors where they lie, the root unpacks nothing it waited
    // for (docs/design.md, "Exchange").
    planned.plan.pullingRoot = planned.root;
  }
  CopyEngineDirect& direct = directPath();
  CopyEngineDirect::Arrival arrival =
      arriveOrRefuse(planned.keepAlive, info, [&] { return direct.arriveExchange(planned.plan, info.timeout); });
  std::vector<ExchangePeer> peers(size_);
  for (int q = 0; q < size_; ++q) {
    peers[q] = {arrival.peers[q], arrival.ranges[q]};
  }
  const int lanes = directOptions_.peerLanes;
  return enqueueArrived(arrival, operandsOf(planned), asyncOp, info, caller, lanes,
                        [&](CopyEngineTransport& transport, uint32_t serial) {
                          scheduleDirectExchange(transport, planned.plan, serial, arrival.posted, peers);
                        });
}

CopyEngineTransport& CopyEngineRunner::capturedTransport() {
  if (!captured_) {
    // Every member captures the same collectives in the same order, so they connect here together.
    captured_ = connectCapturedTransport(*nextConnectionStore(), rank_, size_, device_, cap_, members_);
  }
  return *captured_;
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::enqueueCaptured(PlannedAllgather& planned, const CollectiveInfo& info,
                                                                 gpu::Stream caller) {
  CopyEngineTransport& transport = capturedTransport();
  const bool pipelined = chunkCount(planned.plan, transport.geometry()) > 1;
  return enqueueOnCapturedLanes(caller, pipelined, info, planned.device, std::move(planned.outputs),
                                [&](CopyEngineTransport& t) { scheduleCapturedAllgather(t, planned.plan); });
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::enqueueOnCapturedLanes(
    gpu::Stream caller, bool pipelined, const CollectiveInfo& info, at::Device device, std::vector<at::Tensor> outputs,
    const std::function<void(CopyEngineTransport&)>& schedule) {
  capturedLanes_->run(caller, pipelined, captured_, schedule);
  return capturedWork(caller, endEvents_, info, device, std::move(outputs));
}

void CopyEngineRunner::watchdogLoop() {
  c10::cuda::CUDAGuard guard(device_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    freeTransportsOfDestroyedGraphs();
    if (failure_.happened()) {
      const bool finished = progressAfterFailure(lock);
      wake_.wait_for(lock, finished ? kIdlePoll : kPollInterval);
      continue;
    }
    if (inFlight_.empty()) {
      // Idle, but a peer's failure is looked for: its lanes may wait for this rank to fail and release them.
      wake_.wait_for(lock, kIdlePoll, [this] { return stop_ || !inFlight_.empty() || failure_.happened(); });
      const int q = stop_ || failure_.happened() ? -1 : faultBoard_->firstFailedPeer();
      if (q >= 0) {
        LOG(WARNING) << "torch_sdma: " << peerFailure(q) << "; this rank fails it too";
        failGroupLocked(peerFailure(q));
      }
      continue;
    }
    if (injectWatchdogFault_) {
      throwTestFault("watchdog");
    }
    InFlight oldest = inFlight_.front();
    lock.unlock();
    const bool done = ended(oldest);
    std::string cause;
    if (!done) {
      const auto now = std::chrono::steady_clock::now();
      const int failedPeer = faultBoard_->firstFailedPeer();
      // A peer that posted another size never comes: no point waiting out the timeout for it.
      const std::string mismatch = sizeMismatchOf(oldest);
      if (failedPeer >= 0) {
        cause = "failed: " + peerFailure(failedPeer) + ";";
      } else if (!mismatch.empty()) {
        cause = mismatch;
      } else if (now > oldest.deadline()) {
        cause = "timed out";
      } else if (now - oldest.enqueuedAt > kLivenessCheckAfter) {
        const std::string exited = exitedPeer();
        if (!exited.empty()) {
          cause = "failed: " + exited;
        }
      }
    }
    const std::string reason = cause.empty() ? "" : describeFailure(oldest, cause);
    // The call may have ended while it was described (a late peer came): then it did not fail, and its output,
    // which the caller's stream may already be reading, is complete. Polled before mutex_ is taken, as above.
    const bool endedSince = !reason.empty() && ended(oldest);
    lock.lock();
    // An enqueue that was refused meanwhile may have failed the group: the calls in flight then moved to failed_.
    const bool stillOldest =
        !failure_.happened() && !inFlight_.empty() && inFlight_.front().completion == oldest.completion;
    if (!stillOldest) {
      continue;
    }
    if (done || endedSince) {
      inFlight_.pop_front();
      continue;
    }
    if (!reason.empty()) {
      // Before failGroupLocked publishes the failure, after which the peers release this rank's waits and its
      // streams run on into whatever reads the outputs.
      if (exitsOnAsyncError()) {
        exitOnAsyncError(reason, describeEach(inFlight_));
      }
      LOG(ERROR) << "torch_sdma: " << reason << kAfterFailure;
      failGroupLocked(reason + kAfterFailure);
      continue;
    }
    wake_.wait_for(lock, kPollInterval);
  }
}

bool CopyEngineRunner::ended(const InFlight& call) const {
  if (endedHost_ && call.endedSerial != 0 &&
      !flagReached(__atomic_load_n(endedHost_, __ATOMIC_ACQUIRE), call.endedSerial)) {
    return false;
  }
  return call.completion->pollDone();
}

std::string CopyEngineRunner::describeFailure(const InFlight& stuck, const std::string& cause) {
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - stuck.enqueuedAt);
  // Who reached the call is read from the peers' CPUs, never from the GPU: a read of the flags (driver calls) may wait
  // behind another thread's blocking read of the failed call's output, which waits for the peers, and the exit or the
  // failure would come only once they came. A direct call's peers post in its mailbox before their streams signal
  // anything; every call posts on the call board first. Which peers stalled inside it is not read.
  std::vector<int> neverArrived;
  if (stuck.lastSerial != stuck.firstSerial - 1) {
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        continue;
      }
      const bool arrived = stuck.directSerial != 0 ? direct_->peerReached(q, stuck.directSerial)
                           : stuck.info.board      ? stuck.info.board->reached(q, stuck.info.seq)
                                                   : true;
      if (!arrived) {
        neverArrived.push_back(groupRankOf(q));
      }
    }
  }
  std::ostringstream why;
  why << stuck.info.describe() << " " << cause << " after " << waited.count()
      << " ms; peers that never reached it: " << rankList(neverArrived)
      << " (which peers stalled inside it is not read from the GPU)";
  if (hierarchy_) {
    why << " (of this node; the gathers between nodes run on the NCCL of " << hierarchy_->railName()
        << ", whose own watchdog reports a rank missing there)";
  }
  why << ".";
  return why.str();
}

void CopyEngineRunner::failGroupLocked(const std::string& reason) {
  if (failure_.happened()) {
    return;
  }
  // In this order: no call is enqueued from here on, every call in flight carries the error, and only then do the
  // peers learn of it, so that a peer that reads the failure knows every call of this rank that may still run has
  // failed.
  failure_.record(reason);
  const auto exc = std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + failure_.reason()));
  for (auto& f : inFlight_) {
    f.completion->setError(exc);
    failed_.push_back(std::move(f));
  }
  inFlight_.clear();
  faultBoard_->publishFailed(failure_.reason());
  wake_.notify_all();
}

std::vector<std::pair<std::shared_ptr<CopyEngineTransport>, uint32_t>> CopyEngineRunner::transportsToRelease() const {
  std::vector<std::pair<std::shared_ptr<CopyEngineTransport>, uint32_t>> out;
  if (staging_) {
    out.emplace_back(staging_, static_cast<uint32_t>(chunks_));
  }
  if (direct_) {
    out.emplace_back(direct_->flags(), static_cast<uint32_t>(direct_->lastSerial()));
  }
  return out;
}

bool CopyEngineRunner::progressAfterFailure(std::unique_lock<std::mutex>& lock) {
  // The failed calls whose lanes ran out go, with the tensors they kept; polled without mutex_, since dropping a
  // tensor may take the GIL, which a thread waiting for mutex_ may hold.
  std::vector<std::shared_ptr<GpuCompletion>> pending;
  for (const auto& f : failed_) {
    pending.push_back(f.completion);
  }
  lock.unlock();
  std::vector<bool> ended(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {
    ended[i] = pending[i]->pollDone();
  }
  lock.lock();
  for (size_t i = 0, kept = 0; i < pending.size(); ++i) {
    if (ended[i]) {
      failed_.erase(failed_.begin() + static_cast<std::ptrdiff_t>(kept));
    } else {
      ++kept;
    }
  }
  if (released_) {
    return true;
  }
  std::vector<int> gone, toRelease;
  const bool lanesRanOut = failed_.empty();
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || peerGone_[q] || peerReleased_[q]) {
      continue;
    }
    if (mayPassOwnWaits(/*failed=*/true,
                        !processAlive(members_[q].pid) || faultBoard_->stateOf(q) == GroupFaultBoard::kLeft)) {
      gone.push_back(q);
    } else if (mayReleaseInto(/*failed=*/true, lanesRanOut, faultBoard_->failed(q), /*peerReleasedAlready=*/false)) {
      toRelease.push_back(q);
    }
  }
  if (gone.empty() && toRelease.empty()) {
    return false;
  }
  // What this rank enqueued: an enqueue refused by the failure may still hold enqueueMutex_ for a moment.
  std::unique_lock<std::mutex> enqueue(enqueueMutex_, std::try_to_lock);
  if (!enqueue.owns_lock()) {
    return false;
  }
  const auto transports = transportsToRelease();
  enqueue.unlock();
  lock.unlock();
  // A peer whose process is gone writes nothing more: this rank satisfies its own waits on it. A failed peer gets
  // the values it waits for from this rank once this rank's lanes ran out (every signal of a call it enqueued is
  // then written).
  for (const auto& [transport, last] : transports) {
    for (int q : gone) {
      transport->releaseWaitsOnGonePeer(q, releaseValue(last));
    }
    for (int q : toRelease) {
      transport->releasePeer(q, releaseValue(last));
    }
  }
  lock.lock();
  for (int q : gone) {
    peerGone_[q] = true;
  }
  for (int q : toRelease) {
    peerReleased_[q] = true;
  }
  bool all = lanesRanOut;
  for (int q = 0; q < size_; ++q) {
    all = all && (q == rank_ || peerGone_[q] || peerReleased_[q]);
  }
  if (all) {
    faultBoard_->publishReleased();
    released_ = true;
    wake_.notify_all();  // a destroy may be waiting for it
  }
  return released_;
}

std::string CopyEngineRunner::sizeMismatchOf(const InFlight& inFlight) const {
  // The direct path's mailbox carries the sizes too, but a rank posts on the board first, with the same bytes.
  const std::string words = inFlight.info.callMismatch();
  if (words.empty()) {
    return "";
  }
  // The whole group fails with it, delegated collectives included. Not where the watchdog is about to end the
  // process: a peer that reads this rank's failure mark releases its waits on this rank's point-to-point pairs, and
  // finds it gone a moment later anyway.
  if (!exitsOnAsyncError()) {
    inFlight.info.board->fail(inFlight.info.seq, inFlight.info.describe() + " failed: " + words);
  }
  return "failed: " + words + ",";
}

void CopyEngineRunner::abandonInFlight(const std::string& why) {
  std::deque<InFlight> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (exitsOnAsyncError() && !inFlight_.empty()) {
      exitOnAsyncError("the copy-engine watchdog on GPU " + std::to_string(device_) + " failed: " + why + ".",
                       describeEach(inFlight_));
    }
    failure_.record("its watchdog failed: " + why);
    failed.swap(inFlight_);
    watchdogGone_ = true;
    faultBoard_->publishFailed(failure_.reason());
  }
  LOG(ERROR) << "torch_sdma: the copy-engine watchdog on GPU " << device_ << " failed: " << why << "; " << failed.size()
             << " all-gathers in flight fail with it and the group runs no more";
  for (auto& f : failed) {
    const auto exc = std::make_exception_ptr(C10_BUILD_ERROR(
        DistBackendError, "torch_sdma: " + f.info.describe() + " failed: the group's watchdog thread failed: " + why));
    // Nobody watches these lanes any more: the kept tensors stay for the life of the process.
    f.completion->fail(exc, /*releaseTensors=*/false);
  }
}

bool CopyEngineRunner::drainOnShutdown() {
  // Staging memory is freed after this: no lane of this rank may still wait on it or copy through it.
  while (true) {
    InFlight oldest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_.happened()) {
        break;
      }
      if (inFlight_.empty()) {
        return true;
      }
      oldest = inFlight_.front();
    }
    if (std::chrono::steady_clock::now() > oldest.deadline()) {
      const std::string reason = describeFailure(oldest, "was still pending when the group was destroyed");
      std::lock_guard<std::mutex> lock(mutex_);
      if (exitsOnAsyncError()) {
        exitOnAsyncError(reason, describeEach(inFlight_));
      }
      LOG(ERROR) << "torch_sdma: " << reason << kAfterFailure;
      failGroupLocked(reason + kAfterFailure);
      break;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  // Failed: the watchdog releases the peers once this rank's lanes ran out, which needs the peers to fail too.
  const auto until = std::chrono::steady_clock::now() + std::max(timeout_, std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(mutex_);
  return wake_.wait_until(lock, until, [this] { return released_ || watchdogGone_; }) && released_;
}

}  // namespace sdma
