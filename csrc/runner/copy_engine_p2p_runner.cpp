// The point-to-point runner of CUDA tensors (docs/design.md, "Point-to-point"): per pair of ranks the direct path's
// state of a two-member group (CopyEngineDirect: the Arrived and Done flags, the mailbox, the export of this rank's
// buffers and the mappings of the peer's); two streams of its own for a batch's main lanes, which wait for the caller's
// stream, and a pool of stream pairs from which each peer of a batch takes lanes of its own after the Arrived phase; a
// watchdog that names a peer that never came within the timeout, fails the group, and, once this runner's lanes ran
// out, releases the failed peers' waits on it (docs/design.md, "Failures", applied to the pairs' flags).
//
// The caller never waits on a peer. A batch is posted and enqueued on the caller's thread only where every pair it
// uses is connected, has room in its ring of posts, and no earlier batch is queued; otherwise it queues on this
// runner's posting thread, which connects its pairs (collectively over each pair, within the group's timeout), posts
// it and enqueues it when the peers let it, in call order, behind a fork event recorded on the caller's stream at the
// call. Its Work is then complete only once enqueued and ended, and wait() blocks the CPU until it is enqueued or
// failed. Inside CUDA graph capture a pair's ops take its captured staging instead (captured_p2p_pairs.hpp), connected
// on the caller's thread, which the watchdog never sees.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "collective/direct_p2p_batch.hpp"
#include "runner/async_error_exit.hpp"
#include "runner/captured_p2p_pairs.hpp"
#include "runner/copy_engine_direct.hpp"
#include "runner/graph_held_transports.hpp"
#include "runner/group_failure.hpp"
#include "runner/guarded_thread.hpp"
#include "runner/kept_for_life.hpp"
#include "runner/p2p_runner.hpp"
#include "work/gpu_work.hpp"

namespace sdma {
namespace {

// What a release writes, past any serial the peer may still wait for (docs/design.md, "Failures").
constexpr uint32_t kReleaseAhead = 1u << 30;

// Batches on the lanes not yet seen complete, past which the next one goes to the posting thread. Each puts a few
// operations on the lanes, and a lane whose hardware queue fills behind a wait for a peer blocks the thread that
// enqueues on it until the peer comes (the driver waits for room: 1,100 isends that the peer meets only after a
// collective of its own held the caller there), which must never be the caller's.
constexpr size_t kMaxBatchesOnLanes = 128;

class CopyEngineP2pRunner : public P2pRunner {
 public:
  CopyEngineP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int device, CallBoard* board,
                      DirectPathOptions options, const StagingGeometry& capturedGeometry)
      : store_(std::move(store)), rank_(rank), device_(device), board_(board), options_(options) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    gpu::CaptureRelaxedScope relaxed;  // a group's first op may be a captured one
    push_ = gpu::createStream();
    drain_ = gpu::createStream();
    fork_ = gpu::createEvent();
    joined_ = gpu::createEvent();
    captured_ = std::make_unique<CapturedP2pPairs>(rank_, device_, capturedGeometry);
    watchdog_ = GuardedThread(
        [this] {
          // Its event queries and the frees of graphs' transports must not invalidate a capture on the caller's thread.
          c10::cuda::CUDAGuard watchdogGuard(static_cast<c10::DeviceIndex>(device_));
          gpu::ignoreOtherThreadsCaptures();
          watchdogLoop();
        },
        [this](const std::string& why) { abandon(why); });
    poster_ = GuardedThread(
        [this] {
          c10::cuda::CUDAGuard posterGuard(static_cast<c10::DeviceIndex>(device_));
          // Its connects allocate and map memory, and its enqueues are not captures: neither may invalidate a capture
          // on another thread.
          gpu::ignoreOtherThreadsCaptures();
          posterLoop();
        },
        [this](const std::string& why) { abandon("the point-to-point posting thread failed: " + why); });
  }

