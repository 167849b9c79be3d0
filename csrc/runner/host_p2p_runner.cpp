// The point-to-point runner of CPU tensors: one HostShmTransport per pair (two members, a mailbox with ranges, the
// direct path's copies straight between the processes), and one worker thread that runs this rank's batches in call
// order: each batch's Arrived phase across its pairs' transports in the schedule's one order, then each peer's steps
// as a lane of that peer alone (docs/design.md, "Point-to-point"), the worker polling the lanes in turn, a wait that
// cannot pass yet giving way to the next lane, until every lane ran out. The caller never waits on a peer: a batch
// whose pair is not connected yet, or whose pair's ring of posts is full, is posted by the worker when it reaches it,
// which connects the pair first.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <c10/util/Exception.h>

#include <condition_variable>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "collective/direct_p2p_batch.hpp"
#include "runner/group_failure.hpp"
#include "runner/guarded_thread.hpp"
#include "runner/kept_for_life.hpp"
#include "runner/p2p_runner.hpp"
#include "transport/host_shm_transport.hpp"
#include "transport/idle_backoff.hpp"
#include "work/host_work.hpp"
#include "work/interpreter_exit.hpp"

namespace sdma {
namespace {

// Whether this process holds CAP_SYS_PTRACE (bit 19 of CapEff), which lets it read a sibling's memory under
// kernel.yama.ptrace_scope 1 and 2.
bool holdsPtraceCapability() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      return (std::stoull(line.substr(7), nullptr, 16) >> 19 & 1) != 0;
    }
  }
  return false;
}

// "" where this process may read and write a sibling process's memory (process_vm_readv/writev) by this host's
// setting (kernel.yama.ptrace_scope: 0 or no Yama; 1 and 2 with CAP_SYS_PTRACE), else why not. Both members of a pair
// run on this host (the group's path at creation says so) and are launched alike, so they route the pair alike
// without asking each other; a pair whose connect still finds no access (ranks of two users, say) fails on both
// members, since the connect agrees every verdict.
std::string peerMemoryAccessBarred() {
  std::ifstream scope("/proc/sys/kernel/yama/ptrace_scope");
  int value = 0;
  if (!(scope >> value) || value == 0 || (value < 3 && holdsPtraceCapability())) {
    return "";
  }
  return "kernel.yama.ptrace_scope=" + std::to_string(value) + " bars reading a peer process's memory";
}

// A pair moves no staged bytes: its transport's staging is the least one can have.
StagingGeometry pairGeometry() {
  return StagingGeometry::fit(2, 1, kPageBytes, kPageBytes);
}