  ~CopyEngineP2pRunner() override {
    poster_.stopAndJoin(mutex_, posterWake_, stopPoster_);
    watchdog_.stopAndJoin(mutex_, wake_, stop_);
    std::lock_guard<std::mutex> lock(mutex_);
    if (!inFlight_.empty()) {
      // Lanes that may still copy with the pairs' memory and the callers' tensors, or wait on them: nothing of it
      // goes back.
      for (auto& [peer, pair] : pairs_) {
        keepForLife(std::move(pair.direct), 0);
      }
      for (auto& f : inFlight_) {
        keepForLife(std::move(f.completion), 0);
        for (auto& h : f.holds) {
          keepForLife(std::move(h), 0);
        }
      }
      return;
    }
    gpu::destroyEvent(fork_);
    gpu::destroyEvent(joined_);
    gpu::destroyStream(push_);
    gpu::destroyStream(drain_);
    for (const PeerLanes& lanes : peerLanes_) {
      gpu::destroyStream(lanes.push);
      gpu::destroyStream(lanes.drain);
    }
  }

  // Decided without the peer: the route sends only a group whose members all reach each other (agreed at its
  // creation) here, so both members read the same answer. The eager state connects on the posting thread before the
  // pair's first batch posts; the captured state connects here, collectively over the pair, at its first captured op.
  CollectivePath connectPair(int peer) override {
    TORCH_CHECK_WITH(DistBackendError, failedPairs_.count(peer) == 0, "torch_sdma: ", failedPairs_[peer]);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const int lo = std::min(rank_, peer);
    const int hi = std::max(rank_, peer);
    const int me = rank_ == lo ? 0 : 1;
    // Only this thread adds pairs: reading here needs no lock.
    auto found = pairs_.find(peer);
    if (found == pairs_.end()) {
      Pair pair;
      pair.store = c10::make_intrusive<c10d::PrefixStore>(
          "p2p/cuda/" + std::to_string(lo) + "-" + std::to_string(hi) + "/", store_);
      std::lock_guard<std::mutex> lock(mutex_);  // the watchdog and the posting thread read the pairs
      found = pairs_.emplace(peer, std::move(pair)).first;
    }
    Pair& pair = found->second;
    if (!gpu::streamCapturing(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream())) {
      return CollectivePath::dma(CollectivePath::kDirect);
    }
    // Connecting allocates and maps memory, which a global-mode capture refuses unless this thread relaxes it.
    gpu::CaptureRelaxedScope relaxed;
    try {
      if (!captured_->connected(peer)) {
        if (pair.capturedMembers.empty()) {
          const std::string whyNot = CopyEngineTransport::checkGroupReachable(*pair.store, "reach/captured", me, 2,
                                                                              device_, &pair.capturedMembers);
          if (!whyNot.empty()) {
            pair.capturedMembers.clear();
            return CollectivePath::inner(whyNot);
          }
        }
        captured_->connect(peer, pair.store, pair.capturedMembers);
      }
      return CollectivePath::dma(CollectivePath::kCaptured);
    } catch (const std::exception& e) {
      failedPairs_[peer] = "connecting the pair of group ranks " + std::to_string(lo) + " and " + std::to_string(hi) +
                           " failed: " + messageOf(e);
      throw;
    }
  }