class HostP2pRunner : public P2pRunner {
 public:
  HostP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, CallBoard* board)
      : store_(std::move(store)), rank_(rank), board_(board), barred_(peerMemoryAccessBarred()) {
    worker_ = GuardedThread([this] { workerLoop(); }, [this](const std::string& why) { abandonQueued(why); });
  }
  ~HostP2pRunner() override {
    worker_.stopAndJoin(mutex_, wake_, stop_);
  }

  // Decided here, from what both members read alike, without the peer: the pair's transport connects on the worker
  // before the pair's first batch runs (postQueued), so the caller never waits for the peer to connect.
  CollectivePath connectPair(int peer) override {
    pairs_[peer];
    return barred_.empty() ? CollectivePath::dma(CollectivePath::kDirect) : CollectivePath::inner(barred_);
  }

  c10::intrusive_ptr<c10d::Work> run(std::vector<PairStep> steps, const CollectiveInfo& info,
                                     uint64_t nextCollective) override {
    refuseBatchOfFailedGroup(mutex_, failure_, board_, info);
    auto [outputs, keep] = tensorsOf(steps);
    Job job;
    job.failAt = nextCollective;
    job.timeout = info.timeout;
    job.work = c10::make_intrusive<HostWork>(info, std::move(outputs), std::move(keep));
    for (const PairStep& step : steps) {
      Pair& pair = pairs_.at(step.peer);
      job.pairs.push_back(&pair);
      job.serials.push_back(++pair.serial);
    }
    {
      std::lock_guard<std::mutex> lock(postMutex_);
      // Posted here only where every step's pair is connected, has no post queued on the worker and room in its
      // ring: the caller never waits for a peer, and a pair's posts go out in its serials' order.
      bool postNow = true;
      for (size_t i = 0; i < steps.size(); ++i) {
        postNow &= job.pairs[i]->transport && job.pairs[i]->unposted == 0 &&
                   job.pairs[i]->transport->mailbox()->roomFor(job.serials[i]);
      }
      if (!postNow) {
        for (Pair* pair : job.pairs) {
          ++pair->unposted;
        }
        job.unposted = std::move(steps);
      } else if (const std::string refused = postAndRecord(job, steps); !refused.empty()) {
        // Posted: a peer that read a post may copy with these buffers until its own failure stops it.
        keepTensorsForLife(job.work->takeKeptTensors());
        const std::string reason = info.describe() + " failed: " + refused;
        failGroup(nextCollective, reason);
        C10_THROW_ERROR(DistBackendError, "torch_sdma: " + reason);
      }
    }
    auto work = job.work;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(job));
    }
    wake_.notify_one();
    return work;
  }

  void refuse(int peer, uint64_t directions, const std::string& why, const CollectiveInfo& info,
              uint64_t nextCollective) override {
    const auto found = pairs_.find(peer);
    if (found == pairs_.end()) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_.reason().empty()) {
        return;  // the peer's ops fail already: this rank failed the group, and peers' waits on it give up
      }
    }
    Pair& pair = found->second;
    const uint64_t serial = ++pair.serial;
    std::unique_lock<std::mutex> lock(postMutex_);
    if (pair.transport && pair.unposted == 0 && pair.transport->mailbox()->roomFor(serial)) {
      postRefusal(pair, peer, serial, directions, why, info.timeout, info.describe());
    } else if (!pair.transport && pair.unposted == 0) {
      // The pair's first op: the worker connects the pair and posts the refusal there, so that the peer's op, which
      // connects on its own worker, finds it rather than waiting out the connect.
      ++pair.unposted;
      Job job;
      const std::string reason = info.describe() + " was refused on this rank: " + why;
      job.refusal = Refusal{directions, why, reason};
      job.failAt = nextCollective;
      job.timeout = info.timeout;
      job.work = c10::make_intrusive<HostWork>(info, std::vector<at::Tensor>{}, std::vector<at::Tensor>{});
      job.pairs.push_back(&pair);
      job.serials.push_back(serial);
      job.unposted.push_back(PairStep{peer, at::Tensor(), at::Tensor()});
      lock.unlock();
      {
        std::lock_guard<std::mutex> queueLock(mutex_);
        queue_.push_back(std::move(job));
      }
      wake_.notify_one();
      // Failed here at once, so that this rank's next ops are refused; the call board says so only once the refusal
      // is posted (postQueuedRefusal), so that a peer that finds this rank's group failed finds the refusal too.
      std::lock_guard<std::mutex> failLock(mutex_);
      failure_.record("torch_sdma: " + reason);
      return;
    }
    // Otherwise the post would wait behind posts that never go out now: the group's failure alone ends the peer's op
    // (naming this rank's failed group). After the post: a peer that finds this rank's group failed reads the post
    // again, and names the refusal.
    failGroup(nextCollective, info.describe() + " was refused on this rank: " + why);
  }

 private:
  struct Pair {
    std::unique_ptr<HostShmTransport> transport;  // null until the worker connected it (set under postMutex_)
    uint64_t serial = 0;                          // the pair's steps so far, on both members alike
    size_t unposted = 0;  // steps queued for the worker to post (under postMutex_): later ones queue behind them
  };
  struct Segment {
    HostShmTransport* transport;
    std::vector<HostShmTransport::Op> ops;
    int peer;
  };
  struct Refusal {
    uint64_t directions;
    std::string why;
    std::string reason;  // the group's failure
  };
  struct Job {
    std::vector<Segment> arrive;              // every step's Arrived, in the batch's order
    std::vector<std::vector<Segment>> peers;  // then each peer's steps, a lane each
    c10::intrusive_ptr<HostWork> work;
    uint64_t failAt = 0;
    std::chrono::milliseconds timeout{0};
    std::vector<Pair*> pairs;        // per step
    std::vector<uint64_t> serials;   // per step, taken in call order
    std::vector<PairStep> unposted;  // the steps, where the worker posts them (postQueued)
    std::optional<Refusal> refusal;  // a refused op's post, and nothing else (postQueuedRefusal)
  };

  // Posts every step of `steps` (the job's pairs and serials) in its pair's mailbox, then records the batch's
  // schedule into the job's lanes; under postMutex_, with room in every step's ring. Returns "" or, where a peer's
  // post differs (or refused), the words; nothing is recorded then.
  std::string postAndRecord(Job& job, const std::vector<PairStep>& steps) {
    // Every step's post first: a peer that reads one may copy with these buffers once this rank's Arrived is out.
    std::vector<DirectPairStep> direct;
    std::vector<uint64_t> directions;
    for (size_t i = 0; i < steps.size(); ++i) {
      const PairStep& step = steps[i];
      HostShmTransport& t = *job.pairs[i]->transport;
      const int me = t.rank();
      DirectPairStep d;
      d.transport = &t;
      d.plan = pairPlanOf(step, me);
      const uint64_t serial = job.serials[i];
      d.serial = static_cast<uint32_t>(serial);
      d.posted = {d.plan.input, d.plan.output};
      const std::vector<PairRanges> ranges = pairRangesOf(d.plan);
      const auto settled = t.mailbox()->arrive(
          serial,
          {reinterpret_cast<uint64_t>(d.plan.input), reinterpret_cast<uint64_t>(d.plan.output), directionsOf(step)},
          job.timeout, std::chrono::microseconds(0), std::chrono::microseconds(0), &ranges);
      const ArrivalMailbox::PeerArrival& peer = settled[1 - me];
      d.peer = {{peer.pairing, peer.post.input, peer.post.output}, peer.ranges};
      if (peer.pairing != Pairing::kPeerCameLate) {
        const std::string refused =
            stepDisagreement(step.peer, serial, directionsOf(step), ranges[1 - me], peer.post.bytes, peer.ranges);
        if (!refused.empty()) {
          return refused;
        }
      }
      directions.push_back(directionsOf(step));
      direct.push_back(std::move(d));
    }

    HostShmTransport* recording = nullptr;
    int recordingPeer = -1;
    std::vector<Segment>* lane = &job.arrive;
    const auto flush = [&] {
      if (recording) {
        auto ops = recording->takeRecorded();
        if (!ops.empty()) {
          lane->push_back({recording, std::move(ops), recordingPeer});
        }
      }
    };
    // Each peer's segments after the Arrived phase go to that peer's lane.
    std::map<const Transport*, size_t> laneOf;
    struct Lanes : P2pPeerLanes {
      std::function<void(size_t, size_t)> onFork;
      void fork(size_t peer, size_t firstStep) override {
        onFork(peer, firstStep);
      }
      void join() override {}  // the batch completes once the worker ran every lane out
    } lanes;
    lanes.onFork = [&](size_t peer, size_t firstStep) {
      flush();
      recording = nullptr;
      laneOf[direct[firstStep].transport] = peer;
      job.peers.emplace_back();
    };
    scheduleDirectP2pBatch(
        direct,
        [&](size_t i, P2pPhase phase) {
          flush();
          recording = static_cast<HostShmTransport*>(direct[i].transport);
          recordingPeer = steps[i].peer;
          lane = phase == P2pPhase::kArrive ? &job.arrive : &job.peers[laneOf.at(direct[i].transport)];
          if (phase == P2pPhase::kCopy && direct[i].peer.buffers.pairing == Pairing::kPeerCameLate) {
            recordPeerPostCheck(*recording, recordingPeer, direct[i].serial, directions[i],
                                pairRangesOf(direct[i].plan)[1 - recording->rank()]);
          }
        },
        &lanes);
    flush();
    return "";
  }

  // A job whose posts were queued here: waits until every step's ring has room (the peer read this rank's post
  // depth serials back), giving up as any wait on the peer does, then posts and records them.
  void postQueued(Job& job) {
    const std::string& description = job.work->description();
    const auto deadline = job.work->deadline();
    connectPairsOf(job);
    const auto start = std::chrono::steady_clock::now();
    auto idleSince = start;
    for (size_t i = 0; i < job.unposted.size(); ++i) {
      HostShmTransport& t = *job.pairs[i]->transport;
      const int peer = job.unposted[i].peer;
      const int q = 1 - t.rank();
      while (!t.mailbox()->roomFor(job.serials[i])) {
        const auto now = std::chrono::steady_clock::now();
        const std::string stop = peerStop(peer);
        TORCH_CHECK_WITH(DistBackendError, stop.empty(), "torch_sdma: ", description, " failed: ", stop);
        TORCH_CHECK_WITH(DistBackendError, processAlive(t.pidOf(q)), "torch_sdma: ", description,
                         " failed: group rank ", peer, " (pid ", t.pidOf(q),
                         ") exited while this rank was waiting for it");
        TORCH_CHECK_WITH(DistBackendError, now < deadline, "torch_sdma: ", description, " timed out after ",
                         std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count(),
                         " ms waiting for group ranks [", peer, "] to reach its operation number ",
                         job.serials[i] - t.mailbox()->depth(), " with this rank: it is ", t.mailbox()->depth(),
                         " or more operations behind");
        idleBackoff(now - idleSince);
      }
    }
    std::string refused;
    {
      std::lock_guard<std::mutex> lock(postMutex_);
      for (Pair* pair : job.pairs) {
        --pair->unposted;
      }
      refused = postAndRecord(job, job.unposted);
    }
    TORCH_CHECK_WITH(DistBackendError, refused.empty(), "torch_sdma: ", description, " failed: ", refused);
  }

  // The pair's transport, connected with `peer` through the group's store under "p2p/<lo>-<hi>/" (both members, on
  // their workers, within the store's timeout, the group's). Throws where it cannot take the direct path: both
  // members find the same (the connect agrees every verdict), so the op fails on both, never takes another route.
  std::unique_ptr<HostShmTransport> connectTransport(int peer, const std::string& description) {
    const int lo = std::min(rank_, peer);
    const int hi = std::max(rank_, peer);
    c10d::PrefixStore store("p2p/" + std::to_string(lo) + "-" + std::to_string(hi) + "/", store_);
    std::string why;
    std::unique_ptr<HostShmTransport> transport;
    try {
      transport = HostShmTransport::connect(store, rank_ == lo ? 0 : 1, 2, pairGeometry(), /*direct=*/true, &why);
    } catch (const std::exception& e) {
      why = messageOf(e);
      if (why.rfind("torch_sdma: ", 0) == 0) {
        why = why.substr(12);
      }
    }
    if (transport && !transport->mailbox()) {
      why = transport->directUnavailable();
      transport.reset();
    }
    TORCH_CHECK_WITH(DistBackendError, transport, "torch_sdma: ", description,
                     " failed while connecting the pair with group rank ", peer, ": ", why);
    transport->setGroup({lo, hi}, {});
    return transport;
  }

  // Under postMutex_, with room in the pair's ring. Never throws: the refusal itself is the caller's error.
  void postRefusal(Pair& pair, int peer, uint64_t serial, uint64_t directions, const std::string& why,
                   std::chrono::milliseconds timeout, const std::string& description) {
    try {
      // The words first: a peer that reads the post looks for them.
      store_->set(p2pRefusalKey(rank_, peer, serial), why);
      const std::vector<PairRanges> ranges(2);
      pair.transport->mailbox()->arrive(serial, {0, 0, directions | kStepRefused}, timeout,
                                        std::chrono::microseconds(0), std::chrono::microseconds(0), &ranges);
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: " << description << ": this rank's refusal did not reach group rank " << peer << ": "
                   << messageOf(e);
    }
  }

  // Connects every pair of the job not yet connected, on the worker.
  void connectPairsOf(Job& job) {
    // The job's pairs come in the one pair order every rank follows (p2p_batch.hpp), so these connects never wait in
    // a cycle across a batch's pairs.
    for (size_t i = 0; i < job.unposted.size(); ++i) {
      bool connected;
      {
        std::lock_guard<std::mutex> lock(postMutex_);
        connected = job.pairs[i]->transport != nullptr;
      }
      if (!connected) {
        auto transport = connectTransport(job.unposted[i].peer, job.work->description());
        std::lock_guard<std::mutex> lock(postMutex_);
        job.pairs[i]->transport = std::move(transport);
      }
    }
  }

  // A refusal of the pair's first op (refuse()): runs although the group failed, which this very refusal did.
  void postQueuedRefusal(Job& job) {
    try {
      connectPairsOf(job);
      std::lock_guard<std::mutex> lock(postMutex_);
      --job.pairs[0]->unposted;
      postRefusal(*job.pairs[0], job.unposted[0].peer, job.serials[0], job.refusal->directions, job.refusal->why,
                  job.timeout, job.work->description());
    } catch (const std::exception& e) {
      LOG(WARNING) << "torch_sdma: " << job.work->description() << ": this rank's refusal did not reach group rank "
                   << job.unposted[0].peer << ": " << messageOf(e);
    }
    failGroup(job.failAt, job.refusal->reason);
  }

  // Why a wait on `peer` must end ("" to go on): the peer's group failed, so it runs nothing it had not yet begun
  // (and whatever it began, it fails).
  std::string peerStop(int peer) const {
    if (!board_) {
      return "";
    }
    const uint64_t at = board_->failedAtOf(peer);
    if (at == 0) {
      return "";
    }
    return "group rank " + std::to_string(peer) + " failed (its group failed at sequence number " + std::to_string(at) +
           ")";
  }

  // "" where the two sides of a step agree, else the words for both ranks: the peer's refusal (with its error, from
  // the store, where the peer wrote it before posting), or the sizes or directions that differ.
  std::string stepDisagreement(int peer, uint64_t serial, uint64_t myDirections, const PairRanges& mine,
                               uint64_t peerDirections, const PairRanges& peers) const {
    if ((peerDirections & kStepRefused) == 0) {
      return pairStepDisagreement(rank_, peer, serial, myDirections, mine, peerDirections, peers);
    }
    const std::string why = readP2pRefusal(*store_, p2pRefusalKey(peer, rank_, serial));
    return pairStepRefusal(rank_, peer, serial, myDirections, mine, peerDirections, why);
  }

  // A step whose peer came late: the peer moves both directions and compares the two posts. This rank compares
  // them too, on its worker, so that both name the sizes; and a peer that never posts is named at the deadline.
  void recordPeerPostCheck(HostShmTransport& t, int peer, uint32_t serial, uint64_t myDirections, PairRanges mine) {
    const int q = 1 - t.rank();
    ArrivalMailbox* mailbox = t.mailbox();
    const int pid = t.pidOf(q);
    auto start = std::make_shared<std::chrono::steady_clock::time_point>();
    t.recordPollTask([this, mailbox, q, pid, peer, serial, myDirections, mine, start](
                         std::chrono::steady_clock::time_point deadline, const std::string& description) {
      const auto now = std::chrono::steady_clock::now();
      if (*start == std::chrono::steady_clock::time_point{}) {
        *start = now;
      }
      BufferPost post;
      PairRanges theirs;
      if (!mailbox->readPeerPost(q, serial, &post, &theirs)) {
        if (mailbox->peerReached(q, serial)) {
          return true;  // read and gone: the peer compared them when it arrived
        }
        const std::string stop = peerStop(peer);
        // A peer that refused this step posted the refusal before it failed its group: read again, to name it.
        TORCH_CHECK_WITH(DistBackendError, stop.empty() || mailbox->readPeerPost(q, serial, &post, &theirs),
                         "torch_sdma: ", description, " failed: ", stop);
        if (stop.empty()) {
          TORCH_CHECK_WITH(DistBackendError, processAlive(pid), "torch_sdma: ", description, " failed: group rank ",
                           peer, " (pid ", pid, ") exited while this rank was waiting for it");
          TORCH_CHECK_WITH(DistBackendError, now < deadline, "torch_sdma: ", description, " timed out after ",
                           std::chrono::duration_cast<std::chrono::milliseconds>(now - *start).count(),
                           " ms waiting for group ranks [", peer, "], which never posted its operation number ", serial,
                           " with this rank");
          return false;
        }
      }
      const std::string differs = stepDisagreement(peer, serial, myDirections, mine, post.bytes, theirs);
      TORCH_CHECK_WITH(DistBackendError, differs.empty(), "torch_sdma: ", description, " failed: ", differs);
      return true;
    });
  }

  void failGroup(uint64_t at, const std::string& reason) {
    if (board_) {
      board_->fail(at, reason);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    failure_.record("torch_sdma: " + reason);
  }

  void runJob(Job& job) {
    if (job.refusal) {
      postQueuedRefusal(job);
      job.work->complete(nullptr);
      return;
    }
    std::string broken;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      broken = failure_.reason();
    }
    std::exception_ptr error;
    if (!broken.empty()) {
      error = std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + job.work->description() +
                                                                            " not run: an earlier operation on this "
                                                                            "group failed: " +
                                                                            broken));
    } else {
      if (!job.unposted.empty()) {
        try {
          postQueued(job);
        } catch (const std::exception& e) {
          const std::string why = messageOf(e);
          failGroup(job.failAt, why.rfind("torch_sdma: ", 0) == 0 ? why.substr(12) : why);
          error = std::current_exception();
        }
      }
      if (!error) {
        error = runLanes(job);
      }
    }
    if (error) {
      // A peer may still read and write these buffers by the addresses this rank posted (docs/design.md,
      // "Failures"): they are never given back.
      keepTensorsForLife(job.work->takeKeptTensors());
    }
    job.work->complete(error);
  }

  // Runs the batch's Arrived phase, then every peer's lane, polled in turn, so that a lane waiting for its peer never
  // holds another's copies and Done. The first error stops every lane, as a failed wait on one worker stops what
  // follows it, and fails the group.
  std::exception_ptr runLanes(Job& job) {
    struct Lane {
      const std::vector<Segment>* segments;
      size_t segment = 0;
      HostShmTransport::Progress progress;
    };
    std::vector<Lane> lanes;
    for (const auto& peer : job.peers) {
      lanes.push_back({&peer});
    }
    const auto deadline = job.work->deadline();
    const std::string& description = job.work->description();
    try {
      // One lane alone (the Arrived phase, which never waits, or a batch of one peer) runs straight through.
      for (const Segment& s : job.arrive) {
        s.transport->execute(s.ops, deadline, description, [this, peer = s.peer] { return peerStop(peer); });
      }
      if (job.peers.size() == 1) {
        for (const Segment& s : job.peers[0]) {
          s.transport->execute(s.ops, deadline, description, [this, peer = s.peer] { return peerStop(peer); });
        }
        return nullptr;
      }
      auto idleSince = std::chrono::steady_clock::now();
      for (bool left = true; left;) {
        bool moved = false;
        left = false;
        for (Lane& lane : lanes) {
          while (lane.segment < lane.segments->size()) {
            const Segment& s = (*lane.segments)[lane.segment];
            const size_t before = lane.progress.next;
            const bool done = s.transport->poll(s.ops, lane.progress, deadline, description,
                                                [this, peer = s.peer] { return peerStop(peer); });
            moved |= lane.progress.next != before || done;
            if (!done) {
              break;
            }
            ++lane.segment;
            lane.progress = {};
          }
          left |= lane.segment < lane.segments->size();
        }
        const auto now = std::chrono::steady_clock::now();
        if (moved) {
          idleSince = now;
        } else {
          idleBackoff(now - idleSince);
        }
      }
    } catch (const std::exception& e) {
      const std::string why = messageOf(e);
      failGroup(job.failAt, why.rfind("torch_sdma: ", 0) == 0 ? why.substr(12) : why);
      return std::current_exception();
    }
    return nullptr;
  }

  void workerLoop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;  // stop_ with nothing left: every queued batch ran before the group goes away
      }
      Job job = std::move(queue_.front());
      queue_.pop_front();
      running_ = job.work;
      lock.unlock();
      runJob(job);
      lock.lock();
      running_.reset();
      lock.unlock();
      InterpreterExit::drop(job.work);
      lock.lock();
    }
  }

  void abandonQueued(const std::string& why) {
    std::vector<c10::intrusive_ptr<HostWork>> failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_.record("its point-to-point worker thread failed: " + why);
      if (running_) {
        failed.push_back(std::move(running_));
      }
      for (auto& job : queue_) {
        failed.push_back(std::move(job.work));
      }
      queue_.clear();
    }
    for (auto& work : failed) {
      keepTensorsForLife(work->takeKeptTensors());
      work->complete(std::make_exception_ptr(
          C10_BUILD_ERROR(DistBackendError,
                          "torch_sdma: " + work->description() + " failed: the point-to-point worker failed: " + why)));
    }
    InterpreterExit::drop(failed);
  }

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  CallBoard* const board_;
  const std::string barred_;   // why no pair here takes the direct path ("" where they all do)
  std::map<int, Pair> pairs_;  // by peer; the caller's thread alone adds to it (a Pair stays where it is)
  // Over posting in the pairs' mailboxes and recording on their transports, by the caller or the worker. Never held
  // across a wait on a peer.
  std::mutex postMutex_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  c10::intrusive_ptr<HostWork> running_;
  GroupFailure failure_;
  bool stop_ = false;
  GuardedThread worker_;  // last: it starts once every member above is there
};

}  // namespace

std::unique_ptr<P2pRunner> makeHostP2pRunner(c10::intrusive_ptr<c10d::Store> store, int rank, CallBoard* board) {
  return std::make_unique<HostP2pRunner>(std::move(store), rank, board);
}

}  // namespace sdma