  void refuse(int peer, uint64_t directions, const std::string& why, const CollectiveInfo& info,
              uint64_t nextCollective) override {
    Pair* pair = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto found = pairs_.find(peer);
      if (found == pairs_.end() || failure_.happened()) {
        return;  // no op with the peer yet (the route connects the pair first), or failed already (the peer's fail too)
      }
      pair = &found->second;
      if (!pair->direct || !deferred_.empty() || !pair->direct->roomFor(pair->direct->lastSerial() + 1)) {
        // Its serial comes after the queued batches': the posting thread posts it in turn, then fails the group.
        Deferred d;
        d.info = info;
        d.failAt = nextCollective;
        d.refusal = Refusal{peer, directions, why};
        deferred_.push_back(std::move(d));
        posterWake_.notify_one();
        return;
      }
    }
    postRefusal(*pair, peer, directions, why, info);
    failGroup(nextCollective, info.describe() + " was refused on this rank: " + why);
  }

  c10::intrusive_ptr<c10d::Work> run(std::vector<PairStep> steps, const CollectiveInfo& info,
                                     uint64_t nextCollective) override {
    refuseBatchOfFailedGroup(mutex_, failure_, board_, info);
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    const gpu::Stream caller = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream();
    if (gpu::streamCapturing(caller)) {
      return captured_->enqueue(steps, info, caller,
                                [&](const std::string& reason) { failGroup(nextCollective, reason); });
    }
    auto [outputs, keep] = tensorsOf(steps);
    const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_));
    if (postableNow(steps)) {
      auto completion = std::make_shared<GpuCompletion>(endEvents_->take(), endEvents_, std::move(keep));
      gpu::recordEvent(fork_, caller);
      postAndEnqueue(steps, info, nextCollective, fork_, completion, /*afterReturn=*/false);
      return c10::make_intrusive<GpuWork>(info, device, std::move(outputs), std::move(completion));
    }
    Deferred d;
    d.steps = std::move(steps);
    d.info = info;
    d.failAt = nextCollective;
    // The batch's lanes wait for what the caller's stream holds now, whenever the posting thread enqueues them.
    d.fork = endEvents_->take();
    gpu::recordEvent(d.fork, caller);
    d.completion = std::make_shared<GpuCompletion>(endEvents_->take(), endEvents_, std::move(keep), /*captured=*/false,
                                                   /*enqueued=*/false);
    auto work = c10::make_intrusive<GpuWork>(info, device, std::move(outputs), d.completion);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      deferred_.push_back(std::move(d));
    }
    posterWake_.notify_one();
    return work;
  }

 private:
  struct Refusal {
    int peer = -1;
    uint64_t directions = 0;
    std::string why;
  };
  // A batch (or a refusal) the caller could not post without waiting on a peer: the posting thread's, in call order.
  struct Deferred {
    std::vector<PairStep> steps;
    CollectiveInfo info;
    uint64_t failAt = 0;
    gpu::Event fork = nullptr;  // recorded on the caller's stream at the call; back to the pool once waited on
    std::shared_ptr<GpuCompletion> completion;
    std::optional<Refusal> refusal;
  };

  // Whether the caller may post `steps` now without waiting on a peer: nothing queued before them, every pair
  // connected, and room in each pair's ring for the serials they take.
  bool postableNow(const std::vector<PairStep>& steps) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!deferred_.empty() || !lanesHaveRoomLocked()) {
      return false;
    }
    // The serials a peer's steps take are counted along its run of them.
    const CopyEngineDirect* direct = nullptr;
    uint64_t taken = 0;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (opensPeerRun(steps, i)) {
        direct = pairs_.at(steps[i].peer).direct.get();
        taken = 0;
      }
      if (!direct || !direct->roomFor(direct->lastSerial() + ++taken)) {
        return false;
      }
    }
    return true;
  }

  // Whether fewer than kMaxBatchesOnLanes batches are on the lanes, after dropping those that ended.
  bool lanesHaveRoomLocked() {
    while (inFlight_.size() >= kMaxBatchesOnLanes && inFlight_.front().completion->pollDone()) {
      inFlight_.pop_front();
    }
    return inFlight_.size() < kMaxBatchesOnLanes;
  }

  // Posts every step in its pair's mailbox, then enqueues the batch's schedule on this runner's lanes behind `fork`
  // and records `completion`'s end event. Where a post fails, nothing is enqueued, the batch's tensors are kept for
  // life (a peer that read a post may copy with them until its own failure stops it), the group fails, and this
  // throws DistBackendError. `afterReturn`: on the posting thread, after the call returned, where the default exit
  // comes before the group's failure is on the board (async_error_exit.hpp).
  void postAndEnqueue(const std::vector<PairStep>& steps, const CollectiveInfo& info, uint64_t failAt, gpu::Event fork,
                      const std::shared_ptr<GpuCompletion>& completion, bool afterReturn) {
    const auto failBatch = [&](const std::string& reason) {
      const std::string message = "torch_sdma: " + reason;
      completion->fail(std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, message)), /*releaseTensors=*/false);
      if (afterReturn) {
        exitIfStreamsMayRunOn(reason);
      }
      failGroup(failAt, reason);
      C10_THROW_ERROR(DistBackendError, message);
    };
    // Every step's post first (CopyEngineDirect compares the pair's ranges and throws RangeMismatch, naming both).
    std::vector<CopyEngineDirect::Arrival> arrivals;
    std::vector<DirectPairStep> direct;
    InFlight flight;
    Pair* pair = nullptr;
    for (size_t i = 0; i < steps.size(); ++i) {
      const PairStep& step = steps[i];
      if (opensPeerRun(steps, i)) {
        pair = &pairOf(step.peer);
      }
      const int me = rank_ < step.peer ? 0 : 1;
      DirectPairStep d;
      d.plan = pairPlanOf(step, me);
      try {
        arrivals.push_back(pair->direct->arriveExchange(d.plan, info.timeout));
      } catch (const PeerRefusedPost& e) {
        failBatch(info.describe() + " failed: " +
                  refusalOf(step.peer, e.serial, directionsOf(step), pairRangesOf(d.plan)[1 - me], e.directions));
      } catch (const std::exception& e) {
        failBatch(info.describe() + " failed: " + messageOf(e));
      }
      const CopyEngineDirect::Arrival& a = arrivals.back();
      const bool bounced = a.posted.input != d.plan.input || a.posted.outputBase != d.plan.output;
      if (bounced &&
          std::count_if(steps.begin(), steps.end(), [&](const PairStep& o) { return o.peer == step.peer; }) > 1) {
        // The pair's one bounce area would serve two steps of the batch at once.
        failBatch(info.describe() + " failed: a batch with several operations with group rank " +
                  std::to_string(step.peer) +
                  " whose buffers that rank cannot map (a bounce area each) is not supported; issue them as separate "
                  "batches");
      }
      d.transport = a.transport.get();
      d.serial = static_cast<uint32_t>(a.serial);
      d.posted = a.posted;
      d.peer = {a.peers[1 - me], a.ranges[1 - me]};
      flight.steps.push_back({step.peer, a.serial, directionsOf(step), pairRangesOf(d.plan)[1 - me]});
      direct.push_back(std::move(d));
    }

    std::unique_lock<std::mutex> lock(mutex_);
    gpu::streamWaitEvent(push_, fork);
    gpu::streamWaitEvent(drain_, fork);
    for (auto& a : arrivals) {
      a.transport->bindLanes(push_, drain_);
    }
    // The pairs' transports share the main streams in the Arrived phase: a transport's collected flag operations are
    // issued before another one enqueues behind them.
    CopyEngineTransport* recording = nullptr;
    const auto flushRecording = [&] {
      if (recording) {
        recording->flush();
      }
      recording = nullptr;
    };
    // Then each peer's steps on a pair of the pool's streams of its own, forked from the Drain stream once every
    // Arrived is on it and joined into it before the end event. Two peers on one pair would be one queue of steps
    // again, which a batch matched by interleaved lone calls can hang (the model's --lane-pool=1), so the pool grows
    // to the batch's peers.
    std::vector<size_t> forked;
    ForkedLanes lanes;
    lanes.onFork = [&](size_t peer, size_t firstStep) {
      flushRecording();
      if (forked.empty()) {
        gpu::recordEvent(fork_, drain_);
      }
      const PeerLanes& pair = peerLanesFor(peer);
      gpu::streamWaitEvent(pair.push, fork_);
      gpu::streamWaitEvent(pair.drain, fork_);
      arrivals[firstStep].transport->bindLanes(pair.push, pair.drain);
      forked.push_back(peer);
    };
    lanes.onJoin = [&] {
      flushRecording();
      for (size_t peer : forked) {
        // Each wait takes the event as last recorded, so one event serves every peer in turn.
        gpu::recordEvent(joined_, peerLanes_[peer].drain);
        gpu::streamWaitEvent(drain_, joined_);
      }
    };
    scheduleDirectP2pBatch(
        direct,
        [&](size_t i, P2pPhase) {
          CopyEngineTransport* next = arrivals[i].transport.get();
          if (recording != next) {
            flushRecording();
          }
          recording = next;
        },
        &lanes);
    flushRecording();
    gpu::recordEvent(completion->endEvent(), drain_);
    flight.completion = completion;
    flight.info = info;
    flight.failAt = failAt;
    flight.enqueuedAt = std::chrono::steady_clock::now();
    for (auto& a : arrivals) {
      flight.holds.push_back(a.transport);
      for (auto& h : a.holds) {
        flight.holds.push_back(std::move(h));
      }
    }
    inFlight_.push_back(std::move(flight));
    lock.unlock();
    wake_.notify_one();
  }

  struct Pair {
    c10::intrusive_ptr<c10d::Store> store;        // the pair's prefix of the group's store
    std::shared_ptr<CopyEngineDirect> direct;     // connected by the posting thread before the pair's first eager post
    std::vector<MemberIdentity> members;          // the pair's, in group-rank order, with `direct`
    std::vector<MemberIdentity> capturedMembers;  // the same, read at the pair's first captured op
    bool released = false;
  };
  struct PeerLanes {
    gpu::Stream push = nullptr;
    gpu::Stream drain = nullptr;
  };
  struct ForkedLanes : P2pPeerLanes {
    std::function<void(size_t, size_t)> onFork;
    std::function<void()> onJoin;
    void fork(size_t peer, size_t firstStep) override {
      onFork(peer, firstStep);
    }
    void join() override {
      onJoin();
    }
  };
  struct InFlight {
    std::shared_ptr<GpuCompletion> completion;
    struct Step {
      int peer;
      uint64_t serial;  // the pair's
      uint64_t directions;
      PairRanges ranges;  // what this rank posted about the pair
    };
    std::vector<Step> steps;
    std::vector<std::shared_ptr<void>> holds;
    CollectiveInfo info;
    uint64_t failAt = 0;
    std::chrono::steady_clock::time_point enqueuedAt;
  };

  void failGroup(uint64_t at, const std::string& reason) {
    if (board_) {
      board_->fail(at, reason);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    failGroupLocked(reason);
  }

  // Every later batch is refused; every batch in flight carries the error, its tensors kept until its lanes ran out.
  void failGroupLocked(const std::string& reason) {
    failure_.record("torch_sdma: " + reason);
    const auto error = std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + reason));
    for (auto& f : inFlight_) {
      f.completion->setError(error);
    }
    for (auto& d : deferred_) {
      if (d.completion) {
        d.completion->setError(error);
      }
    }
  }

  // The pair with `peer`, from any thread: the caller's thread may add pairs meanwhile, under mutex_ (a map's nodes
  // stay where they are).
  Pair& pairOf(int peer) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pairs_.at(peer);
  }

  // The posting thread: the deferred batches and refusals in call order, each connected, posted and enqueued when
  // its peers let it; the caller's calls queue behind the one being posted, which stays at the queue's front.
  void posterLoop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      posterWake_.wait(lock, [this] { return stopPoster_ || !deferred_.empty(); });
      if (deferred_.empty()) {
        return;
      }
      Deferred& d = deferred_.front();
      if (const std::string why = whyNotPostedLocked(d); !why.empty()) {
        failUnposted(d, why);
      } else {
        lock.unlock();
        postDeferred(d);
        lock.lock();
      }
      if (d.fork) {
        endEvents_->giveBack(d.fork);
      }
      deferred_.pop_front();
    }
  }

  // Why the posting thread will not post `d`, or "" while it may.
  std::string whyNotPostedLocked(const Deferred& d) const {
    if (failure_.happened()) {
      return d.info.describe() + " refused: an earlier collective on this group failed: " + failure_.reason();
    }
    if (stopPoster_) {
      return d.info.describe() + " failed: its group was destroyed before the operation could be posted";
    }
    return "";
  }

  // A deferred batch fails before its post: no peer reads its buffers, which go back now.
  static void failUnposted(Deferred& d, const std::string& reason) {
    if (d.completion) {
      d.completion->fail(std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + reason)));
    }
  }

  void postDeferred(Deferred& d) {
    const std::vector<int> peers = d.refusal ? std::vector<int>{d.refusal->peer} : peersOf(d.steps);
    for (int peer : peers) {
      try {
        connectEager(peer, d.info);
      } catch (const std::exception& e) {
        const std::string reason = d.info.describe() + " failed while connecting the pair with group rank " +
                                   std::to_string(peer) + ": " + messageOf(e);
        failUnposted(d, reason);
        exitIfStreamsMayRunOn(reason);
        failGroup(d.failAt, reason);
        return;
      }
    }
    if (d.refusal) {
      postRefusal(pairOf(d.refusal->peer), d.refusal->peer, d.refusal->directions, d.refusal->why, d.info);
      failGroup(d.failAt, d.info.describe() + " was refused on this rank: " + d.refusal->why);
      return;
    }
    {
      // Room on the lanes before the post: a posted batch is one the peer may copy with, so it must not wait after.
      // The batches on the lanes end once their peers come, or the watchdog fails them at their timeout.
      std::unique_lock<std::mutex> lock(mutex_);
      while (!lanesHaveRoomLocked() && whyNotPostedLocked(d).empty()) {
        posterWake_.wait_for(lock, std::chrono::milliseconds(5));
      }
      if (const std::string why = whyNotPostedLocked(d); !why.empty()) {
        failUnposted(d, why);
        return;
      }
    }
    try {
      postAndEnqueue(d.steps, d.info, d.failAt, d.fork, d.completion, /*afterReturn=*/true);
      d.completion->markEnqueued();
    } catch (const std::exception&) {
      // The batch's completion carries the error; the group failed.
    }
  }

  // The pair's eager state, on the posting thread: collectively over the pair, within the group's timeout (the
  // pair's store waits that long for the peer).
  void connectEager(int peer, const CollectiveInfo& info) {
    Pair& pair = pairOf(peer);
    if (pair.direct) {  // only this thread sets it
      return;
    }
    const int me = rank_ < peer ? 0 : 1;
    std::vector<MemberIdentity> members;
    const std::string whyNot = CopyEngineTransport::checkGroupReachable(*pair.store, "reach", me, 2, device_, &members);
    TORCH_CHECK_WITH(DistBackendError, whyNot.empty(), "torch_sdma: ", info.describe(),
                     ": the pair cannot take the copy engines: ", whyNot);
    auto direct = std::make_shared<CopyEngineDirect>(pair.store, me, 2, device_, members, options_);
    std::lock_guard<std::mutex> lock(mutex_);
    pair.members = std::move(members);
    pair.direct = std::move(direct);
  }

  // The refused op's serial, posted with its words (docs: PeerRefusedPost). Never throws.
  void postRefusal(Pair& pair, int peer, uint64_t directions, const std::string& why, const CollectiveInfo& info) {
    const uint64_t serial = pair.direct->lastSerial() + 1;
    try {
      // The words first: a peer that reads the post looks for them.
      store_->set(p2pRefusalKey(rank_, peer, serial, true), why);
      pair.direct->arriveRefused(directions, info.timeout);
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: " << info.describe() << ": this rank's refusal did not reach group rank " << peer
                   << ": " << messageOf(e);
    }
  }

  // A failure found on the posting thread, after its call returned: under the default exit, where batches are in
  // flight on this runner's lanes (streams that would run on into whatever reads their outputs once the peers release
  // their waits), the process ends naming it before the board tells the peers. Deferred batches hold no stream: their
  // waits raise.
  void exitIfStreamsMayRunOn(const std::string& reason) {
    if (!exitsOnAsyncError()) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (!inFlight_.empty()) {
      exitOnAsyncError(reason + ".", describeEach(inFlight_));
    }
  }

  static std::vector<int> peersOf(const std::vector<PairStep>& steps) {
    // pairStepsOf puts a peer's steps side by side and the peers in pair order, the order of the batch's connects:
    // a ring's connects then never wait in a cycle.
    std::vector<int> peers;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (opensPeerRun(steps, i)) {
        peers.push_back(steps[i].peer);
      }
    }
    return peers;
  }

  // The words for a step whose peer refused its op of `serial` on its own arguments.
  std::string refusalOf(int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                        uint64_t peerDirections) const {
    const std::string why = readP2pRefusal(*store_, p2pRefusalKey(peer, rank_, serial, true));
    return pairStepRefusal(rank_, peer, serial, myDirections, mine, peerDirections, why);
  }

  // Why `f` cannot complete, naming its peers, or "" while it may.
  std::string stuck(const InFlight& f, std::chrono::steady_clock::time_point now) {
    for (const auto& [peer, serial, directions, ranges] : f.steps) {
      // A peer that came after this rank refused the op this one meets: its post says so.
      if (const auto refused = pairs_.at(peer).direct->peerRefused(1 - (rank_ < peer ? 0 : 1), serial)) {
        return f.info.describe() + " failed: " + refusalOf(peer, serial, directions, ranges, *refused);
      }
    }
    for (const auto& [peer, serial, directions, ranges] : f.steps) {
      const int pid = pidOf(peer);
      if (!processAlive(pid)) {
        return f.info.describe() + " failed: group rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
               ") exited";
      }
      if (board_ && board_->failedAtOf(peer) != 0) {
        return f.info.describe() + " failed: group rank " + std::to_string(peer) +
               " failed (its group failed at "
               "sequence number " +
               std::to_string(board_->failedAtOf(peer)) + ")";
      }
    }
    if (now < f.enqueuedAt + f.info.timeout) {
      return "";
    }
    std::string never;
    for (const auto& [peer, serial, directions, ranges] : f.steps) {
      if (!pairs_.at(peer).direct->peerReached(1 - (rank_ < peer ? 0 : 1), serial)) {
        never += (never.empty() ? "" : ", ") + std::to_string(peer);
      }
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - f.enqueuedAt).count();
    return f.info.describe() + " timed out after " + std::to_string(ms) + " ms " +
           (never.empty() ? std::string("with its peers' copies unfinished")
                          : "waiting for group ranks [" + never + "], which never posted the matching operation");
  }

  void watchdogLoop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_ || !inFlight_.empty()) {
      wake_.wait_for(lock, std::chrono::milliseconds(50));
      freeTransportsOfDestroyedGraphs();
      const auto now = std::chrono::steady_clock::now();
      while (!inFlight_.empty() && inFlight_.front().completion->pollDone()) {
        inFlight_.pop_front();
      }
      if (!failure_.happened()) {
        for (const auto& f : inFlight_) {
          const std::string why = stuck(f, now);
          if (!why.empty()) {
            // Before the board says so: a peer that reads this rank's failure there releases its waits, and its
            // streams run on into whatever reads the outputs.
            if (exitsOnAsyncError()) {
              exitOnAsyncError(why + ".", describeEach(inFlight_));
            }
            if (board_) {
              board_->fail(f.failAt, why);
            }
            failGroupLocked(why);
            break;
          }
        }
      }
      if (failure_.happened() && inFlight_.empty()) {
        releaseFailedPeers();
      }
      if (stop_ && failure_.happened() && !inFlight_.empty() &&
          now > inFlight_.front().enqueuedAt + 2 * inFlight_.front().info.timeout) {
        return;  // the destructor keeps what may still run
      }
    }
  }

  // This rank's lanes ran out: every failed (or gone) peer's waits on this rank pass (docs/design.md, "Failures").
  void releaseFailedPeers() {
    for (auto& [peer, pair] : pairs_) {
      if (pair.released || !pair.direct) {
        continue;
      }
      const uint32_t value = static_cast<uint32_t>(pair.direct->lastSerial()) + kReleaseAhead;
      const int q = rank_ < peer ? 1 : 0;
      if (!processAlive(pidOf(peer))) {
        pair.direct->flags()->releaseWaitsOnGonePeer(q, value);
        pair.released = true;
      } else if (board_ && board_->failedAtOf(peer) != 0) {
        pair.direct->flags()->releasePeer(q, value);
        pair.released = true;
      }
    }
  }

  // The pool's pair of streams for a batch's `peer`-th peer, created at the first batch with that many peers and kept
  // for the runner's life.
  const PeerLanes& peerLanesFor(size_t peer) {
    while (peerLanes_.size() <= peer) {
      gpu::CaptureRelaxedScope relaxed;  // another thread may be capturing in global mode
      PeerLanes lanes;
      lanes.push = gpu::createStream();
      lanes.drain = gpu::createStream();
      peerLanes_.push_back(lanes);
    }
    return peerLanes_[peer];
  }

  int pidOf(int peer) const {
    return pairs_.at(peer).members[rank_ < peer ? 1 : 0].pid;
  }

  void abandon(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (exitsOnAsyncError() && !inFlight_.empty()) {
      exitOnAsyncError("the point-to-point watchdog failed: " + why + ".", describeEach(inFlight_));
    }
    failGroupLocked("the point-to-point watchdog failed: " + why);
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int device_;
  CallBoard* const board_;
  const DirectPathOptions options_;
  std::map<int, Pair> pairs_;  // the caller's thread adds to it under mutex_; the watchdog reads it under mutex_
  std::map<int, std::string> failedPairs_;  // pairs whose connect failed: their later operations are refused
  gpu::Stream push_ = nullptr;
  gpu::Stream drain_ = nullptr;
  gpu::Event fork_ = nullptr;
  gpu::Event joined_ = nullptr;
  std::vector<PeerLanes> peerLanes_;  // only the caller's thread touches it, under mutex_ as the streams above
  std::shared_ptr<EventPool> endEvents_ = std::make_shared<EventPool>();
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<InFlight> inFlight_;
  GroupFailure failure_;
  std::unique_ptr<CapturedP2pPairs> captured_;  // only the caller's thread touches it
  bool stop_ = false;
  // Batches the caller could not post at once, in call order (under mutex_); while it is not empty the caller posts
  // nothing itself, so the lanes, the event fork_ and the pairs' mailboxes have one thread at a time.
  std::deque<Deferred> deferred_;
  std::condition_variable posterWake_;
  bool stopPoster_ = false;
  GuardedThread watchdog_;
  GuardedThread poster_;
};

}  // namespace

std::unique_ptr<P2pRunner> makeCopyEngineP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, int device,
                                                   CallBoard* board, const DirectPathOptions& options,
                                                   const StagingGeometry& cap) {
  // A pair's captured staging: the group's cap, over two members.
  const StagingGeometry pair = StagingGeometry::fit(2, cap.slots, cap.bytes(), cap.pipelineChunkBytes);
  return std::make_unique<CopyEngineP2pRunner>(std::move(store), rank, device, board, options, pair);
}

}  // namespace sdma
