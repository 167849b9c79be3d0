// Runs the all-gather and exchange schedules (csrc/collective/) of W ranks against a fake transport that records every
// call, then executes the recorded operations of all ranks' lanes in a random interleaving that honours only the flags,
// the way independent streams on W GPUs would. Checks that every rank's output holds every rank's bytes, that no
// interleaving deadlocks, that flag serials survive wrapping past 2^32, and the call counts the per-call CPU cost
// rests on. The hierarchical schedule runs over fake nodes with a fake inner all-gather on rails (a rendezvous of
// the rail's members), its gathers on a third lane, with push and drain sharing a lane (one GPU stream), or with all
// of a rank's operations in one queue, as the host runner's single worker runs them. Usage: schedule_simulation SEED
// CASES; prints "ok <cases>" and exits 0 on success.
//
// The direct all-gather and the exchanges run with per-peer push lanes wherever the lanes are GPU streams, as the
// copy-engine transport runs eager direct collectives: a Push operation that names a peer (copyToPeer, waitPeer,
// signalPeer, pushChunkToPeer) goes on the lane of the peer at rotation distance k, lane (k - 1) % L for the group's L
// lanes (drawn from 1 to size - 1), forked from the Push lane at its first use in a call and after every
// joinLane(Push, Drain); joinLane(Drain, Push) waits for the Push lane and every peer lane forked in the call
// (FakeTransport::bindPeerLanes). --many-ranks draws 3 to 8 ranks for the direct, exchange and calls-in-flight cases
// (else 2 to 8). A wrong peer lane, given alone or after --calls-in-flight, --hardware-queues, --exchanges or --faults,
// runs every case and prints "caught N of CASES cases: <kind> <count>; ..." and exits 1 (alone: the direct cases
// only): --unjoined-peer-lanes (joinLane(Drain, Push) forgets the peer lanes: Done before the pushes landed),
// --unforked-peer-lanes (peer lanes not forked from the Push lane: a push of a bounce area not yet filled, or of an
// input the caller's stream has not yet written), --flags-on-peer-lanes (the direct schedules' flags to a peer on its
// peer lane instead of the Drain lane: a Done no longer after the Drain lane's pull from that peer),
// --relay-waits-on-root-lane (a relayed broadcast's forwarding rank's wait for the previous rank's chunk on that
// rank's peer lane: the forward of the chunk on the next rank's lane does not wait for it),
// --drain-flags-behind-peer-lanes (the Drain lane's collected flag operations not issued before a peer lane's: a rank's
// Arrived behind its own wait on a shared hardware queue). The calls-in-flight model submits the direct transport's
// flag operations as the copy-engine transport collects them (until the lane's next copy, fork or join point, each
// lane's batch after the other lane's signals collected so far); the staging transport's at once, unless
// --collect-staging-flags, which must print "ok <cases>" too; with
// --signals-behind-waits as well (no signal of the other lane first) the hardware-queue cases hang: a Push lane's
// Ready, collected until its next copy, sits behind the Drain lane's wait for the peers' Ready where the two streams
// share a hardware queue. Half the broadcasts among 3
// or more ranks of eager exchanges (the exchange and calls-in-flight models) are relayed through the ranks as a chain
// (relayed_broadcast.hpp), in up to 8 or the plan's own count of chunks of 1 to 3 bytes.
//
// schedule_simulation SEED CASES --calls-in-flight [--unordered] [--unforked] runs instead the model of a group's calls
// in flight across GPU streams (CallsInFlight below, which says what it covers and what not): with the runner's
// ordering rule (sdma::CallOrder) and its fences from the caller's stream it must print "ok <cases>"; --unordered
// drops the rule (a case then fails with a hang, an early completion or bytes not bit-exact), --unforked the fences
// (a lane then reads an input before the caller's stream wrote it): what the model exists to catch.
//
// schedule_simulation SEED CASES --hardware-queues [--crossed-orders] runs the calls-in-flight model with each rank's
// streams, peer lanes among them, on hardware queues (FIFOs: a wait at a queue's head holds every stream mapped there),
// all on one (CUDA_DEVICE_MAX_CONNECTIONS=1), one per stream, or a random few: with the calls made in one order on
// every rank it must print "ok <cases>"; with --crossed-orders (two groups whose calls the ranks interleave in
// different orders) it runs every case and prints "caught N of CASES cases: hang <n>; none in the <m> cases whose
// groups share no hardware queue" and exits 1. A hang where no hardware queue holds both groups' streams, or any
// failure but a hang, is printed as "FAIL: ..." alone.
//
// schedule_simulation SEED CASES --faults [--old-release] runs the model of the fault protocol (FaultCase below, with
// csrc/collective/fault_release.hpp): it must print "ok <cases>"; with --old-release (every failed rank passing its
// own waits) it runs every case and prints "caught N of CASES cases: <kind> <count>; ..." and exits 1. With
// --shared-queue-crossed (two groups whose calls the ranks issue in crossed orders, every stream of a rank on one
// hardware queue) the protocol is caught hanging, a known limitation: "caught N of CASES cases: hang N;", exit 1.
//
// schedule_simulation SEED CASES --exchanges [--skip-done-wait | --arrived-before-pack] runs the exchange schedule
// (exchangeCase below, relayed broadcasts among them): it must print "ok <cases>"; with a wrong schedule (its Done
// waits left out, or its Arrived signals before it packed its input) it runs every case and prints "caught N of CASES
// cases: <kind> <count>; ..." and exits 1. Exchanges also take part in the calls-in-flight and the fault models.
//
// schedule_simulation SEED CASES --p2p [--faults] [<wrong variant>] [--unmatched-batches | --interleaved-peers] runs
// send, recv and batch_isend_irecv through the real step formation and batch schedule (P2PCase below) among the
// group's collectives: it must print "ok <cases>", also with --unmatched-batches or --interleaved-peers; with a wrong
// variant of the batch (--wait-before-arrived, --copy-before-arrived, with --faults --pass-own-waits or
// --refusal-posts-buffers, --serials-in-call-order, --signals-in-call-order, --connect-in-turn,
// --done-after-every-copy,
// --shared-lanes, or a pool of peer lanes smaller than a batch's peers, --lane-pool=1 or 2) or with the peer lanes on
// shared hardware queues (--peer-lanes-share-queues) it runs every case and prints "caught N of CASES cases: <kind>
// <count>; ..." and exits 1.
//
// schedule_simulation SEED CASES --captured-p2p [--listing-order] runs graphs of captured point-to-point batches mixed
// with captured collectives (CapturedP2pCase below): it must print "ok <cases>"; with --listing-order (a batch's steps
// in each rank's listing order, not the order every rank shares) it runs every case and prints "caught N of CASES
// cases: hang <n>; rings of 3 or more ranks hang R of T;" and exits 1.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective/captured_allgather.hpp"
#include "collective/captured_exchange.hpp"
#include "collective/direct_allgather.hpp"
#include "collective/direct_exchange.hpp"
#include "collective/direct_p2p_batch.hpp"
#include "collective/fault_release.hpp"
#include "collective/hierarchical_allgather.hpp"
#include "collective/pair_steps.hpp"
#include "collective/relayed_broadcast.hpp"
#include "collective/staging_allgather.hpp"
#include "runner/call_order.hpp"

using namespace sdma;

namespace {

// Set where a run counts the cases a wrong schedule is caught in (--exchanges with a mutation): a failure then ends
// its case only.
bool failureEndsCase = false;

// Wrong peer lanes that the models must catch (--unjoined-peer-lanes, --unforked-peer-lanes, --flags-on-peer-lanes):
// joinLane(Drain, Push) not waiting for the peer lanes (Done before the pushes landed), peer lanes not forked from the
// Push lane (a push of a bounced input before the Drain lane filled it, or of an input before the caller's stream
// wrote it), a direct schedule's flags written on the peer lanes rather than on the Drain lane, where
// sdma::CallOrder orders them across calls, or (--relay-waits-on-root-lane) a relaying rank's wait for the root's
// chunk on the root's peer lane rather than on the lane of the peer it forwards the chunk to, which the forward then
// does not follow.
enum class PeerLaneFault {
  None,
  Unjoined,
  Unforked,
  FlagsOnPeerLanes,
  RelayWaitsOnRootLane,
  DrainFlagsBehindPeerLanes
};
PeerLaneFault peerLaneFault = PeerLaneFault::None;

// Set by --many-ranks: the direct, exchange and calls-in-flight cases draw 3 to 8 ranks, where several peers share
// a peer lane and a rank's peer lanes outnumber its other streams.
bool manyRanks = false;
int drawRanks(std::mt19937& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(manyRanks ? 3 : lo, manyRanks ? 8 : hi)(rng);
}

// The calls-in-flight model submits the direct transport's flag operations as the copy-engine transport collects
// them (FakeTransport::collectFlagOps), the staging transport's at once unless --collect-staging-flags.
bool collectStagingFlags = false;
// --signals-behind-waits: a lane's collected signals wait for its own next copy even where the other lane issues a
// wait first (the transport without CopyEngineTransport::issuePending's rule): caught hanging with
// --collect-staging-flags.
bool stagingFlagsBehindWaits = false;

[[noreturn]] void fail(const std::string& what) {
  if (failureEndsCase)
    throw std::runtime_error(what);
  fprintf(stderr, "FAIL: %s\n", what.c_str());
  exit(1);
}

// Gather and AwaitGather are the fake inner all-gather's (FakeRail below); Mark does nothing but let World::observe
// see where a lane stands (the end of a call).
struct Op {
  enum Kind { Copy, Signal, Wait, Reset, SignalOne, WaitOne, Join, Gather, AwaitGather, Mark } kind;
  char* dst = nullptr;
  const char* src = nullptr;
  size_t bytes = 0;
  Flag flag = Flag::Ready;
  int slot = 0;
  uint32_t value = 0;
  int peer = -1;
  std::vector<ByteSpan> pieces;  // Gather: this rank's part
  uint64_t fence = 0;            // Gather, Join: runs once this many operations of queue `peer` ran
};

// The queues a rank's operations go to: one per lane, the inner all-gathers' own, and the peer lanes (below).
constexpr int kGatherQueue = 2;
constexpr int kFirstPeerLane = 3;
constexpr int kMaxPeerLanes = 7;  // a peer lane for each peer of 8 ranks
constexpr int kQueues = kFirstPeerLane + kMaxPeerLanes;

struct World;

// One rank's transport: staging and flags in ordinary memory, operations recorded per lane.
class FakeTransport : public Transport, public DirectTransport {
 public:
  // Every flag starts at `flagBase`, as a copy-engine transport that replaced an outgrown one does.
  FakeTransport(World* world, int rank, const StagingGeometry& g, uint32_t flagBase = 0)
      : world_(world), rank_(rank), g_(g) {
    staging_.assign(g.bytes(), 0);
    flags_.assign(static_cast<size_t>(kFlagKinds) * g.worldSize * g.slots, flagBase);
  }
  int rank() const override {
    return rank_;
  }
  const StagingGeometry& geometry() const override {
    return g_;
  }
  char* localSegment(int slot, int src) override {
    return staging_.data() + g_.segmentOffset(slot, src, rank_);
  }
  char* packSegment(int slot) override {
    if (!g_.hasPackSegment())
      fail("packSegment on a geometry without one");
    return staging_.data() + g_.packSegmentOffset(slot);
  }
  void copyLocal(Lane lane, void* dst, const void* src, size_t bytes) override {
    record(lane, {Op::Copy, static_cast<char*>(dst), static_cast<const char*>(src), bytes});
    ++calls["copyLocal"];
  }
  void pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) override;
  void pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) override;
  void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) override {
    record(lane, {Op::Signal, nullptr, nullptr, 0, flag, slot, value});
    ++calls["signalPeers"];
  }
  void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) override {
    record(lane, {Op::Wait, nullptr, nullptr, 0, flag, slot, value});
    ++calls["waitPeers"];
  }
  void resetOwnFlags(Lane lane, Flag flag, int slot) override {
    record(lane, {Op::Reset, nullptr, nullptr, 0, flag, slot});
  }
  DirectTransport* direct() override {
    return this;
  }
  void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) override {
    recordOn(laneOf(lane, peer), {Op::Copy, reinterpret_cast<char*>(peerDst), static_cast<const char*>(src), bytes});
  }
  void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) override {
    recordOn(laneOf(lane, peer), {Op::Copy, static_cast<char*>(dst), reinterpret_cast<const char*>(peerSrc), bytes});
  }
  void signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override {
    const Op op{Op::SignalOne, nullptr, nullptr, 0, flag, slot, value, peer};
    if (mutation == Mutation::ArrivedBeforePack && flag == Flag::Arrived && !bound) {
      const int q = queueOf(static_cast<int>(lane));
      lanes[q].insert(lanes[q].begin() + static_cast<std::ptrdiff_t>(callStart[q]++), op);
      ++recorded[q];
      return;
    }
    if (peerLaneFault == PeerLaneFault::FlagsOnPeerLanes && lane == Lane::Drain) {
      recordOn(laneOf(Lane::Push, peer), op);
      return;
    }
    recordOn(laneOf(lane, peer), op);
  }
  void waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override {
    if (mutation == Mutation::SkipDoneWait && flag == Flag::Done)
      return;
    recordOn(laneOf(lane, peer), {Op::WaitOne, nullptr, nullptr, 0, flag, slot, value, peer});
  }
  void waitPeerOnLaneOf(Lane lane, int lanePeer, int peer, Flag flag, int slot, uint32_t value) override {
    const int on = peerLaneFault == PeerLaneFault::RelayWaitsOnRootLane ? peer : lanePeer;
    recordOn(laneOf(lane, on), {Op::WaitOne, nullptr, nullptr, 0, flag, slot, value, peer});
  }
  void joinLane(Lane into, Lane from) override {
    join(static_cast<int>(into), static_cast<int>(from));
    if (into == Lane::Push && from == Lane::Drain)
      peerLaneForked_.assign(peerLaneForked_.size(), false);
    if (into == Lane::Drain && from == Lane::Push && peerLaneFault != PeerLaneFault::Unjoined)
      for (size_t j = 0; j < peerLaneUsed_.size(); ++j)
        if (peerLaneUsed_[j])
          join(static_cast<int>(Lane::Drain), kFirstPeerLane + static_cast<int>(j));
  }

  // Per-peer push lanes, as CopyEngineTransport runs a direct collective's Push operations that name a peer once the
  // runner bound them for the call: `count` of them (0: none, such operations stay on the Push lane), the peer at
  // rotation distance k on lane (k - 1) % count, so that a push waiting for a late peer holds up no push to another.
  void bindPeerLanes(int count) {
    if (count > kMaxPeerLanes)
      fail("more peer lanes than the model has queues for");
    peerLaneForked_.assign(count, false);
    peerLaneUsed_.assign(count, false);
  }

  uint32_t& flag(Flag f, int src, int slot) {
    return flags_[(static_cast<size_t>(f) * g_.worldSize + src) * g_.slots + slot];
  }
  // Which lanes share a queue: none (three GPU streams), the push and drain lanes (a one-chunk or synchronous
  // collective on one GPU stream, its gathers on another), or all (the host runner's worker).
  enum class Queues { PerLane, OneStreamAndGathers, One };
  Queues queues = Queues::PerLane;
  int queueOf(int lane) const {
    switch (queues) {
      case Queues::PerLane:
        return lane;
      case Queues::OneStreamAndGathers:
        return lane == kGatherQueue ? kGatherQueue : 0;
      case Queues::One:
        break;
    }
    return 0;
  }
  void recordOn(int lane, Op op) {
    if (bound && collectFlagOps) {
      // As CopyEngineTransport collects flag operations and issues them at the lane's next copy, fork or join point.
      const int key = pendingKey(lane);
      if (op.kind == Op::Signal || op.kind == Op::Wait || op.kind == Op::SignalOne || op.kind == Op::WaitOne ||
          op.kind == Op::Reset) {
        pending_[key].push_back(op);
        return;
      }
      issue(key);
      bound(lane, op);
      return;
    }
    if (bound) {
      bound(lane, op);
      return;
    }
    const int q = queueOf(lane);
    lanes[q].push_back(op);
    ++recorded[q];
  }
  // Issues every flag operation still collected, Push lane first, as CopyEngineTransport::flush after a schedule.
  void flushCollected() {
    for (int lane = 0; lane < kQueues; ++lane)
      issue(lane);
  }
  // Set by the models that bind the lanes to GPU streams, where a rank's streams may share hardware queues: flag
  // operations then reach the streams as the copy-engine transport submits them, collected until the lane's next
  // copy, fork or join point, the Drain lane's issued before any operation on a peer lane (`pushIsDrain`: the Push
  // and Drain lanes on one stream, with one collection).
  bool collectFlagOps = false;
  bool pushIsDrain = false;
  std::deque<Op> lanes[kQueues];
  uint64_t recorded[kQueues] = {};
  uint64_t executed[kQueues] = {};
  std::map<std::string, int> calls;
  // Set by the calls-in-flight model (CallsInFlight below) for the call being enqueued, as
  // CopyEngineTransport::bindLanes binds the lanes to that call's streams: the lanes' operations and joins go to the
  // rank's queues instead of the transport's own.
  std::function<void(int lane, const Op& op)> bound;
  std::function<void(int into, int from)> boundJoin;
  // A wrong direct schedule the exchange model must catch (--exchanges --skip-done-wait / --arrived-before-pack): its
  // Done waits left out (a call ends while peers still copy with its buffers), or its Arrived signals moved to where
  // the call's operations begin on their queue (callStart, set by markCallStart), before it packed its input into the
  // bounce area that peers read.
  enum class Mutation { None, SkipDoneWait, ArrivedBeforePack };
  Mutation mutation = Mutation::None;
  size_t callStart[kQueues] = {};
  void markCallStart() {
    for (int q = 0; q < kQueues; ++q)
      callStart[q] = lanes[q].size();
  }

 private:
  void record(Lane lane, Op op) {
    recordOn(static_cast<int>(lane), op);
  }
  // The lane an operation on `lane` naming `peer` runs on; a peer lane's first use since the call began or since the
  // Push lane last joined the Drain lane first waits for what the Push lane holds.
  int laneOf(Lane lane, int peer) {
    if (lane != Lane::Push || peer == rank_)
      return static_cast<int>(lane);
    // A signal collected on the Drain lane (a call's Arrived) submitted behind a push's wait would sit behind that
    // wait wherever the two streams share a hardware queue, while the peer waits for the signal.
    if (collectFlagOps && peerLaneFault != PeerLaneFault::DrainFlagsBehindPeerLanes && !pushIsDrain)
      issue(static_cast<int>(Lane::Drain));
    if (peerLaneForked_.empty())
      return static_cast<int>(lane);
    const int k = (peer - rank_ + g_.worldSize) % g_.worldSize;
    const int j = (k - 1) % static_cast<int>(peerLaneForked_.size());
    if (!peerLaneForked_[j]) {
      peerLaneForked_[j] = true;
      peerLaneUsed_[j] = true;
      if (peerLaneFault != PeerLaneFault::Unforked) {
        issue(static_cast<int>(Lane::Push));
        if (boundJoin)
          boundJoin(kFirstPeerLane + j, static_cast<int>(Lane::Push));
        else
          join(kFirstPeerLane + j, static_cast<int>(Lane::Push));
      }
    }
    return kFirstPeerLane + j;
  }
  int pendingKey(int lane) const {
    return lane == static_cast<int>(Lane::Drain) && pushIsDrain ? static_cast<int>(Lane::Push) : lane;
  }
  // As CopyEngineTransport::issuePending: the other of the Push and Drain lanes' leading collected signals first, so
  // that no wait of this lane reaches a shared hardware queue ahead of a signal collected before it on the other.
  void issue(int lane) {
    const int push = static_cast<int>(Lane::Push), drain = static_cast<int>(Lane::Drain);
    if (!pushIsDrain && (lane == push || lane == drain) && !pending_[lane].empty() && !stagingFlagsBehindWaits) {
      const int other = lane == push ? drain : push;
      auto& theirs = pending_[other];
      size_t n = 0;
      while (n < theirs.size() &&
             (theirs[n].kind == Op::Signal || theirs[n].kind == Op::SignalOne || theirs[n].kind == Op::Reset))
        bound(other, theirs[n++]);
      theirs.erase(theirs.begin(), theirs.begin() + static_cast<long>(n));
    }
    std::vector<Op> ops;
    ops.swap(pending_[pendingKey(lane)]);
    for (const Op& op : ops)
      bound(lane, op);
  }
  void join(int into, int from) {
    if (boundJoin) {
      if (collectFlagOps) {
        issue(from);
        issue(into);
      }
      boundJoin(into, from);
      return;
    }
    const int fromQueue = queueOf(from);
    if (fromQueue != queueOf(into)) {
      Op op{Op::Join};
      op.peer = fromQueue;
      op.fence = recorded[fromQueue];
      recordOn(into, op);
    }
  }

  World* world_;
  int rank_;
  StagingGeometry g_;
  std::vector<char> staging_;
  std::vector<uint32_t> flags_;
  std::vector<bool> peerLaneForked_, peerLaneUsed_;  // by peer lane
  std::vector<Op> pending_[kQueues];                 // by lane: flag operations collected, not yet issued
};

struct World {
  std::vector<std::unique_ptr<FakeTransport>> ranks;
  // Sees every operation of rank r just before it runs.
  std::function<void(int r, const Op& op)> observe;

  // Executes every lane's operations in a random order that respects each lane's order and its waits.
  void run(std::mt19937& rng, const std::string& what) {
    const int W = static_cast<int>(ranks.size());
    while (true) {
      std::vector<std::pair<int, int>> runnable;
      bool anyLeft = false;
      for (int r = 0; r < W; ++r) {
        for (int l = 0; l < kQueues; ++l) {
          auto& q = ranks[r]->lanes[l];
          if (q.empty())
            continue;
          anyLeft = true;
          if (ready(r, q.front()))
            runnable.push_back({r, l});
        }
      }
      if (!anyLeft)
        return;
      if (runnable.empty())
        fail(what + ": every lane waits on a flag no lane will set (deadlock)");
      auto [r, l] = runnable[std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(rng)];
      Op op = ranks[r]->lanes[l].front();
      ranks[r]->lanes[l].pop_front();
      ++ranks[r]->executed[l];
      if (observe)
        observe(r, op);
      execute(r, op);
    }
  }

  bool ready(int r, const Op& op) {
    const int W = static_cast<int>(ranks.size());
    if (op.kind == Op::Wait) {
      for (int q = 0; q < W; ++q) {
        if (q != r && !flagReached(ranks[r]->flag(op.flag, q, op.slot), op.value))
          return false;
      }
    }
    if (op.kind == Op::WaitOne)
      return flagReached(ranks[r]->flag(op.flag, op.peer, op.slot), op.value);
    if (op.kind == Op::Join)
      return ranks[r]->executed[op.peer] >= op.fence;
    return true;
  }

  void execute(int r, const Op& op) {
    const int W = static_cast<int>(ranks.size());
    switch (op.kind) {
      case Op::Copy:
        if (op.bytes > 0)  // an empty vector's data() may be null, which memmove must not get
          memmove(op.dst, op.src, op.bytes);
        break;
      case Op::Signal:
        for (int q = 0; q < W; ++q) {
          if (q != r)
            ranks[q]->flag(op.flag, r, op.slot) = op.value;
        }
        break;
      case Op::SignalOne:
        ranks[op.peer]->flag(op.flag, r, op.slot) = op.value;
        break;
      case Op::Reset:
        for (int q = 0; q < W; ++q) {
          if (q != r)
            ranks[r]->flag(op.flag, q, op.slot) = 0;
        }
        break;
      case Op::Wait:
      case Op::WaitOne:
      case Op::Join:
      case Op::Gather:  // the fake rail's (HierarchicalWorld below)
      case Op::AwaitGather:
      case Op::Mark:
        break;
    }
  }
};

// One group's staging and direct transports for n ranks, as the calls-in-flight and fault models draw them: staging
// segments of 1..maxSegment bytes, with or without pipelining, 2 or 4 slots for each path, and flags that start at 0,
// near the 2^32 wrap or anywhere, so that serials wrap inside a case.
struct DrawnTransports {
  StagingGeometry staging, direct;
  uint64_t start = 0;     // the staging flags' and chunk counters' first value
  uint32_t flagBase = 0;  // the direct serials' first value
};

DrawnTransports drawTransports(std::mt19937& rng, int n, size_t maxSegment, World& staging, World& direct) {
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  DrawnTransports d;
  d.staging.worldSize = n;
  d.staging.slots = pick(0, 1) ? 2 : 4;
  d.staging.chunkBytes = std::uniform_int_distribution<size_t>(1, maxSegment)(rng);
  d.staging.pipelineChunkBytes = pick(0, 1) ? 0 : std::uniform_int_distribution<size_t>(1, 40)(rng);
  d.direct.worldSize = n;
  d.direct.slots = pick(0, 1) ? kRelayMaxChunks : 2 * kRelayMaxChunks;  // a relayed broadcast's at least
  d.direct.chunkBytes = 64;
  d.direct.packs = false;
  d.start = pick(0, 3) == 0 ? 0xFFFFFFF0u : 0;
  const uint32_t bases[] = {0, 0xfffffffdu, static_cast<uint32_t>(rng())};
  d.flagBase = bases[pick(0, 2)];
  for (int i = 0; i < n; ++i) {
    staging.ranks.push_back(std::make_unique<FakeTransport>(&staging, i, d.staging));
    FakeTransport& t = *staging.ranks.back();
    for (int q = 0; q < n; ++q)
      for (int s = 0; s < d.staging.slots; ++s)
        t.flag(Flag::Credit, q, s) = t.flag(Flag::Ready, q, s) = static_cast<uint32_t>(d.start);
    direct.ranks.push_back(std::make_unique<FakeTransport>(&direct, i, d.direct, d.flagBase));
  }
  return d;
}

void FakeTransport::pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) {
  for (int k = 1; k < g_.worldSize; ++k) {
    const int peer = (rank_ + k) % g_.worldSize;
    FakeTransport& p = *world_->ranks[peer];
    record(lane, {Op::Copy, p.staging_.data() + g_.segmentOffset(slot, rank_, peer) + at, static_cast<const char*>(src),
                  bytes});
  }
  ++calls["pushChunkToPeers"];
}

void FakeTransport::pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) {
  FakeTransport& p = *world_->ranks[peer];
  recordOn(laneOf(lane, peer), {Op::Copy, p.staging_.data() + g_.segmentOffset(slot, rank_, peer) + at,
                                static_cast<const char*>(src), bytes});
  ++calls["pushChunkToPeer"];
}

// One collective's buffers on every rank, in one of the forms the backend reduces to plans.
struct Buffers {
  std::vector<std::vector<char>> inputs;   // per rank
  std::vector<std::vector<char>> outputs;  // per rank
  std::vector<AllgatherPlan> plans;        // per rank
  size_t bytesPerRank = 0;
};

enum class Form { IntoTensor, InPlace, List, Coalesced };

Buffers makeCollective(Form form, int W, size_t bytesPerRank, std::mt19937& rng) {
  Buffers b;
  b.bytesPerRank = bytesPerRank;
  // Coalesced: the rank's stream cut into a few tensors of random sizes, each gathered into its own output.
  std::vector<size_t> pieces;
  if (form == Form::Coalesced) {
    size_t left = bytesPerRank;
    while (left > 0) {
      const size_t n = std::min(left, std::uniform_int_distribution<size_t>(1, bytesPerRank / 2 + 1)(rng));
      pieces.push_back(n);
      left -= n;
    }
  }
  for (int r = 0; r < W; ++r) {
    std::vector<char> in(bytesPerRank);
    for (auto& c : in)
      c = static_cast<char>(rng());
    std::vector<char> out(bytesPerRank * W);
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<char>(~(i * 7 + r));  // poison
    b.inputs.push_back(std::move(in));
    b.outputs.push_back(std::move(out));
  }
  for (int r = 0; r < W; ++r) {
    AllgatherPlan p;
    p.bytesPerRank = bytesPerRank;
    char* out = b.outputs[r].data();
    char* in = b.inputs[r].data();
    if (form == Form::InPlace) {
      if (bytesPerRank > 0)
        memcpy(out + r * bytesPerRank, in, bytesPerRank);
      in = out + r * bytesPerRank;
    }
    if (form == Form::Coalesced) {
      // Output tensor i holds W copies of piece i: rank q's piece i at outBase_i + q * size_i.
      size_t inAt = 0, outAt = 0;
      p.outputByRank.resize(W);
      for (size_t n : pieces) {
        p.input.push_back({in + inAt, n});
        for (int q = 0; q < W; ++q)
          p.outputByRank[q].push_back({out + outAt + q * n, n});
        inAt += n;
        outAt += n * W;
      }
    } else {
      p.input = {{in, bytesPerRank}};
      for (int q = 0; q < W; ++q)
        p.outputByRank.push_back({{out + q * bytesPerRank, bytesPerRank}});
      if (form != Form::List)
        p.outputBase = out;
    }
    b.plans.push_back(p);
  }
  return b;
}

void checkOutputs(const Buffers& b, const std::vector<std::vector<char>>& original, const std::string& what) {
  const int W = static_cast<int>(b.outputs.size());
  for (int r = 0; r < W; ++r) {
    for (int q = 0; q < W; ++q) {
      // Walk rank q's stream through rank r's output spans.
      size_t at = 0;
      for (const ByteSpan& s : b.plans[r].outputByRank[q]) {
        if (s.bytes > 0 && memcmp(s.ptr, original[q].data() + at, s.bytes) != 0) {
          fail(what + ": rank " + std::to_string(r) + " holds wrong bytes for rank " + std::to_string(q));
        }
        at += s.bytes;
      }
    }
  }
}

const char* formName(Form f) {
  switch (f) {
    case Form::IntoTensor:
      return "into_tensor";
    case Form::InPlace:
      return "in_place";
    case Form::List:
      return "list";
    case Form::Coalesced:
      return "coalesced";
  }
  return "?";
}

// 1 to 5 ranks, 2 or 4 slots, tiny segments and chunks: messages of a few hundred bytes span many chunks.
StagingGeometry randomGeometry(std::mt19937& rng) {
  StagingGeometry g;
  g.worldSize = std::uniform_int_distribution<int>(1, 5)(rng);
  g.slots = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
  g.chunkBytes = std::uniform_int_distribution<size_t>(1, 96)(rng);
  g.pipelineChunkBytes =
      std::uniform_int_distribution<int>(0, 1)(rng) ? 0 : std::uniform_int_distribution<size_t>(1, 40)(rng);
  return g;
}

std::string describe(const char* kind, int caseNo, const StagingGeometry& g, const std::string& rest) {
  return std::string(kind) + " case " + std::to_string(caseNo) + " (W=" + std::to_string(g.worldSize) +
         ", slots=" + std::to_string(g.slots) + ", segment=" + std::to_string(g.chunkBytes) +
         ", chunk=" + std::to_string(g.pipelineChunkBytes) + ", " + rest + ")";
}

// Several collectives in a row on one group (serials and credits carry over), each checked.
void stagingCase(std::mt19937& rng, int caseNo) {
  const StagingGeometry g = randomGeometry(rng);
  const int W = g.worldSize;
  // The chunk count is 64-bit and the flags carry its low 32 bits: starting near 2^32 (flags "given" up to there)
  // makes them wrap inside the case.
  const uint64_t start = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0xFFFFFFF0u : 0;
  World world;
  std::vector<uint64_t> serials(W, start);
  for (int r = 0; r < W; ++r) {
    world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g));
    // Credits start "given" for the serials before the first chunk, as zero-initialised flags are for serial 0.
    for (int q = 0; q < W; ++q)
      for (int s = 0; s < g.slots; ++s)
        world.ranks[r]->flag(Flag::Credit, q, s) = static_cast<uint32_t>(start);
    for (int q = 0; q < W; ++q)
      for (int s = 0; s < g.slots; ++s)
        world.ranks[r]->flag(Flag::Ready, q, s) = static_cast<uint32_t>(start);
  }
  const int collectives = std::uniform_int_distribution<int>(1, 4)(rng);
  for (int c = 0; c < collectives; ++c) {
    const Form form = static_cast<Form>(std::uniform_int_distribution<int>(0, 3)(rng));
    const size_t bytes =
        std::uniform_int_distribution<int>(0, 5)(rng) == 0 ? 0 : std::uniform_int_distribution<size_t>(1, 300)(rng);
    Buffers b = makeCollective(form, W, bytes, rng);
    std::vector<std::vector<char>> original = b.inputs;
    for (int r = 0; r < W; ++r) {
      if (form == Form::InPlace) {
        original[r].assign(b.plans[r].input[0].ptr, b.plans[r].input[0].ptr + bytes);
      }
      scheduleStagingAllgather(*world.ranks[r], b.plans[r], serials[r]);
    }
    const std::string what =
        describe("staging", caseNo, g, std::string(formName(form)) + ", " + std::to_string(bytes) + " B/rank");
    for (int r = 1; r < W; ++r) {
      if (serials[r] != serials[0])
        fail(what + ": ranks disagree on the chunk serial");
    }
    const uint32_t chunks = static_cast<uint32_t>(chunkCount(b.plans[0], g));
    if (bytes > 0 && serials[0] - start < chunks)
      fail(what + ": serial advanced by less than the chunk count");
    world.run(rng, what);
    checkOutputs(b, original, what);
  }
}

// The direct schedule: every pair settles one of the ways the arrival mailbox settles it (each pushes its own
// bytes, or one came late and moves both directions), across collectives, from flags that start anywhere, near the
// wrap too. A rank posts its own buffers, or a bounce area of its own for either (a buffer its peers cannot map);
// lanes run apart (GPU streams: push, drain and 1 to W - 1 peer lanes) or as one (the host runner's worker).
void directCase(std::mt19937& rng, int caseNo) {
  const int W = drawRanks(rng, 2, 8);
  StagingGeometry g;
  g.worldSize = W;
  g.slots = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
  g.chunkBytes = 64;
  g.packs = false;
  const uint32_t bases[] = {0, 0xfffffffdu, static_cast<uint32_t>(rng())};
  const uint32_t flagBase = bases[std::uniform_int_distribution<int>(0, 2)(rng)];
  World world;
  const bool oneQueue = std::uniform_int_distribution<int>(0, 1)(rng);
  // Peer lanes where the lanes are GPU streams, as the copy-engine runner binds them: as many as the hardware queues'
  // budget allows, at most one a peer.
  const int peerLanes = oneQueue ? 0 : std::uniform_int_distribution<int>(1, W - 1)(rng);
  for (int r = 0; r < W; ++r) {
    world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g, flagBase));
    world.ranks.back()->queues = oneQueue ? FakeTransport::Queues::One : FakeTransport::Queues::PerLane;
  }
  for (uint32_t serial = flagBase + 1; serial != flagBase + 5; ++serial) {
    const Form form = std::uniform_int_distribution<int>(0, 1)(rng) ? Form::IntoTensor : Form::InPlace;
    const size_t bytes = std::uniform_int_distribution<size_t>(1, 300)(rng);
    Buffers b = makeCollective(form, W, bytes, rng);
    std::vector<std::vector<char>> original = b.inputs;
    std::vector<std::vector<char>> bounce(W, std::vector<char>(W * bytes, 0x5a));
    std::vector<PostedBuffers> posted(W);
    std::string bounced;
    for (int r = 0; r < W; ++r) {
      const int pick = std::uniform_int_distribution<int>(0, 3)(rng);  // bit 0: input bounced, bit 1: output
      posted[r].input = pick & 1 ? bounce[r].data() + r * bytes : b.plans[r].input[0].ptr;
      posted[r].outputBase = pick & 2 ? bounce[r].data() : b.plans[r].outputBase;
      bounced += std::to_string(pick);
    }
    // pairing[r][q]: how r and q settled their pair, as the arrival mailbox would: in the order the ranks posted,
    // a later one came late for an earlier one (which stopped waiting for it), or each pushes its own bytes. A rank
    // comes late only for ranks that posted before it, so "came late" never runs in a circle.
    std::vector<int> postOrder(W);
    for (int r = 0; r < W; ++r)
      postOrder[r] = r;
    std::shuffle(postOrder.begin(), postOrder.end(), rng);
    std::vector<std::vector<Pairing>> pairing(W, std::vector<Pairing>(W, Pairing::kPeerCameLate));
    for (int i = 0; i < W; ++i) {
      for (int j = i + 1; j < W; ++j) {
        const int earlier = postOrder[i], later = postOrder[j];
        const bool lateOne = std::uniform_int_distribution<int>(0, 1)(rng);
        pairing[earlier][later] = lateOne ? Pairing::kPeerCameLate : Pairing::kEachPushesOwn;
        pairing[later][earlier] = lateOne ? Pairing::kThisCameLate : Pairing::kEachPushesOwn;
      }
    }
    for (int r = 0; r < W; ++r) {
      if (form == Form::InPlace)
        original[r].assign(b.plans[r].input[0].ptr, b.plans[r].input[0].ptr + bytes);
      std::vector<PeerBuffers> posts(W);
      for (int q = 0; q < W; ++q) {
        if (q != r) {
          posts[q] = {pairing[r][q], reinterpret_cast<uint64_t>(posted[q].input),
                      reinterpret_cast<uint64_t>(posted[q].outputBase)};
        }
      }
      world.ranks[r]->bindPeerLanes(peerLanes);
      scheduleDirectAllgather(*world.ranks[r], b.plans[r], serial, posted[r], posts);
    }
    const std::string what =
        "direct case " + std::to_string(caseNo) + " (W=" + std::to_string(W) + ", " + std::to_string(g.slots) +
        " slots, " + formName(form) + ", " + std::to_string(bytes) + " bytes, serial " + std::to_string(serial) +
        ", bounced " + bounced +
        (oneQueue ? ", one lane" : ", two lanes and " + std::to_string(peerLanes) + " peer lanes") + ")";
    world.run(rng, what);
    checkOutputs(b, original, what);
  }
}

// The exchanges (all-to-all, broadcast, gather, scatter) reduced to ExchangePlans, as collective/exchange_inputs.cpp
// reduces them: per rank an input and an output region, each one contiguous region of a tensor or, for the list
// forms, pieces (the tensors of the list) that a bounce area stands in for.
enum class ExchangeKind { AlltoallSingle, AlltoallList, Broadcast, Gather, Scatter };
constexpr int kExchangeKinds = 5;

const char* exchangeKindName(ExchangeKind k) {
  switch (k) {
    case ExchangeKind::AlltoallSingle:
      return "all_to_all_single";
    case ExchangeKind::AlltoallList:
      return "all_to_all";
    case ExchangeKind::Broadcast:
      return "broadcast";
    case ExchangeKind::Gather:
      return "gather";
    case ExchangeKind::Scatter:
      return "scatter";
  }
  return "?";
}

// One exchange's buffers on every rank. Each rank's input and output lie in arenas of their own, its regions or
// pieces at shuffled places with poisoned bytes around each, so that a stray write anywhere shows.
struct Exchange {
  ExchangeKind kind = ExchangeKind::AlltoallSingle;
  int root = -1;
  std::vector<ExchangePlan> plans;              // per rank
  std::vector<std::vector<char>> inputs;        // per rank: the arena its input region lies in
  std::vector<std::vector<char>> outputs;       // per rank: the arena its output region lies in
  std::vector<std::vector<char>> sent;          // per rank: its input region's bytes, in region order
  std::vector<std::vector<char>> inputsAfter;   // per rank: its input arena once the input was written
  std::vector<std::vector<char>> outputsAfter;  // per rank: its output arena once the call ended
  std::vector<std::vector<char>> bounce;        // per rank: the bounce area (input part, then output part)
  std::vector<PostedBuffers> posted;            // per rank: its regions, or the bounce area standing in
  std::string description;
};

// Calls visit(pointer, bytes) for each contiguous part of bytes [offset, offset + bytes) of a region.
template <class Visit>
void walkRegion(const std::vector<ByteSpan>& region, uint64_t offset, uint64_t bytes, Visit&& visit) {
  for (const ByteSpan& s : region) {
    if (bytes == 0)
      return;
    if (offset >= s.bytes) {
      offset -= s.bytes;
      continue;
    }
    const uint64_t n = std::min<uint64_t>(bytes, s.bytes - offset);
    visit(s.ptr + offset, n);
    offset = 0;
    bytes -= n;
  }
  if (bytes > 0)
    fail("a range past the end of its region");
}

// Places pieces of `sizes` bytes into `arena` at shuffled places, 1 to 8 poisoned bytes around each.
std::vector<ByteSpan> layOut(std::vector<char>& arena, const std::vector<uint64_t>& sizes, int rank,
                             std::mt19937& rng) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::uniform_int_distribution<uint64_t> gap(1, 8);
  std::vector<uint64_t> at(sizes.size());
  uint64_t end = gap(rng);
  for (size_t k : order) {
    at[k] = end;
    end += sizes[k] + gap(rng);
  }
  arena.resize(end);
  for (size_t i = 0; i < arena.size(); ++i)
    arena[i] = static_cast<char>(~(i * 7 + rank));  // poison
  std::vector<ByteSpan> spans(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k)
    spans[k] = {arena.data() + at[k], sizes[k]};
  return spans;
}

// The list form's pieces posted where they are, as the shared-memory runner posts them (postPiecesInPlace): the region
// starts at the lowest piece and each range is rebased on it, past the packed byte count where pieces lie apart.
bool rebaseOnFirstPiece(const std::vector<ByteSpan>& pieces, std::vector<ByteRange>& ranges, char** base) {
  *base = nullptr;
  for (const ByteSpan& piece : pieces)
    if (piece.bytes > 0 && (!*base || piece.ptr < *base))
      *base = piece.ptr;
  if (!*base)
    return false;
  for (ByteRange& range : ranges) {
    if (range.bytes == 0) {
      range.offset = 0;
      continue;
    }
    uint64_t start = 0;
    for (const ByteSpan& piece : pieces) {
      if (range.offset >= start && range.offset + range.bytes <= start + piece.bytes) {
        range.offset = static_cast<uint64_t>(piece.ptr - *base) + (range.offset - start);
        break;
      }
      start += piece.bytes;
    }
  }
  return true;
}

// A random exchange of `kind` over W ranks: all-to-all splits uneven, zeros among them, or even; broadcast, gather and
// scatter from a random root. Each rank's regions posted as they are or (bit by bit of a random pick) bounced, as
// the CUDA runner does for memory its peers cannot map; packed regions bounced, as the CUDA runner does, or, with
// `hostPosting` (the eager exchange's own cases), posted in place with their ranges rebased as the shared-memory runner
// does, a quarter of the list all-to-alls in place (each output the input for the same peer).
Exchange makeExchange(ExchangeKind kind, int W, std::mt19937& rng, bool mayRelay = false, bool hostPosting = false) {
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto size = [&] { return pick(0, 3) == 0 ? uint64_t{0} : static_cast<uint64_t>(pick(1, 48)); };
  Exchange x;
  x.kind = kind;
  x.description = exchangeKindName(kind);
  uint64_t n = 0;        // broadcast, gather, scatter: the bytes of the one tensor (per rank)
  bool aliased = false;  // a list all-to-all whose outputs are its inputs
  // bytes[i][j]: what rank i sends rank j.
  std::vector<std::vector<uint64_t>> bytes(W, std::vector<uint64_t>(W, 0));
  const bool allToAll = kind == ExchangeKind::AlltoallSingle || kind == ExchangeKind::AlltoallList;
  if (allToAll) {
    const bool even = kind == ExchangeKind::AlltoallSingle && pick(0, 3) == 0;
    // A quarter of the list forms in place: rank i's output for j is its input for j, so the splits are symmetric.
    aliased = hostPosting && kind == ExchangeKind::AlltoallList && pick(0, 3) == 0;
    const uint64_t each = size();
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < W; ++j)
        bytes[i][j] = even ? each : aliased && j < i ? bytes[j][i] : size();
    x.description += even ? " even" : aliased ? " in place, splits" : " splits";
    for (int i = 0; i < W; ++i) {
      x.description += i ? "|" : " ";
      for (int j = 0; j < W; ++j)
        x.description += (j ? "," : "") + std::to_string(bytes[i][j]);
    }
  } else {
    x.root = pick(0, W - 1);
    n = size();
    for (int i = 0; i < W; ++i)
      for (int j = 0; j < W; ++j) {
        const bool moves = kind == ExchangeKind::Broadcast ? i == x.root && j != x.root
                           : kind == ExchangeKind::Gather  ? j == x.root
                                                           : i == x.root;
        bytes[i][j] = moves ? n : 0;
      }
    x.description += " root " + std::to_string(x.root) + ", " + std::to_string(n) + " B";
  }
  // A broadcast among more than two ranks relayed through the peers half of the time where the runner may relay
  // (eager calls), in chunks of a few bytes: every part a few chunks, each announced on its own flag slot.
  const bool relayed = mayRelay && kind == ExchangeKind::Broadcast && W > 2 && n > 0 && pick(0, 1);
  const uint64_t relayUnit = relayed ? static_cast<uint64_t>(pick(1, 3)) : 0;
  // In 1 to 8 chunks, or as many as the plan's own rule gives (0).
  const int relayChunks = relayed ? pick(0, 8) : 0;
  // A gather whose root pulls (as the copy-engine runner's, whose ranks post no list in place) half of the time.
  const bool pullingRoot = kind == ExchangeKind::Gather && pick(0, 1);
  if (pullingRoot)
    x.description += " pulled by the root";
  if (relayed)
    x.description += " relayed in " + (relayChunks ? std::to_string(relayChunks) : std::string("its")) + " chunks";
  x.plans.resize(W);
  x.inputs.resize(W);
  x.outputs.resize(W);
  x.sent.resize(W);
  x.bounce.resize(W);
  x.posted.resize(W);
  x.description += ", bounced ";
  for (int r = 0; r < W; ++r) {
    ExchangePlan& p = x.plans[r];
    p.sendTo.assign(W, {});
    p.recvFrom.assign(W, {});
    // The region sizes (one region, or the pieces of a list) and whether they are pieces; which ranges of them.
    std::vector<uint64_t> inSizes, outSizes;
    bool inPieces = false, outPieces = false;
    if (allToAll) {
      for (int q = 0; q < W; ++q) {
        p.sendTo[q] = {p.inputBytes, bytes[r][q]};
        p.inputBytes += bytes[r][q];
        p.recvFrom[q] = {p.outputBytes, bytes[q][r]};
        p.outputBytes += bytes[q][r];
        inSizes.push_back(bytes[r][q]);
        outSizes.push_back(bytes[q][r]);
      }
      inPieces = outPieces = kind == ExchangeKind::AlltoallList;
      if (!inPieces) {
        inSizes = {p.inputBytes};
        outSizes = {p.outputBytes};
      }
    } else {
      const bool isRoot = r == x.root;
      if (kind == ExchangeKind::Broadcast) {
        // The root's tensor is its input, every other rank's its output.
        if (isRoot) {
          for (int q = 0; q < W; ++q)
            if (q != r)
              p.sendTo[q] = {0, n};
          p.inputBytes = n;
          inSizes = {n};
        } else {
          p.recvFrom[x.root] = {0, n};
          p.outputBytes = n;
          outSizes = {n};
        }
      } else if (kind == ExchangeKind::Gather) {
        p.sendTo[x.root] = {0, n};
        p.inputBytes = n;
        inSizes = {n};
        if (isRoot) {
          for (int q = 0; q < W; ++q) {
            p.recvFrom[q] = {q * n, n};
            outSizes.push_back(n);
          }
          p.outputBytes = W * n;
          outPieces = true;
        }
      } else {
        p.recvFrom[x.root] = {0, n};
        p.outputBytes = n;
        outSizes = {n};
        if (isRoot) {
          for (int q = 0; q < W; ++q) {
            p.sendTo[q] = {q * n, n};
            inSizes.push_back(n);
          }
          p.inputBytes = W * n;
          inPieces = true;
        }
      }
    }
    const std::vector<ByteSpan> in = layOut(x.inputs[r], inSizes, r, rng);
    const std::vector<ByteSpan> out = aliased ? in : layOut(x.outputs[r], outSizes, r, rng);
    if (inPieces)
      p.inputPieces = in;
    else if (!in.empty())
      p.input = in.front().ptr;
    if (outPieces)
      p.outputPieces = out;
    else if (!out.empty())
      p.output = out.front().ptr;
    if (relayed)
      p = relayedBroadcastPlan(r == x.root ? const_cast<char*>(p.input) : p.output, n, x.root, r, W, relayUnit,
                               relayChunks);
    if (pullingRoot)
      p.pullingRoot = x.root;
    // Its input's bytes, random; then its posted regions.
    x.sent[r].resize(p.inputBytes);
    for (auto& c : x.sent[r])
      c = static_cast<char>(rng());
    uint64_t at = 0;
    walkRegion(inputRegion(p), 0, p.inputBytes, [&](char* ptr, uint64_t n) {
      memcpy(ptr, x.sent[r].data() + at, n);
      at += n;
    });
    const int bits = pick(0, 3);  // bit 0: input bounced, bit 1: output
    const bool inputBounced = p.inputBytes > 0 && (p.inputPacked() || (bits & 1));
    const bool outputBounced = p.outputBytes > 0 && (p.outputPacked() || (bits & 2));
    const uint64_t outputAt = inputBounced ? p.inputBytes : 0;
    x.bounce[r].assign(outputAt + (outputBounced ? p.outputBytes : 0), 0x5a);
    x.posted[r] = {inputBounced ? x.bounce[r].data() : p.input,
                   outputBounced ? x.bounce[r].data() + outputAt : p.output};
    x.description += std::to_string(inputBounced + 2 * outputBounced);
  }
  x.inputsAfter = x.inputs;
  x.outputsAfter = x.outputs;
  for (int r = 0; r < W; ++r) {
    // In place, rank r's output pieces lie in its input arena.
    const std::vector<char>& outArena = aliased ? x.inputs[r] : x.outputs[r];
    std::vector<char>& outAfter = aliased ? x.inputsAfter[r] : x.outputsAfter[r];
    for (int q = 0; q < W; ++q) {
      const ByteRange& from = x.plans[r].recvFrom[q];
      const ByteRange& to = x.plans[q].sendTo[r];
      if (from.bytes != to.bytes)
        fail("makeExchange: rank " + std::to_string(q) + " sends rank " + std::to_string(r) + " other bytes than it " +
             "expects");
      // Rank q's bytes into rank r's output region, at the same places of the arena's copy; relayed, q's range is
      // of the root's tensor, which a relaying q forwards from its output.
      const char* src = x.sent[relayed ? x.root : q].data() + to.offset;
      walkRegion(outputRegion(x.plans[r]), from.offset, from.bytes, [&](char* ptr, uint64_t n) {
        memcpy(outAfter.data() + (ptr - outArena.data()), src, n);
        src += n;
      });
    }
  }
  // Half of the list forms' regions posted in place (every byte where it was expected above: only the ranges'
  // offsets change, and the pieces stay the region).
  for (int r = 0; r < W && hostPosting && !relayed && !pullingRoot; ++r) {
    ExchangePlan& p = x.plans[r];
    char* base = nullptr;
    // In place, the input stays bounced (the runner posts no input over its output) and the output is posted where it
    // lies, so that peers write over the input's own tensors.
    if (p.inputPacked() && !aliased && pick(0, 1) && rebaseOnFirstPiece(p.inputPieces, p.sendTo, &base)) {
      p.input = base;
      x.posted[r].input = base;
      x.description += " in-place-input" + std::to_string(r);
    }
    if (p.outputPacked() && (aliased || pick(0, 1)) && rebaseOnFirstPiece(p.outputPieces, p.recvFrom, &base)) {
      p.output = base;
      x.posted[r].outputBase = base;
      x.description += " in-place-output" + std::to_string(r);
    }
  }
  return x;
}

// How rank r sees each peer, as the runners hand it to scheduleDirectExchange: the pair as the mailbox settled it,
// and, where r learnt the peer's post, what the peer posted about the pair (its PairRanges for r) and the peer's
// posted regions, the output only where r sends it bytes and the input only where r pulls (as CopyEngineDirect maps
// them).
std::vector<ExchangePeer> exchangePeers(const Exchange& x, const std::vector<std::vector<Pairing>>& pairing, int r) {
  const int W = static_cast<int>(x.plans.size());
  std::vector<ExchangePeer> peers(W);
  for (int q = 0; q < W; ++q) {
    if (q == r)
      continue;
    ExchangePeer& peer = peers[q];
    peer.buffers.pairing = pairing[r][q];
    if (pairing[r][q] == Pairing::kPeerCameLate)
      continue;
    peer.ranges = pairRangesOf(x.plans[q])[r];
    // A relaying peer sends from its output, which r pulls from where it came late to the pair.
    const bool pullsFromInput = x.plans[r].relayRoot < 0 || q == x.plans[r].relayRoot;
    const bool pulls = pullsFrom(x.plans[r], r, q, pairing[r][q]);
    if (pushesTo(x.plans[r], q, pairing[r][q]) || (pulls && !pullsFromInput))
      peer.buffers.outputBase = reinterpret_cast<uint64_t>(x.posted[q].outputBase);
    if (pulls && pullsFromInput)
      peer.buffers.input = reinterpret_cast<uint64_t>(x.posted[q].input);
  }
  return peers;
}

// "" when rank r's arenas hold what they must once its call ended: its input as written, its output poisoned but
// for the ranges it received, each holding the sender's bytes.
std::string exchangeMismatch(const Exchange& x, int r) {
  for (int which = 0; which < 2; ++which) {
    const std::vector<char>& now = which ? x.outputs[r] : x.inputs[r];
    const std::vector<char>& must = which ? x.outputsAfter[r] : x.inputsAfter[r];
    for (size_t i = 0; i < now.size(); ++i) {
      if (now[i] != must[i])
        return "rank " + std::to_string(r) + "'s " + (which ? "output" : "input") + " arena differs at byte " +
               std::to_string(i);
    }
  }
  return "";
}

// The pairs of n ranks as the arrival mailbox settles them (as directCase draws them).
std::vector<std::vector<Pairing>> settlePairs(int n, std::mt19937& rng) {
  std::vector<int> postOrder(n);
  std::iota(postOrder.begin(), postOrder.end(), 0);
  std::shuffle(postOrder.begin(), postOrder.end(), rng);
  std::vector<std::vector<Pairing>> pairing(n, std::vector<Pairing>(n, Pairing::kPeerCameLate));
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      const bool lateOne = std::uniform_int_distribution<int>(0, 1)(rng);
      pairing[postOrder[i]][postOrder[j]] = lateOne ? Pairing::kPeerCameLate : Pairing::kEachPushesOwn;
      pairing[postOrder[j]][postOrder[i]] = lateOne ? Pairing::kThisCameLate : Pairing::kEachPushesOwn;
    }
  }
  return pairing;
}

// The exchange schedule (scheduleDirectExchange): 2 to 8 ranks, every kind of exchange, regions posted as they are or
// bounced, every pair settled as the mailbox may settle it, lanes apart (GPU streams, peer lanes among them, as
// directCase) or one queue (the host runner's worker), several calls in a row from flags that start anywhere, near the
// wrap too, each call run to its end before the next is recorded or all of them queued at once (async calls on the
// group's streams). When a call ends on a rank (its Drain lane's last operation), that rank's arenas must hold exactly
// what they must (exchangeMismatch), and no copy of that call may touch them afterwards. `mutation`: a wrong schedule
// that this must catch.
void exchangeCase(std::mt19937& rng, int caseNo, FakeTransport::Mutation mutation) {
  const int W = drawRanks(rng, 2, 8);
  StagingGeometry g;
  g.worldSize = W;
  g.slots = kRelayMaxChunks;  // a relayed broadcast's, as CopyEngineDirect sizes them
  g.chunkBytes = 64;
  g.packs = false;
  const uint32_t bases[] = {0, 0xfffffffdu, static_cast<uint32_t>(rng())};
  const uint32_t flagBase = bases[std::uniform_int_distribution<int>(0, 2)(rng)];
  const bool oneQueue = std::uniform_int_distribution<int>(0, 1)(rng);
  const bool queuedAtOnce = std::uniform_int_distribution<int>(0, 1)(rng);
  const int peerLanes = oneQueue ? 0 : std::uniform_int_distribution<int>(1, W - 1)(rng);  // as directCase
  World world;
  for (int r = 0; r < W; ++r) {
    world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g, flagBase));
    world.ranks.back()->queues = oneQueue ? FakeTransport::Queues::One : FakeTransport::Queues::PerLane;
    world.ranks.back()->mutation = mutation;
  }
  std::string what = "exchange case " + std::to_string(caseNo) + " (W=" + std::to_string(W) +
                     (oneQueue ? ", one queue" : ", two lanes and " + std::to_string(peerLanes) + " peer lanes") +
                     (queuedAtOnce ? ", queued at once" : "") + ", flags from " + std::to_string(flagBase) + "; calls:";
  std::vector<std::unique_ptr<Exchange>> calls;
  std::vector<std::vector<bool>> ended;  // [call][rank]
  // A call's end on rank r (a Mark whose value is the call's index): its arenas final, and no copy touches them again.
  world.observe = [&](int r, const Op& op) {
    if (op.kind == Op::Mark) {
      const std::string wrong = exchangeMismatch(*calls[op.value], r);
      if (!wrong.empty())
        fail(what + ": call " + std::to_string(op.value) + " ended with wrong bytes: " + wrong);
      ended[op.value][r] = true;
      return;
    }
    if (op.kind != Op::Copy || op.bytes == 0)
      return;
    auto overlaps = [&](const char* p, const std::vector<char>& v) {
      return !v.empty() && p < v.data() + v.size() && v.data() < p + op.bytes;
    };
    for (size_t c = 0; c < calls.size(); ++c)
      for (int p = 0; p < W; ++p)
        for (const std::vector<char>* v : {&calls[c]->inputs[p], &calls[c]->outputs[p], &calls[c]->bounce[p]})
          if (ended[c][p] && (overlaps(op.dst, *v) || overlaps(op.src, *v)))
            fail(what + ": rank " + std::to_string(r) + " copied into or out of rank " + std::to_string(p) +
                 "'s buffers of call " + std::to_string(c) + " after that call ended there");
  };
  const int count = std::uniform_int_distribution<int>(2, 4)(rng);
  for (int c = 0; c < count; ++c) {
    const auto kind = static_cast<ExchangeKind>(std::uniform_int_distribution<int>(0, kExchangeKinds - 1)(rng));
    calls.push_back(std::make_unique<Exchange>(makeExchange(kind, W, rng, true, true)));
    ended.emplace_back(W, false);
    const Exchange& x = *calls.back();
    const std::vector<std::vector<Pairing>> pairing = settlePairs(W, rng);
    what += std::string(c ? "; " : " ") + x.description + ", late pairs";
    for (int r = 0; r < W; ++r)
      for (int q = 0; q < W; ++q)
        if (pairing[r][q] == Pairing::kThisCameLate)
          what += " " + std::to_string(r) + ">" + std::to_string(q);
    const uint32_t serial = flagBase + 1 + static_cast<uint32_t>(c);
    for (int r = 0; r < W; ++r) {
      FakeTransport& t = *world.ranks[r];
      t.markCallStart();
      t.bindPeerLanes(peerLanes);
      scheduleDirectExchange(t, x.plans[r], serial, x.posted[r], exchangePeers(x, pairing, r));
      Op end{Op::Mark};
      end.value = static_cast<uint32_t>(c);
      t.recordOn(static_cast<int>(Lane::Drain), end);
    }
    if (!queuedAtOnce)
      world.run(rng, what + ")");
  }
  what += ")";
  world.run(rng, what);
  for (size_t c = 0; c < calls.size(); ++c)
    for (int r = 0; r < W; ++r)
      if (!ended[c][r])
        fail(what + ": call " + std::to_string(c) + " never ended on rank " + std::to_string(r));
}

// The captured schedule: a "graph" of several collectives is recorded once per rank and replayed several times with
// new input bytes, every replay in a new random interleaving; each must deliver every byte and leave the flags as it
// found them.
void capturedCase(std::mt19937& rng, int caseNo) {
  const StagingGeometry g = randomGeometry(rng);
  const int W = g.worldSize;
  World world;
  for (int r = 0; r < W; ++r)
    world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g));
  std::vector<Buffers> graph;
  std::vector<Form> forms;
  const int collectives = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int c = 0; c < collectives; ++c) {
    const Form form = static_cast<Form>(std::uniform_int_distribution<int>(0, 3)(rng));
    const size_t bytes =
        std::uniform_int_distribution<int>(0, 5)(rng) == 0 ? 0 : std::uniform_int_distribution<size_t>(1, 300)(rng);
    graph.push_back(makeCollective(form, W, bytes, rng));
    forms.push_back(form);
    for (int r = 0; r < W; ++r)
      scheduleCapturedAllgather(*world.ranks[r], graph.back().plans[r]);
  }
  std::vector<std::deque<Op>> recorded[2];
  for (int l = 0; l < 2; ++l)
    for (int r = 0; r < W; ++r)
      recorded[l].push_back(world.ranks[r]->lanes[l]);
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<std::vector<std::vector<char>>> originals;
    for (size_t c = 0; c < graph.size(); ++c) {
      Buffers& b = graph[c];
      std::vector<std::vector<char>> original(W);
      for (int r = 0; r < W; ++r) {
        // New input bytes in the same buffers, as a user refills a graph's static input before each replay.
        std::vector<char> fresh(b.bytesPerRank);
        for (auto& x : fresh)
          x = static_cast<char>(rng());
        size_t at = 0;
        for (const ByteSpan& s : b.plans[r].input) {
          if (s.bytes > 0)
            memcpy(s.ptr, fresh.data() + at, s.bytes);
          at += s.bytes;
        }
        original[r] = fresh;
        for (size_t i = 0; i < b.outputs[r].size(); ++i) {
          if (forms[c] != Form::InPlace)
            b.outputs[r][i] = static_cast<char>(~b.outputs[r][i]);  // re-poison
        }
      }
      originals.push_back(original);
    }
    for (int l = 0; l < 2; ++l)
      for (int r = 0; r < W; ++r)
        world.ranks[r]->lanes[l] = recorded[l][r];
    const std::string what = describe("captured", caseNo, g, "replay " + std::to_string(replay));
    world.run(rng, what);
    for (size_t c = 0; c < graph.size(); ++c)
      checkOutputs(graph[c], originals[c], what + " collective " + std::to_string(c));
    for (int r = 0; r < W; ++r)
      for (int f = 0; f < kFlagKinds; ++f)
        for (int q = 0; q < W; ++q)
          for (int s = 0; s < g.slots; ++s)
            if (world.ranks[r]->flag(static_cast<Flag>(f), q, s) != 0)
              fail(what + ": a flag was left set");
  }
}

// The captured exchange (--captured-exchanges): a "graph" of captured exchanges of every kind mixed with captured
// all-gathers, recorded once per rank on one group's captured transport and replayed several times, each replay with
// new input bytes and re-poisoned outputs, in a new random interleaving. Each collective runs on the lanes the runner
// gives it (both on the caller's stream, or the push lane forked from it and joined back where it takes several
// chunks), or with its lanes left free (more interleavings than the runner allows), or everything of a rank in one
// queue. After every replay every rank's arenas hold exactly what they must
// and every flag is back at 0. With `withoutArrived` the exchanges' Arrived signals, waits and resets are dropped: a
// peer that moves nothing with a rank then sets its next Done before that rank's reset of the last one erases it.
struct CapturedCall {
  std::unique_ptr<Exchange> exchange;  // or an all-gather:
  Buffers gather;
  Form form = Form::IntoTensor;
};

// New bytes in every rank's input region and new poison in its output arena, and the arenas they must hold after.
void refillExchange(Exchange& x, std::mt19937& rng) {
  const int W = static_cast<int>(x.plans.size());
  for (int r = 0; r < W; ++r) {
    const ExchangePlan& p = x.plans[r];
    for (auto& c : x.sent[r])
      c = static_cast<char>(rng());
    uint64_t at = 0;
    walkRegion(inputRegion(p), 0, p.inputBytes, [&](char* ptr, uint64_t n) {
      memcpy(ptr, x.sent[r].data() + at, n);
      at += n;
    });
    x.inputsAfter[r] = x.inputs[r];
    for (auto& c : x.outputs[r])
      c = static_cast<char>(rng());
    x.outputsAfter[r] = x.outputs[r];
  }
  for (int r = 0; r < W; ++r) {
    for (int q = 0; q < W; ++q) {
      const ByteRange& from = x.plans[r].recvFrom[q];
      const char* src = x.sent[q].data() + x.plans[q].sendTo[r].offset;
      walkRegion(outputRegion(x.plans[r]), from.offset, from.bytes, [&](char* ptr, uint64_t n) {
        memcpy(x.outputsAfter[r].data() + (ptr - x.outputs[r].data()), src, n);
        src += n;
      });
    }
  }
}

// New bytes in every rank's all-gather input, its output re-poisoned; returns each rank's bytes.
std::vector<std::vector<char>> refillGather(Buffers& b, Form form, std::mt19937& rng) {
  const int W = static_cast<int>(b.plans.size());
  std::vector<std::vector<char>> original(W);
  for (int r = 0; r < W; ++r) {
    original[r].resize(b.bytesPerRank);
    for (auto& x : original[r])
      x = static_cast<char>(rng());
    size_t at = 0;
    for (const ByteSpan& s : b.plans[r].input) {
      if (s.bytes > 0)
        memcpy(s.ptr, original[r].data() + at, s.bytes);
      at += s.bytes;
    }
    if (form != Form::InPlace)
      for (auto& c : b.outputs[r])
        c = static_cast<char>(~c);
  }
  return original;
}

void capturedExchangeCase(std::mt19937& rng, int caseNo, bool withoutArrived) {
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  StagingGeometry g = randomGeometry(rng);
  g.worldSize = pick(2, 5);
  const int W = g.worldSize;
  const int lanes = pick(0, 2);  // 0: laid out as the runner does; 1: lanes left free; 2: one queue
  World world;
  for (int r = 0; r < W; ++r) {
    world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g));
    if (lanes == 2)
      world.ranks.back()->queues = FakeTransport::Queues::One;
  }
  std::string what = describe("captured exchange", caseNo, g,
                              lanes == 0   ? "as the runner"
                              : lanes == 1 ? "lanes free"
                                           : "one queue") +
                     "; calls:";
  std::vector<CapturedCall> graph;
  const int count = pick(1, 5);
  for (int c = 0; c < count; ++c) {
    CapturedCall call;
    if (pick(0, 3) == 0) {
      call.form = static_cast<Form>(pick(0, 3));
      call.gather = makeCollective(call.form, W, pick(0, 5) == 0 ? 0 : static_cast<size_t>(pick(1, 300)), rng);
      what += std::string(" all_gather ") + formName(call.form) + " " + std::to_string(call.gather.bytesPerRank) + ";";
    } else {
      call.exchange =
          std::make_unique<Exchange>(makeExchange(static_cast<ExchangeKind>(pick(0, kExchangeKinds - 1)), W, rng));
      what += " " + call.exchange->description + ";";
    }
    for (int r = 0; r < W; ++r) {
      FakeTransport& t = *world.ranks[r];
      // As the runner lays the call out: the push lane on a stream of its own, forked and joined, only where the
      // call takes several chunks (a pair's, or the all-gather's); else both lanes on the caller's stream.
      const bool forked = lanes == 0 && (call.exchange ? capturedExchangeRounds(call.exchange->plans[r], g, r) > 1
                                                       : chunkCount(call.gather.plans[r], g) > 1);
      if (lanes == 0 && !forked) {
        t.bound = [&t](int, const Op& op) {  // the caller's stream, which the Drain lane runs on
          t.lanes[static_cast<int>(Lane::Drain)].push_back(op);
          ++t.recorded[static_cast<int>(Lane::Drain)];
        };
      }
      if (forked)
        t.joinLane(Lane::Push, Lane::Drain);
      if (call.exchange)
        scheduleCapturedExchange(t, call.exchange->plans[r]);
      else
        scheduleCapturedAllgather(t, call.gather.plans[r]);
      if (forked)
        t.joinLane(Lane::Drain, Lane::Push);
      t.bound = nullptr;
    }
    graph.push_back(std::move(call));
  }
  std::vector<std::deque<Op>> recorded[2];
  for (int l = 0; l < 2; ++l) {
    for (int r = 0; r < W; ++r) {
      std::deque<Op>& ops = world.ranks[r]->lanes[l];
      for (Op& op : ops) {
        const bool flagOp = op.kind == Op::Signal || op.kind == Op::Wait || op.kind == Op::Reset ||
                            op.kind == Op::SignalOne || op.kind == Op::WaitOne;
        if (withoutArrived && flagOp && op.flag == Flag::Arrived)
          op = Op{Op::Mark};  // in place, so that the joins' fences still count the same operations
      }
      recorded[l].push_back(ops);
    }
  }
  for (int replay = 0; replay < 3; ++replay) {
    std::vector<std::vector<std::vector<char>>> originals(graph.size());
    for (size_t c = 0; c < graph.size(); ++c) {
      if (graph[c].exchange)
        refillExchange(*graph[c].exchange, rng);
      else
        originals[c] = refillGather(graph[c].gather, graph[c].form, rng);
    }
    for (int r = 0; r < W; ++r) {
      for (int l = 0; l < 2; ++l) {
        world.ranks[r]->lanes[l] = recorded[l][r];
        world.ranks[r]->executed[l] = 0;  // the joins' fences count from the replay's start
      }
    }
    const std::string where = what + " replay " + std::to_string(replay);
    world.run(rng, where);
    for (size_t c = 0; c < graph.size(); ++c) {
      const std::string call = where + " collective " + std::to_string(c);
      if (!graph[c].exchange) {
        checkOutputs(graph[c].gather, originals[c], call);
        continue;
      }
      for (int r = 0; r < W; ++r) {
        const std::string wrong = exchangeMismatch(*graph[c].exchange, r);
        if (!wrong.empty())
          fail(call + ": wrong bytes: " + wrong);
      }
    }
    for (int r = 0; r < W; ++r)
      for (int f = 0; f < kFlagKinds; ++f)
        for (int q = 0; q < W; ++q)
          for (int s = 0; s < g.slots; ++s)
            if (world.ranks[r]->flag(static_cast<Flag>(f), q, s) != 0)
              fail(where + ": a flag was left set on rank " + std::to_string(r));
  }
}

// The cases of a run in which a wrong variant was caught, counted by what caught it, and the first failure in full.
class CaughtCases {
 public:
  // A case's result as a model returns it: "" where it passed, else the failure, its kind before the first ':'. A
  // failure ends the run unless the run `counts` them.
  void addResult(const std::string& failure, bool counts) {
    if (failure.empty())
      return;
    if (!counts)
      fail(failure);
    add(failure.substr(0, failure.find(':')), failure);
  }
  // Runs runCase(c) for each of `cases` cases; one that a failure ends (failureEndsCase) counts as a hang where the
  // failure is a deadlock, as `kind` where it says `marker`, else as wrong bytes.
  template <class RunCase>
  void runEach(int cases, RunCase&& runCase, const char* marker, const char* kind) {
    for (int c = 0; c < cases; ++c) {
      try {
        runCase(c);
      } catch (const std::runtime_error& e) {
        const std::string failure = e.what();
        add(failure.find("deadlock") != std::string::npos || failure.find(": hang:") != std::string::npos ? "hang"
            : failure.find(marker) != std::string::npos                                                   ? kind
                                                        : "wrong bytes",
            failure);
      }
    }
  }
  // Prints "ok CASES" (exit 0) where none was caught, else "caught N of CASES cases: <kind> <n>; ..." and `more` on
  // stdout and the first failure on stderr (exit 1).
  int report(int cases, const std::string& more = "") const {
    if (first_.empty()) {
      printf("ok %d\n", cases);
      return 0;
    }
    int total = 0;
    for (const auto& [kind, n] : byKind_)
      total += n;
    printf("caught %d of %d cases:", total, cases);
    for (const auto& [kind, n] : byKind_)
      printf(" %s %d;", kind.c_str(), n);
    printf("%s\n", more.c_str());
    fprintf(stderr, "FAIL: %s\n", first_.c_str());
    return 1;
  }

 private:
  void add(const std::string& kind, const std::string& failure) {
    if (first_.empty())
      first_ = failure;
    ++byKind_[kind];
  }

  std::map<std::string, int> byKind_;
  std::string first_;
};

// Prints "ok CASES" (exit 0) where every case passed; with `withoutArrived` every case runs and it prints "caught N of
// CASES cases: hang <n>; wrong bytes <n>; flag left set <n>;" (exit 1) where any failed.
int runCapturedExchanges(std::mt19937& rng, int cases, bool withoutArrived) {
  failureEndsCase = withoutArrived;
  CaughtCases caught;
  caught.runEach(cases, [&](int c) { capturedExchangeCase(rng, c, withoutArrived); }, "flag was left", "flag left set");
  return caught.report(cases);
}

// Captured point-to-point (--captured-p2p): graphs of captured p2p batches mixed with captured collectives, as the
// copy-engine runner captures them (csrc/runner/captured_p2p_pairs.cpp), recorded once per rank and replayed three
// times with new inputs and re-poisoned outputs, each replay in a new random interleaving. A rank's batch (a lone send
// or recv is a batch of one) becomes steps by the real step formation (pairStepOpsOf: with each peer, the k-th send
// and the k-th recv form step k, the steps in the order every rank shares, (lower member, higher member, k)); each
// step is a two-member exchange that the real captured exchange (scheduleCapturedExchange) records on the captured
// transport of its pair alone, connected at the pair's first captured op; the group's collectives go through the
// group's captured transport. Each call, and each step of a batch, runs on the rank's caller stream, its push lane
// forked onto the captured push stream and joined back where it takes several chunks, as CapturedLanes lays it out.
// Programs: rings by batch over 2-5 ranks in any order of ranks and any listing of each member's send and recv (a
// ring of two is both directions with one peer), pipelines of lone sends and recvs along a chain of ranks (forward,
// then backward), batches of random matched ops (several with one peer, both directions), and captured all-gathers
// and exchanges of every kind over every rank. Checked after every replay: every received byte where it belongs and
// the poison around it untouched, every collective's bytes, every flag of every transport back at 0, no hang. Not
// modelled: the CPU side of capture (the pairs' connects and size checks, which post before they wait).
//
// With `listingOrder` a batch's steps run in each rank's listing order (of each step's first op) instead: a ring of 3
// or more ranks, each listing its send to the next first, waits in a cycle, and must hang.
class CapturedP2pCase {
 public:
  CapturedP2pCase(std::mt19937& rng, int caseNo, bool listingOrder) : rng_(rng), listingOrder_(listingOrder) {
    g_ = randomGeometry(rng_);
    g_.worldSize = W_ = pick(2, 5);
    pairGeometry_ = randomGeometry(rng_);
    pairGeometry_.worldSize = 2;
    for (int r = 0; r < W_; ++r)
      group_.ranks.push_back(std::make_unique<FakeTransport>(&group_, r, g_));
    what_ = describe("captured p2p", caseNo, g_,
                     "pair slots=" + std::to_string(pairGeometry_.slots) +
                         " segment=" + std::to_string(pairGeometry_.chunkBytes) +
                         " chunk=" + std::to_string(pairGeometry_.pipelineChunkBytes)) +
            "; calls:";
    queues_.assign(W_, {});
    const int items = pick(1, 5);
    for (int i = 0; i < items; ++i) {
      switch (pick(0, 3)) {
        case 0:
          addRing();
          break;
        case 1:
          addPipeline();
          break;
        case 2:
          addRandomBatch();
          break;
        default:
          addCollective();
      }
    }
    for (int r = 0; r < W_; ++r)
      for (int q = 0; q < 2; ++q)
        recorded_[q].push_back(queues_[r][q].steps);
  }

  bool hasUsualRingOfThree() const {
    return usualRingOfThree_;
  }

  // Fails (fail()) at the first property that does not hold.
  void run() {
    for (int replay = 0; replay < 3; ++replay) {
      refill();
      for (int r = 0; r < W_; ++r)
        for (int q = 0; q < 2; ++q) {
          queues_[r][q].steps = recorded_[q][r];
          queues_[r][q].executed = 0;
        }
      const std::string where = what_ + " replay " + std::to_string(replay);
      interleave(where);
      check(where);
    }
  }

 private:
  // A rank's streams: the captured push stream (0) and the caller's stream (1), which the Drain lane runs on.
  static constexpr int kPushStream = 0;
  static constexpr int kCallerStream = 1;
  struct Step {
    bool fence = false;
    int after = -1;  // fence: runs once stream `after` ran `count` steps
    uint64_t count = 0;
    World* world = nullptr;  // an operation of the rank's transport in `world`, its index there
    int index = -1;
    Op op{Op::Mark};
  };
  struct Queue {
    std::deque<Step> steps;
    uint64_t recorded = 0, executed = 0;
  };
  // One send and the recv that meets it: the sent bytes, and the receiver's arena, the tensor at kGuard.
  static constexpr size_t kGuard = 8;
  struct Transfer {
    int from = 0, to = 0;
    std::vector<char> sent;
    std::vector<char> arena;
  };
  struct Op2p {
    int peer = -1;
    bool isSend = false;
    int transfer = -1;
  };
  struct PairWorld {
    World world;
  };

  int pick(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  std::vector<int> shuffledRanks() {
    std::vector<int> ranks(W_);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::shuffle(ranks.begin(), ranks.end(), rng_);
    return ranks;
  }
  int newTransfer(int from, int to) {
    Transfer t;
    t.from = from;
    t.to = to;
    const size_t bytes = pick(0, 7) == 0 ? 0 : static_cast<size_t>(pick(1, 200));
    t.sent.resize(bytes);
    t.arena.resize(bytes + 2 * kGuard);
    transfers_.push_back(std::move(t));
    what_ += " " + std::to_string(from) + ">" + std::to_string(to) + " " + std::to_string(bytes) + "B";
    return static_cast<int>(transfers_.size()) - 1;
  }
  World& pairWorld(int a, int b) {
    auto& p = pairs_[{std::min(a, b), std::max(a, b)}];
    if (!p) {  // connected at the pair's first captured op
      p = std::make_unique<PairWorld>();
      for (int i = 0; i < 2; ++i)
        p->world.ranks.push_back(std::make_unique<FakeTransport>(&p->world, i, pairGeometry_));
    }
    return p->world;
  }

  void push(int r, int q, Step s) {
    queues_[r][q].steps.push_back(s);
    ++queues_[r][q].recorded;
  }
  void fence(int r, int q, int after) {
    Step s;
    s.fence = true;
    s.after = after;
    s.count = queues_[r][after].recorded;
    push(r, q, s);
  }
  // Records `schedule` of rank r's transport `index` in `world` on the rank's streams as CapturedLanes::run lays it
  // out: the push lane forked onto the push stream and joined back where `pipelined`, else on the caller's stream.
  template <class Schedule>
  void capture(int r, World& world, int index, bool pipelined, Schedule&& schedule) {
    FakeTransport& t = *world.ranks[index];
    if (pipelined)
      fence(r, kPushStream, kCallerStream);
    t.bound = [&, r, pipelined, index](int lane, const Op& op) {
      Step s;
      s.world = &world;
      s.index = index;
      s.op = op;
      push(r, pipelined && lane == static_cast<int>(Lane::Push) ? kPushStream : kCallerStream, s);
    };
    t.boundJoin = [](int, int) { fail("a captured schedule joined its lanes"); };
    schedule(t);
    t.bound = nullptr;
    t.boundJoin = nullptr;
    if (pipelined)
      fence(r, kCallerStream, kPushStream);
  }

  // One batch per rank of `batches` (its ops in its listing order), captured as the runner captures it.
  void captureBatches(const std::map<int, std::vector<Op2p>>& batches) {
    for (const auto& [r, ops] : batches) {
      std::vector<PairStepOps> steps = pairStepOpsOf(ops, r);
      if (listingOrder_) {
        auto first = [](const PairStepOps& s) {
          return s.send < 0 ? s.recv : s.recv < 0 ? s.send : std::min(s.send, s.recv);
        };
        std::stable_sort(steps.begin(), steps.end(),
                         [&](const PairStepOps& a, const PairStepOps& b) { return first(a) < first(b); });
      }
      for (const PairStepOps& s : steps) {
        const int me = r < s.peer ? 0 : 1;
        ExchangePlan plan;
        plan.sendTo.assign(2, ByteRange{});
        plan.recvFrom.assign(2, ByteRange{});
        if (s.send >= 0) {
          Transfer& t = transfers_[ops[s.send].transfer];
          plan.sendTo[1 - me] = {0, t.sent.size()};
          plan.input = t.sent.data();
          plan.inputBytes = t.sent.size();
        }
        if (s.recv >= 0) {
          Transfer& t = transfers_[ops[s.recv].transfer];
          plan.recvFrom[1 - me] = {0, t.sent.size()};
          plan.output = t.arena.data() + kGuard;
          plan.outputBytes = t.sent.size();
        }
        const bool pipelined = capturedExchangeRounds(plan, pairGeometry_, me) > 1;
        capture(r, pairWorld(r, s.peer), me, pipelined, [&](FakeTransport& t) { scheduleCapturedExchange(t, plan); });
      }
    }
  }

  // A ring over 2..W ranks in random order, each member sending to the next and receiving from the previous, listing
  // the two usually (send first) or in random order.
  void addRing() {
    const std::vector<int> all = shuffledRanks();
    const int k = pick(2, W_);
    const std::vector<int> ring(all.begin(), all.begin() + k);
    const bool usual = pick(0, 1) == 0;
    what_ += std::string(" ring") + (usual ? "" : " in any listing") + " [";
    std::map<int, std::vector<Op2p>> batches;
    std::vector<int> sends(k);
    for (int i = 0; i < k; ++i)
      sends[i] = newTransfer(ring[i], ring[(i + 1) % k]);
    for (int i = 0; i < k; ++i) {
      std::vector<Op2p> ops{{ring[(i + 1) % k], true, sends[i]},
                            {ring[(i + k - 1) % k], false, sends[(i + k - 1) % k]}};
      if (!usual && pick(0, 1))
        std::swap(ops[0], ops[1]);
      batches[ring[i]] = ops;
    }
    what_ += " ];";
    usualRingOfThree_ |= usual && k >= 3;
    captureBatches(batches);
  }

  // Lone sends and recvs along a chain of ranks, a few microbatches forward, then backward.
  void addPipeline() {
    const std::vector<int> all = shuffledRanks();
    std::vector<int> chain(all.begin(), all.begin() + pick(2, W_));
    const int micro = pick(1, 3);
    what_ += " pipeline [";
    for (int dir = 0; dir < 2; ++dir) {
      for (int m = 0; m < micro; ++m)
        for (size_t i = 0; i + 1 < chain.size(); ++i) {
          const int t = newTransfer(chain[i], chain[i + 1]);
          captureBatches({{chain[i], {{chain[i + 1], true, t}}}});
          captureBatches({{chain[i + 1], {{chain[i], false, t}}}});
        }
      std::reverse(chain.begin(), chain.end());
    }
    what_ += " ];";
  }

  // Random transfers among 2..W ranks as one batch on each rank that takes part, each rank listing its ops in any
  // order that keeps its sends to each peer, and its recvs from each, in the order they meet.
  void addRandomBatch() {
    const std::vector<int> all = shuffledRanks();
    const std::vector<int> members(all.begin(), all.begin() + pick(2, W_));
    what_ += " batch [";
    std::map<int, std::vector<Op2p>> batches;
    const int count = pick(1, 6);
    for (int i = 0; i < count; ++i) {
      const int a = members[pick(0, static_cast<int>(members.size()) - 1)];
      int b = members[pick(0, static_cast<int>(members.size()) - 2)];
      if (b == a)
        b = members.back();
      const int t = newTransfer(a, b);
      batches[a].push_back({b, true, t});
      batches[b].push_back({a, false, t});
    }
    what_ += " ];";
    for (auto& [r, ops] : batches) {
      // A random merge of the ops' per-peer, per-direction sequences.
      std::map<std::pair<int, bool>, std::deque<Op2p>> lists;
      for (const Op2p& op : ops)
        lists[{op.peer, op.isSend}].push_back(op);
      ops.clear();
      while (!lists.empty()) {
        auto it = std::next(lists.begin(), pick(0, static_cast<int>(lists.size()) - 1));
        ops.push_back(it->second.front());
        it->second.pop_front();
        if (it->second.empty())
          lists.erase(it);
      }
    }
    captureBatches(batches);
  }

  void addCollective() {
    auto call = std::make_unique<CapturedCall>();
    if (pick(0, 2) == 0) {
      call->form = static_cast<Form>(pick(0, 3));
      call->gather = makeCollective(call->form, W_, pick(0, 5) == 0 ? 0 : static_cast<size_t>(pick(1, 300)), rng_);
      what_ +=
          std::string(" all_gather ") + formName(call->form) + " " + std::to_string(call->gather.bytesPerRank) + ";";
    } else {
      call->exchange =
          std::make_unique<Exchange>(makeExchange(static_cast<ExchangeKind>(pick(0, kExchangeKinds - 1)), W_, rng_));
      what_ += " " + call->exchange->description + ";";
    }
    for (int r = 0; r < W_; ++r) {
      const bool pipelined = call->exchange ? capturedExchangeRounds(call->exchange->plans[r], g_, r) > 1
                                            : chunkCount(call->gather.plans[r], g_) > 1;
      CapturedCall& c = *call;
      capture(r, group_, r, pipelined, [&](FakeTransport& t) {
        if (c.exchange)
          scheduleCapturedExchange(t, c.exchange->plans[r]);
        else
          scheduleCapturedAllgather(t, c.gather.plans[r]);
      });
    }
    collectives_.push_back(std::move(call));
  }

  void refill() {
    for (Transfer& t : transfers_) {
      for (auto& c : t.sent)
        c = static_cast<char>(rng_());
      for (auto& c : t.arena)
        c = static_cast<char>(rng_());
      poison_.push_back(t.arena);
    }
    gatherOriginals_.clear();
    for (auto& call : collectives_) {
      if (call->exchange) {
        refillExchange(*call->exchange, rng_);
        gatherOriginals_.emplace_back();
      } else {
        gatherOriginals_.push_back(refillGather(call->gather, call->form, rng_));
      }
    }
  }

  void interleave(const std::string& where) {
    while (true) {
      std::vector<std::pair<int, int>> runnable;
      bool anyLeft = false;
      for (int r = 0; r < W_; ++r)
        for (int q = 0; q < 2; ++q) {
          const std::deque<Step>& steps = queues_[r][q].steps;
          if (steps.empty())
            continue;
          anyLeft = true;
          const Step& s = steps.front();
          if (s.fence ? queues_[r][s.after].executed >= s.count : s.world->ready(s.index, s.op))
            runnable.push_back({r, q});
        }
      if (!anyLeft)
        return;
      if (runnable.empty())
        fail(where + ": every stream waits on a flag no stream will set (deadlock)");
      auto [r, q] = runnable[std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(rng_)];
      const Step s = queues_[r][q].steps.front();
      queues_[r][q].steps.pop_front();
      ++queues_[r][q].executed;
      if (!s.fence)
        s.world->execute(s.index, s.op);
    }
  }

  void check(const std::string& where) {
    for (size_t i = 0; i < transfers_.size(); ++i) {
      const Transfer& t = transfers_[i];
      const std::vector<char>& before = poison_[i];
      const size_t n = t.sent.size();
      if ((n > 0 && memcmp(t.arena.data() + kGuard, t.sent.data(), n) != 0) ||
          memcmp(t.arena.data(), before.data(), kGuard) != 0 ||
          memcmp(t.arena.data() + kGuard + n, before.data() + kGuard + n, kGuard) != 0)
        fail(where + ": wrong bytes in the recv of " + std::to_string(t.from) + ">" + std::to_string(t.to));
    }
    poison_.clear();
    for (size_t c = 0; c < collectives_.size(); ++c) {
      const std::string call = where + " collective " + std::to_string(c);
      if (!collectives_[c]->exchange) {
        checkOutputs(collectives_[c]->gather, gatherOriginals_[c], call);
        continue;
      }
      for (int r = 0; r < W_; ++r) {
        const std::string wrong = exchangeMismatch(*collectives_[c]->exchange, r);
        if (!wrong.empty())
          fail(call + ": wrong bytes: " + wrong);
      }
    }
    auto flagsAtZero = [&](World& world, const StagingGeometry& g, const std::string& whose) {
      for (size_t r = 0; r < world.ranks.size(); ++r)
        for (int f = 0; f < kFlagKinds; ++f)
          for (int q = 0; q < g.worldSize; ++q)
            for (int s = 0; s < g.slots; ++s)
              if (world.ranks[r]->flag(static_cast<Flag>(f), q, s) != 0)
                fail(where + ": a flag was left set on " + whose + " member " + std::to_string(r));
    };
    flagsAtZero(group_, g_, "the group's transport,");
    for (auto& [pair, p] : pairs_)
      flagsAtZero(p->world, pairGeometry_,
                  "the transport of pair " + std::to_string(pair.first) + "-" + std::to_string(pair.second) + ",");
  }

  std::mt19937& rng_;
  const bool listingOrder_;
  int W_ = 0;
  StagingGeometry g_, pairGeometry_;
  World group_;
  std::map<std::pair<int, int>, std::unique_ptr<PairWorld>> pairs_;
  std::vector<Transfer> transfers_;
  std::vector<std::vector<char>> poison_;  // each transfer's arena as refill() left it
  std::vector<std::unique_ptr<CapturedCall>> collectives_;
  std::vector<std::vector<std::vector<char>>> gatherOriginals_;
  std::vector<std::array<Queue, 2>> queues_;   // [rank][stream]
  std::vector<std::deque<Step>> recorded_[2];  // [stream][rank]: the graph as captured
  bool usualRingOfThree_ = false;
  std::string what_;
};

// Prints "ok CASES" (exit 0) where every case passed. With `listingOrder` every case runs and it prints "caught N of
// CASES cases: hang <n>; rings of 3 or more ranks hang R of T;" (exit 1): each such ring must hang.
int runCapturedP2p(std::mt19937& rng, int cases, bool listingOrder) {
  failureEndsCase = listingOrder;
  CaughtCases caught;
  int rings = 0, ringsHung = 0;
  caught.runEach(
      cases,
      [&](int c) {
        CapturedP2pCase model(rng, c, listingOrder);
        rings += model.hasUsualRingOfThree();
        try {
          model.run();
        } catch (const std::runtime_error& e) {
          ringsHung += model.hasUsualRingOfThree() && std::string(e.what()).find("deadlock") != std::string::npos;
          throw;
        }
      },
      "flag was left", "flag left set");
  if (!listingOrder)
    return caught.report(cases);
  return caught.report(
      cases, " rings of 3 or more ranks hang " + std::to_string(ringsHung) + " of " + std::to_string(rings) + ";");
}

// What one call costs on the CPU: a one-chunk all-gather on two ranks issues one push, one local copy, one Ready
// signal and wait, one Credit signal and wait; in place it issues no local copy.
void callCounts() {
  std::mt19937 rng(1);
  StagingGeometry g;
  g.worldSize = 2;
  g.slots = 2;
  g.chunkBytes = 1 << 20;
  for (Form form : {Form::IntoTensor, Form::InPlace}) {
    World world;
    for (int r = 0; r < 2; ++r)
      world.ranks.push_back(std::make_unique<FakeTransport>(&world, r, g));
    Buffers b = makeCollective(form, 2, 4096, rng);
    uint64_t count = 2;  // past the slots' first use, where the credit wait is skipped
    scheduleStagingAllgather(*world.ranks[0], b.plans[0], count);
    auto& calls = world.ranks[0]->calls;
    const int localCopies = form == Form::InPlace ? 0 : 1;
    // +1 local copy: the drain of the peer's segment into the output.
    if (calls["pushChunkToPeers"] != 1 || calls["copyLocal"] != localCopies + 1 || calls["signalPeers"] != 2 ||
        calls["waitPeers"] != 2) {
      fail(std::string("call counts of a one-chunk ") + formName(form) + " all-gather changed: push " +
           std::to_string(calls["pushChunkToPeers"]) + ", copyLocal " + std::to_string(calls["copyLocal"]) +
           ", signal " + std::to_string(calls["signalPeers"]) + ", wait " + std::to_string(calls["waitPeers"]));
    }
  }
}

// The inner all-gather of one rank's rail: its gathers go to the rank's gather queue, and run as one rendezvous of the
// whole rail (HierarchicalWorld::run), each once the lane it follows has run what was scheduled on it before.
class FakeRail : public InnerAllgather {
 public:
  FakeRail(FakeTransport* t, int size, int rank, int slots, size_t segment)
      : t_(t),
        size_(size),
        rank_(rank),
        segment_(segment),
        buffer_(slots * segment),
        issued(slots, 0),
        landed(slots, 0) {}
  int railSize() const override {
    return size_;
  }
  int railRank() const override {
    return rank_;
  }
  char* gathered(int slot) override {
    return buffer_.data() + slot * segment_;
  }
  void gather(int slot, Lane after, const std::vector<ByteSpan>& mine, size_t bytes) override {
    if (static_cast<size_t>(size_) * bytes > segment_)
      fail("a gather larger than the gathered buffer");
    Op op{Op::Gather, nullptr, nullptr, bytes, Flag::Ready, slot};
    op.pieces = mine;
    op.peer = t_->queueOf(static_cast<int>(after));
    op.fence = t_->recorded[op.peer];
    op.value = ++sequence_;
    ++issued[slot];
    t_->recordOn(kGatherQueue, op);
  }
  void awaitGathered(Lane lane, int slot) override {
    t_->recordOn(static_cast<int>(lane),
                 {Op::AwaitGather, nullptr, nullptr, 0, Flag::Ready, slot, static_cast<uint32_t>(issued[slot])});
  }

  FakeTransport* transport() {
    return t_;
  }

 private:
  FakeTransport* t_;
  int size_;
  int rank_;
  size_t segment_;
  std::vector<char> buffer_;
  uint32_t sequence_ = 0;

 public:
  std::vector<uint64_t> issued;  // per slot: gathers scheduled
  std::vector<uint64_t> landed;  // per slot: gathers run
};

// Nodes of FakeTransports (a World each, for their flags and pushes) and a FakeRail per group rank.
struct HierarchicalWorld {
  NodeLayout layout;
  std::vector<std::unique_ptr<World>> nodes;
  std::vector<std::unique_ptr<FakeRail>> rails;  // by group rank

  FakeTransport& transportOf(int q) {
    return *nodes[layout.nodeOf(q)]->ranks[layout.localIndexOf(q)];
  }

  // A gather may run once it heads the gather queue of every member of its rail, each past its fence.
  bool gatherReady(int q) {
    const Op& mine = transportOf(q).lanes[transportOf(q).queueOf(kGatherQueue)].front();
    for (int p : layout.rail(layout.localIndexOf(q))) {
      FakeTransport& t = transportOf(p);
      auto& queue = t.lanes[t.queueOf(kGatherQueue)];
      if (queue.empty() || queue.front().kind != Op::Gather || queue.front().value != mine.value)
        return false;
      if (t.executed[queue.front().peer] < queue.front().fence)
        return false;
    }
    return true;
  }

  bool ready(int q, int l) {
    FakeTransport& t = transportOf(q);
    const Op& op = t.lanes[l].front();
    if (op.kind == Op::Gather)
      return gatherReady(q);
    if (op.kind == Op::AwaitGather)
      return rails[q]->landed[op.slot] >= op.value;
    return nodes[layout.nodeOf(q)]->ready(layout.localIndexOf(q), op);
  }

  void runGather(int q, const std::string& what) {
    const std::vector<int> members = layout.rail(layout.localIndexOf(q));
    const Op first = transportOf(q).lanes[transportOf(q).queueOf(kGatherQueue)].front();
    for (size_t m = 0; m < members.size(); ++m) {
      FakeTransport& src = transportOf(members[m]);
      const Op& part = src.lanes[src.queueOf(kGatherQueue)].front();
      if (part.slot != first.slot || part.bytes != first.bytes)
        fail(what + ": the members of a rail disagree on a gather's slot or size");
      for (int p : members) {
        char* dst = rails[p]->gathered(part.slot) + m * part.bytes;
        for (const ByteSpan& piece : part.pieces) {
          memmove(dst, piece.ptr, piece.bytes);
          dst += piece.bytes;
        }
      }
    }
    for (int p : members) {
      FakeTransport& t = transportOf(p);
      const int queue = t.queueOf(kGatherQueue);
      ++rails[p]->landed[t.lanes[queue].front().slot];
      t.lanes[queue].pop_front();
      ++t.executed[queue];
    }
  }

  void run(std::mt19937& rng, const std::string& what) {
    const int W = layout.size();
    while (true) {
      std::vector<std::pair<int, int>> runnable;
      bool anyLeft = false;
      for (int q = 0; q < W; ++q) {
        for (int l = 0; l < kQueues; ++l) {
          if (transportOf(q).lanes[l].empty())
            continue;
          anyLeft = true;
          if (ready(q, l))
            runnable.push_back({q, l});
        }
      }
      if (!anyLeft)
        return;
      if (runnable.empty())
        fail(what + ": every queue waits on a flag or a gather no queue will provide (deadlock)");
      auto [q, l] = runnable[std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(rng)];
      FakeTransport& t = transportOf(q);
      if (t.lanes[l].front().kind == Op::Gather) {
        runGather(q, what);
        continue;
      }
      Op op = t.lanes[l].front();
      t.lanes[l].pop_front();
      ++t.executed[l];
      nodes[layout.nodeOf(q)]->execute(layout.localIndexOf(q), op);
    }
  }
};

// The hierarchical schedule: N nodes of L ranks, the ranks spread over the nodes in any order (contiguous, strided or
// shuffled), the lanes and gathers in queues of their own or sharing them (FakeTransport::Queues), every form, several
// collectives in a row, serials wrapping. The node layout is built by NodeLayout::group from shuffled node names, as
// the backend builds it from the exchanged identities.
void hierarchicalCase(std::mt19937& rng, int caseNo) {
  const int N = std::uniform_int_distribution<int>(1, 4)(rng);
  const int L = std::uniform_int_distribution<int>(1, 4)(rng);
  const int W = N * L;
  const auto queues = static_cast<FakeTransport::Queues>(std::uniform_int_distribution<int>(0, 2)(rng));
  std::vector<std::string> names;
  for (int m = 0; m < N; ++m)
    for (int j = 0; j < L; ++j)
      names.push_back("node" + std::to_string(m));
  std::shuffle(names.begin(), names.end(), rng);
  HierarchicalWorld world;
  world.layout = NodeLayout::group(names);
  const NodeLayout& layout = world.layout;
  if (layout.nodeCount() != N || layout.ranksPerNode() != L || layout.size() != W)
    fail("NodeLayout::group miscounted nodes");
  for (int q = 0; q < W; ++q) {
    if (layout.rankAt(layout.nodeOf(q), layout.localIndexOf(q)) != q ||
        names[layout.rankAt(layout.nodeOf(q), 0)] != names[q] ||
        layout.rail(layout.localIndexOf(q))[layout.nodeOf(q)] != q)
      fail("NodeLayout::group misplaced group rank " + std::to_string(q));
  }
  if (layout.hierarchyProblem() != (L == 1 ? "one rank per node" : ""))
    fail("NodeLayout::hierarchyProblem refused nodes of one size: " + layout.hierarchyProblem());
  StagingGeometry g;
  g.worldSize = L;
  g.slots = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
  g.chunkBytes = std::uniform_int_distribution<size_t>(N, 96)(rng);  // a segment holds a chunk of every node
  g.pipelineChunkBytes =
      std::uniform_int_distribution<int>(0, 1)(rng) ? 0 : std::uniform_int_distribution<size_t>(1, 40)(rng);
  const uint64_t start = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0xFFFFFFF0u : 0;
  for (int m = 0; m < N; ++m) {
    world.nodes.push_back(std::make_unique<World>());
    for (int j = 0; j < L; ++j) {
      world.nodes[m]->ranks.push_back(std::make_unique<FakeTransport>(world.nodes[m].get(), j, g));
      FakeTransport& t = *world.nodes[m]->ranks[j];
      t.queues = queues;
      for (int p = 0; p < L; ++p)
        for (int s = 0; s < g.slots; ++s)
          t.flag(Flag::Credit, p, s) = t.flag(Flag::Ready, p, s) = static_cast<uint32_t>(start);
    }
  }
  for (int q = 0; q < W; ++q)
    world.rails.push_back(
        std::make_unique<FakeRail>(&world.transportOf(q), N, layout.nodeOf(q), g.slots, g.chunkBytes));
  std::vector<uint64_t> serials(W, start);
  const int collectives = std::uniform_int_distribution<int>(1, 3)(rng);
  for (int c = 0; c < collectives; ++c) {
    const Form form = static_cast<Form>(std::uniform_int_distribution<int>(0, 3)(rng));
    // Up to 16 ranks: fewer bytes than the flat cases take keep its share of the run's time small.
    const size_t bytes =
        std::uniform_int_distribution<int>(0, 5)(rng) == 0 ? 0 : std::uniform_int_distribution<size_t>(1, 120)(rng);
    Buffers b = makeCollective(form, W, bytes, rng);
    std::vector<std::vector<char>> original = b.inputs;
    for (int q = 0; q < W; ++q) {
      if (form == Form::InPlace)
        original[q].assign(b.plans[q].input[0].ptr, b.plans[q].input[0].ptr + bytes);
      scheduleHierarchicalAllgather(world.transportOf(q), *world.rails[q], layout, b.plans[q], serials[q]);
    }
    std::string order;
    for (int q = 0; q < W; ++q)
      order += (q ? "," : "") + std::to_string(layout.nodeOf(q));
    const std::string what = "hierarchical case " + std::to_string(caseNo) + " (" + layout.describe() +
                             ", node of each rank " + order +
                             (queues == FakeTransport::Queues::PerLane               ? ", three lanes"
                              : queues == FakeTransport::Queues::OneStreamAndGathers ? ", push and drain on one lane"
                                                                                     : ", one queue a rank") +
                             ", slots=" + std::to_string(g.slots) + ", segment=" + std::to_string(g.chunkBytes) +
                             ", chunk=" + std::to_string(g.pipelineChunkBytes) + ", " + formName(form) + ", " +
                             std::to_string(bytes) + " B/rank)";
    for (int q = 1; q < W; ++q) {
      if (serials[q] != serials[0])
        fail(what + ": ranks disagree on the chunk serial");
    }
    world.run(rng, what);
    checkOutputs(b, original, what);
  }
}

// A hardware queue is one FIFO of the work a rank's host submitted to the streams mapped onto it: a stream's head step
// leaves it only once every step submitted before it there has. Of one rank's streams (`queues`, each a deque `steps`
// of steps stamped `submitted`), mapped by `hardwareQueueOf`: the stream holding a step submitted before stream q's
// head on q's hardware queue, or -1. The calls-in-flight and the fault models share it.
template <class Queue>
int earlierOnHardwareQueue(const std::vector<Queue>& queues, const std::vector<int>& hardwareQueueOf, int q) {
  const uint64_t at = queues[q].steps.front().submitted;
  for (size_t p = 0; p < queues.size(); ++p) {
    if (static_cast<int>(p) != q && hardwareQueueOf[p] == hardwareQueueOf[q] && !queues[p].steps.empty() &&
        queues[p].steps.front().submitted < at)
      return static_cast<int>(p);
  }
  return -1;
}

// A step on a rank's stream in the calls-in-flight and the p2p models: an operation of a schedule, a fence (an event
// wait), the caller's write of a call's input, or a call's end. Each model adds what its operations need.
struct StreamStep {
  enum Kind { Operation, Fence, Produce, End } kind = Operation;
  int queue = -1;  // Fence: runs once this rank's queue `queue` ran `count` steps
  uint64_t count = 0;
  std::vector<std::pair<int, int>> touches;  // a copy: the buffers it reads or writes, as its model names them
  uint64_t submitted = 0;                    // its place in the order the rank's host submitted work
};

// Every rank's GPU streams in the calls-in-flight and the p2p models: each stream a queue of steps (a StreamStep) in
// stream order, and the hardware queue it sits on (earlierOnHardwareQueue).
template <class Step>
class RankStreams {
 protected:
  struct Queue {
    std::deque<Step> steps;
    uint64_t recorded = 0, executed = 0;
  };

  // The next rank, with `streams` streams, each on a hardware queue of its own.
  void addRank(int streams) {
    queues_.emplace_back(streams);
    hardwareQueueOf_.emplace_back(streams);
    std::iota(hardwareQueueOf_.back().begin(), hardwareQueueOf_.back().end(), 0);
    submitted_.push_back(0);
  }

  void add(int r, int q, Step step) {
    step.submitted = submitted_[r]++;
    queues_[r][q].steps.push_back(std::move(step));
    ++queues_[r][q].recorded;
  }
  void fence(int r, int q, int after, uint64_t count) {
    Step s;
    s.kind = Step::Fence;
    s.queue = after;
    s.count = count;
    add(r, q, s);
  }
  // Stream q waits for what stream `after` holds now (an event recorded there and waited on q).
  void fenceOn(int r, int q, int after) {
    if (q != after)
      fence(r, q, after, queues_[r][after].recorded);
  }

  // Whether step s, not an operation, may leave the head of its stream on rank r: a fence once the stream it waits
  // for ran that far, the caller's write of an input and a call's end at once.
  bool nonOperationReady(int r, const Step& s) const {
    return s.kind != Step::Fence || queues_[r][s.queue].executed >= s.count;
  }
  int earlierOnHardwareQueue(int r, int q) const {
    return ::earlierOnHardwareQueue(queues_[r], hardwareQueueOf_[r], q);
  }
  Step popHead(int r, int q) {
    Step s = queues_[r][q].steps.front();
    queues_[r][q].steps.pop_front();
    ++queues_[r][q].executed;
    return s;
  }

  // Calls visit(rank, stream, touch) for each buffer that a copy still queued on some stream reads or writes.
  template <class Visit>
  void forEachQueuedTouch(Visit&& visit) const {
    for (size_t p = 0; p < queues_.size(); ++p)
      for (size_t q = 0; q < queues_[p].size(); ++q)
        for (const Step& left : queues_[p][q].steps)
          for (const std::pair<int, int>& touch : left.touches)
            visit(static_cast<int>(p), static_cast<int>(q), touch);
  }

  std::vector<std::vector<Queue>> queues_;         // [rank][queue]
  std::vector<std::vector<int>> hardwareQueueOf_;  // [rank][queue]
  std::vector<uint64_t> submitted_;                // [rank]: steps submitted so far
};

// Whether copy `op` reads or writes any of `buffers`.
bool copyTouches(const Op& op, const std::vector<const std::vector<char>*>& buffers) {
  auto overlaps = [&op](const char* p, const std::vector<char>& v) {
    return op.bytes > 0 && !v.empty() && p < v.data() + v.size() && v.data() < p + op.bytes;
  };
  for (const std::vector<char>* v : buffers)
    if (overlaps(op.dst, *v) || overlaps(op.src, *v))
      return true;
  return false;
}

// A call's input before the caller's stream produces it holds other bytes (its own, flipped): a lane that started
// before the caller's stream reached the call would send these.
void flipInput(const ExchangePlan& plan) {
  walkRegion(inputRegion(plan), 0, plan.inputBytes, [](char* ptr, uint64_t k) {
    for (uint64_t b = 0; b < k; ++b)
      ptr[b] = static_cast<char>(~ptr[b]);
  });
}
void flipInput(const std::vector<ByteSpan>& input) {
  for (const ByteSpan& span : input)
    for (size_t b = 0; b < span.bytes; ++b)
      span.ptr[b] = static_cast<char>(~span.ptr[b]);
}

// The caller's stream producing a call's input: the bytes to send (`sent`, `original`) into its input.
void produceInput(const ExchangePlan& plan, const std::vector<char>& sent) {
  const char* src = sent.data();
  walkRegion(inputRegion(plan), 0, plan.inputBytes, [&](char* ptr, uint64_t n) {
    memcpy(ptr, src, n);
    src += n;
  });
}
void produceInput(const std::vector<ByteSpan>& input, const std::vector<char>& original) {
  size_t at = 0;
  for (const ByteSpan& span : input) {
    if (span.bytes > 0)
      memcpy(span.ptr, original.data() + at, span.bytes);
    at += span.bytes;
  }
}

// A step of the calls-in-flight model (CallsInFlight below); its touches name buffers (rank, call).
struct CallInFlightStep : StreamStep {
  Op op{Op::Copy};      // Operation
  int group = -1;       // Operation: whose transport; End: the call's group
  bool direct = false;  // Operation: the direct transport, not the staging one
  int groupRank = -1;   // Operation
  int call = -1;        // Operation, Produce, End
  int member = -1;      // Produce: the group rank whose input it writes
};

// Calls in flight across streams: a model check of how a group's collectives are ordered on the GPU. 2 to 8 ranks,
// 1 to 3 groups, each over every rank or 2 or more of them, chunk and direct serials from 0 or near the wrap. Each rank
// has the queues its GPU streams are: a push stream, a drain stream and 1 to n - 1 peer lanes per group of n (the same
// for every call of the group, as the runner keeps them), and two caller streams shared by all of the rank's groups.
// Every rank enqueues the same sequence of up to four calls, none waiting for another, each on one group, direct
// (scheduleDirectAllgather, the pairs settled as the arrival mailbox may settle them), through staging
// (scheduleStagingAllgather) or an exchange of any kind (scheduleDirectExchange, as direct), synchronous (its Drain
// lane on the caller's stream, C1 or C2) or async (on the group's drain stream), mostly the same choice on every rank,
// in a quarter of the cases each rank's own; the Push lane is the group's push stream, or the Drain lane's stream where
// a staging message is one chunk, as CopyEngineRunner::run binds them, and a direct call's Push operations that name a
// peer go on that peer's lane (FakeTransport::bindPeerLanes). Each call's lanes first wait for the caller stream's
// position at enqueue (forkFromCaller), and, unless the ordering rule is switched off, its Drain lane waits for the
// group's previous call's end where sdma::CallOrder says so. Before each call the caller's stream writes the call's
// input (until then it holds other bytes), as the caller's own kernels would. The queues then run in random
// interleavings honouring only stream order, those fences and the flags. Found as failures: a hang (no queue can run
// while operations remain), an early completion (a call's end runs on rank r while some rank still has a copy of that
// call into or out of r's buffers queued, so that r's caller could reuse them under the copy), or an output not
// bit-exact.
//
// With hardware queues (--hardware-queues), each rank's streams sit on hardware queues as CUDA maps them onto
// CUDA_DEVICE_MAX_CONNECTIONS of them (drawHardwareQueues), each a FIFO of the steps in the order the rank's host
// submitted them: a stream's head step runs only once it is ready and no stream sharing its hardware queue holds a
// step submitted before it, so a flag wait or a fence at a hardware queue's head holds every stream mapped there. The
// calls are made as above, in one order on every rank. With crossed orders instead, two groups over every rank make
// their calls each from a caller stream of its own, each group's calls in call order on every rank, but the two
// groups' calls interleaved otherwise on rank 0 than on every other rank, as two threads a rank, one per group, may.
//
// Not modelled: the arrival mailbox's CPU side (its settlement of each pair is drawn here, the same on every rank,
// not run), captured collectives (they join the caller's stream before the call returns), the hierarchical
// schedule, a staging area outgrown and replaced by a larger one, the watchdog, and events as objects (an event
// wait is a fence on a queue's operation count at the moment the event was recorded, which is what it is). The
// caller's later use of an output is not run either: the early-completion check stands for it. Nor work of a hardware
// queue that runs beside the work behind it: a step leaves its queue's head here only once it ran, which holds the
// queue at least as long as the GPU does.
class CallsInFlight : RankStreams<CallInFlightStep> {
 public:
  CallsInFlight(std::mt19937& rng, int caseNo, bool ordered, bool forked, bool hardwareQueues = false,
                bool crossedOrders = false)
      : rng_(rng), ordered_(ordered), forked_(forked), crossedOrders_(crossedOrders) {
    // Mostly 2 or 3 ranks, where the calls' interleavings are explored most densely; a quarter up to 8, where the
    // peer lanes are shared by several peers.
    W_ = pick(0, 3) ? drawRanks(rng_, 2, 3) : drawRanks(rng_, 4, 8);
    const int groups = crossedOrders_ ? 2 : pick(1, 3);
    for (int gi = 0; gi < groups; ++gi) {
      auto g = std::make_unique<Group>();
      for (int r = 0; r < W_; ++r)
        g->members.push_back(r);
      if (!crossedOrders_ && W_ > 2 && pick(0, 1)) {  // a subset of 2 .. W - 1 ranks
        std::shuffle(g->members.begin(), g->members.end(), rng_);
        g->members.resize(pick(2, W_ - 1));
        std::sort(g->members.begin(), g->members.end());
      }
      const int n = static_cast<int>(g->members.size());
      const DrawnTransports d = drawTransports(rng_, n, 256, g->staging, g->direct);
      g->chunks.assign(n, d.start);
      g->directSerial.assign(n, d.flagBase);
      g->order.resize(n);
      g->previousEnd.assign(n, {-1, 0});
      g->firstStream = groupStreams_;
      g->peerLanes = pick(1, n - 1);
      groupStreams_ += 2 + g->peerLanes;
      groups_.push_back(std::move(g));
    }
    for (int r = 0; r < W_; ++r)
      addRank(queueCount());
    const int calls = pick(2, 4);
    // A quarter of the scenarios let ranks choose sync and stream apart; otherwise every rank makes the same call.
    const bool ranksDiffer = pick(0, 3) == 0;
    what_ = "calls-in-flight case " + std::to_string(caseNo) + " (" + std::to_string(W_) + " ranks, groups";
    for (auto& g : groups_) {
      what_ += " {";
      for (size_t i = 0; i < g->members.size(); ++i)
        what_ += (i ? "," : "") + std::to_string(g->members[i]);
      what_ += "}";
      if (g->peerLanes)
        what_ += " with " + std::to_string(g->peerLanes) + " peer lanes";
    }
    what_ += std::string(ordered_ ? ", ordered" : ", unordered") + (forked_ ? "" : ", unforked") + "; calls:";
    for (int c = 0; c < calls; ++c)
      enqueue(c, crossedOrders_ && c < 2 ? c : pick(0, groups - 1), ranksDiffer);
    if (crossedOrders_)
      issueInCrossedOrders();
    if (hardwareQueues)
      drawHardwareQueues();
    what_ += ")";
  }

  // Whether on some rank a hardware queue holds streams of two groups: only then can crossed orders hang.
  bool groupsShareHardwareQueue() const {
    for (int r = 0; r < W_; ++r)
      for (int p = 0; p < queueCount(); ++p)
        for (int q = 0; q < queueCount(); ++q)
          if (groupOfStream(p) != groupOfStream(q) && hardwareQueueOf_[r][p] == hardwareQueueOf_[r][q])
            return true;
    return false;
  }

  void run() {
    while (true) {
      std::vector<std::pair<int, int>> runnable;
      bool anyLeft = false;
      for (int r = 0; r < W_; ++r) {
        for (int q = 0; q < queueCount(); ++q) {
          if (queues_[r][q].steps.empty())
            continue;
          anyLeft = true;
          if (ready(r, queues_[r][q].steps.front()) && earlierOnHardwareQueue(r, q) < 0)
            runnable.push_back({r, q});
        }
      }
      if (!anyLeft)
        break;
      if (runnable.empty())
        fail(what_ + ": hang: every queue waits on a flag, a fence or its hardware queue, which nothing will move (" +
             heads() + ")");
      auto [r, q] = runnable[std::uniform_int_distribution<size_t>(0, runnable.size() - 1)(rng_)];
      execute(r, popHead(r, q));
    }
    for (size_t c = 0; c < calls_.size(); ++c) {
      const Exchange* x = calls_[c]->exchange.get();
      if (!x) {
        checkOutputs(calls_[c]->buffers, calls_[c]->original, what_ + " call " + std::to_string(c));
        continue;
      }
      for (size_t i = 0; i < x->plans.size(); ++i) {
        const std::string wrong = exchangeMismatch(*x, static_cast<int>(i));
        if (!wrong.empty())
          fail(what_ + " call " + std::to_string(c) + ": wrong bytes: " + wrong);
      }
    }
  }

 private:
  struct Group {
    std::vector<int> members;  // world ranks, by group rank
    World staging, direct;     // the group's two transports per member, each with flags of its own
    std::vector<uint64_t> chunks;
    std::vector<uint32_t> directSerial;
    std::vector<CallOrder<int>> order;
    std::vector<std::pair<int, uint64_t>> previousEnd;  // queue and count after the previous call's end
    int firstStream = 0;                                // its push stream; its drain stream and its peer lanes follow
    int peerLanes = 0;  // the same streams for every call of the group, as the runner keeps them
  };
  using Step = CallInFlightStep;
  struct Call {
    Buffers buffers;  // by group rank
    std::vector<std::vector<char>> original;
    std::vector<std::vector<char>> bounce;
    int group = 0;
    std::unique_ptr<Exchange> exchange;  // an exchange's buffers instead (by group rank)
    bool direct = false;
    std::vector<PostedBuffers> posted;  // direct all-gather: by group rank
    std::vector<std::vector<Pairing>> pairing;
    std::vector<bool> sync;   // by group rank: the Drain lane on the caller's stream
    std::vector<int> caller;  // by group rank: C1 (0) or C2 (1)
  };

  int pick(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  int groupCount() const {
    return static_cast<int>(groups_.size());
  }
  // Per group: its push stream, its drain stream and its peer lanes (Group::firstStream); then the two caller streams.
  int queueCount() const {
    return groupStreams_ + 2;
  }
  int callerQueue(int caller) const {
    return groupStreams_ + caller;
  }
  // The group whose calls a stream carries, in crossed orders (each group on a caller stream of its own).
  int groupOfStream(int q) const {
    if (q >= groupStreams_)
      return q - groupStreams_;
    int gi = 0;
    while (q >= groups_[gi]->firstStream + 2 + groups_[gi]->peerLanes)
      ++gi;
    return gi;
  }
  std::string streamName(int q) const {
    if (q >= groupStreams_)
      return "C" + std::to_string(q - groupStreams_ + 1);
    const int gi = groupOfStream(q);
    const int k = q - groups_[gi]->firstStream;
    return "g" + std::to_string(gi) + (k == 0 ? " push" : k == 1 ? " drain" : " peer lane " + std::to_string(k - 2));
  }

  // Each rank's streams on its hardware queues: all on one (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it), each
  // on its own (more queues than streams, as torch_sdma's 32 give a process with few streams), or fewer queues than
  // streams, each stream on any of them (a smaller setting, or MPS clients sharing one pool).
  void drawHardwareQueues() {
    what_ += "; hardware queues";
    for (int r = 0; r < W_; ++r) {
      const int kind = pick(0, 3);
      const int count = kind <= 1 ? 1 : kind == 2 ? queueCount() : pick(1, queueCount());
      for (int q = 0; q < queueCount() && kind != 2; ++q)
        hardwareQueueOf_[r][q] = pick(0, count - 1);
      what_ += std::string(r ? ", " : " ") + "r" + std::to_string(r) + ":";
      for (int h = 0; h < count; ++h) {
        std::string streams;
        for (int q = 0; q < queueCount(); ++q)
          if (hardwareQueueOf_[r][q] == h)
            streams += (streams.empty() ? "" : ", ") + streamName(q);
        if (!streams.empty())
          what_ += " {" + streams + "}";
      }
    }
  }

  // Crossed orders: every rank issues each group's calls in call order, as the runner requires, but interleaves the
  // two groups' calls as it drew (two threads, each making one group's calls), rank 0 otherwise than every other rank.
  void issueInCrossedOrders() {
    std::vector<int> groupOfCall;
    std::vector<std::vector<int>> callsOf(groupCount());
    for (size_t c = 0; c < calls_.size(); ++c) {
      groupOfCall.push_back(calls_[c]->group);
      callsOf[calls_[c]->group].push_back(static_cast<int>(c));
    }
    std::vector<int> first;
    what_ += "; issued";
    for (int r = 0; r < W_; ++r) {
      std::vector<int> interleaving = groupOfCall;
      do
        std::shuffle(interleaving.begin(), interleaving.end(), rng_);
      while (r > 0 && interleaving == first);
      if (r == 0)
        first = interleaving;
      std::vector<size_t> next(groupCount(), 0);
      what_ += std::string(r ? ", " : " ") + "r" + std::to_string(r) + ":";
      for (int gi : interleaving) {
        const int c = callsOf[gi][next[gi]++];
        what_ += " " + std::to_string(c);
        issue(c, r);  // both groups span every rank: group rank r is rank r
      }
    }
  }

  std::vector<std::pair<int, int>> touchesOf(const Op& op) const {
    std::vector<std::pair<int, int>> found;
    for (size_t c = 0; c < calls_.size(); ++c) {
      const Call& call = *calls_[c];
      const std::vector<int>& members = groups_[call.group]->members;
      const Exchange* x = call.exchange.get();
      for (size_t i = 0; i < members.size(); ++i)
        if (copyTouches(op, {x ? &x->inputs[i] : &call.buffers.inputs[i], x ? &x->outputs[i] : &call.buffers.outputs[i],
                             x ? &x->bounce[i] : &call.bounce[i]}))
          found.push_back({members[i], static_cast<int>(c)});
    }
    return found;
  }

  void enqueue(int c, int gi, bool ranksDiffer) {
    Group& g = *groups_[gi];
    const int n = static_cast<int>(g.members.size());
    // A quarter of the calls exchange (always direct), the others all-gather, direct or through staging.
    const bool exchange = pick(0, 3) == 0;
    const bool direct = exchange || pick(0, 1);
    const Form form = direct ? (pick(0, 1) ? Form::IntoTensor : Form::InPlace) : static_cast<Form>(pick(0, 3));
    const size_t bytes = std::uniform_int_distribution<size_t>(1, 200)(rng_);
    auto call = std::make_unique<Call>();
    call->group = gi;
    call->bounce.assign(n, {});
    if (exchange) {
      call->exchange = std::make_unique<Exchange>(
          makeExchange(static_cast<ExchangeKind>(pick(0, kExchangeKinds - 1)), n, rng_, true));
      // Its input holds other bytes until the caller's stream produces it, as below.
      for (int i = 0; i < n; ++i)
        flipInput(call->exchange->plans[i]);
    } else {
      call->buffers = makeCollective(form, n, bytes, rng_);
      call->original = call->buffers.inputs;
    }
    for (int i = 0; i < n && !exchange; ++i) {
      if (form == Form::InPlace)
        call->original[i].assign(call->buffers.plans[i].input[0].ptr, call->buffers.plans[i].input[0].ptr + bytes);
      flipInput(call->buffers.plans[i].input);  // until the caller's stream produces it (a Produce step)
    }
    // Direct: the posted buffers (own or a bounce area) and the pairs as the mailbox settled them, as directCase.
    std::vector<PostedBuffers> posted(n);
    std::vector<std::vector<Pairing>> pairing(n, std::vector<Pairing>(n, Pairing::kPeerCameLate));
    if (direct) {
      for (int i = 0; i < n && !exchange; ++i) {
        const int bounced = pick(0, 3);
        if (bounced)
          call->bounce[i].assign(n * bytes, 0x5a);
        posted[i].input = bounced & 1 ? call->bounce[i].data() + i * bytes : call->buffers.plans[i].input[0].ptr;
        posted[i].outputBase = bounced & 2 ? call->bounce[i].data() : call->buffers.plans[i].outputBase;
      }
      std::vector<int> postOrder(n);
      for (int i = 0; i < n; ++i)
        postOrder[i] = i;
      std::shuffle(postOrder.begin(), postOrder.end(), rng_);
      for (int i = 0; i < n; ++i) {
        for (int j = i + 1; j < n; ++j) {
          const bool lateOne = pick(0, 1);
          pairing[postOrder[i]][postOrder[j]] = lateOne ? Pairing::kPeerCameLate : Pairing::kEachPushesOwn;
          pairing[postOrder[j]][postOrder[i]] = lateOne ? Pairing::kThisCameLate : Pairing::kEachPushesOwn;
        }
      }
    }
    call->direct = direct;
    call->posted = std::move(posted);
    call->pairing = std::move(pairing);
    call->sync.assign(n, false);
    call->caller.assign(n, 0);
    calls_.push_back(std::move(call));
    Call& made = *calls_.back();
    bool sync = pick(0, 1);
    int caller = pick(0, 1);
    what_ += std::string(c ? "; " : " ") + "g" + std::to_string(gi) +
             (exchange ? " " + made.exchange->description
                       : (direct ? " direct " : " staging ") + std::string(formName(form)) + " " +
                             std::to_string(bytes) + "B");
    for (int i = 0; i < n; ++i) {
      const int r = g.members[i];
      if (ranksDiffer || i == 0) {
        if (ranksDiffer) {
          sync = pick(0, 1);
          caller = pick(0, 1);
        }
        if (crossedOrders_)
          caller = gi;
        if (i == 0 || ranksDiffer)
          what_ += std::string(ranksDiffer ? " r" + std::to_string(r) + ":" : " ") +
                   (sync ? "sync on C" + std::to_string(caller + 1) : "async from C" + std::to_string(caller + 1));
      }
      made.sync[i] = sync;
      made.caller[i] = caller;
    }
    // Crossed orders: each rank issues the calls later, in an order of its own (issueInCrossedOrders).
    for (int i = 0; i < n && !crossedOrders_; ++i)
      issue(c, i);
  }

  // Call c's steps on its group rank i, as the runner enqueues them when that rank makes the call.
  void issue(int c, int i) {
    Call& made = *calls_[c];
    const int gi = made.group;
    Group& g = *groups_[gi];
    const int n = static_cast<int>(g.members.size());
    const int r = g.members[i];
    const bool direct = made.direct;
    const bool exchange = made.exchange != nullptr;
    const std::vector<PostedBuffers>& posted = made.posted;
    const std::vector<std::vector<Pairing>>& pairing = made.pairing;
    const int callerQ = callerQueue(made.caller[i]);
    const int drainQ = made.sync[i] ? callerQ : g.firstStream + 1;
    FakeTransport& t = direct ? *g.direct.ranks[i] : *g.staging.ranks[i];
    const int pushQ = direct || chunkCount(made.buffers.plans[i], t.geometry()) > 1 ? g.firstStream : drainQ;
    // The caller's own work before the call: it writes the input on the caller's stream.
    Step produce;
    produce.kind = Step::Produce;
    produce.call = c;
    produce.member = i;
    add(r, callerQ, produce);
    // forkFromCaller: the lanes start where the caller's stream stands now.
    if (forked_) {
      fenceOn(r, drainQ, callerQ);
      if (pushQ != drainQ)
        fenceOn(r, pushQ, callerQ);
    }
    if (ordered_ && g.order[i].mustWaitForPrevious(drainQ))
      fence(r, drainQ, g.previousEnd[i].first, g.previousEnd[i].second);
    const int peerLane0 = g.firstStream + 2;
    auto laneQueue = [pushQ, drainQ, peerLane0](int lane) {
      return lane >= kFirstPeerLane ? peerLane0 + lane - kFirstPeerLane : lane == 0 ? pushQ : drainQ;
    };
    t.bindPeerLanes(direct ? g.peerLanes : 0);
    t.collectFlagOps = direct || collectStagingFlags;
    t.pushIsDrain = pushQ == drainQ;
    t.bound = [&, r, gi, i, c](int lane, const Op& op) {
      Step s;
      s.op = op;
      s.call = c;
      s.group = gi;
      s.direct = direct;
      s.groupRank = i;
      if (op.kind == Op::Copy)
        s.touches = touchesOf(op);
      add(r, laneQueue(lane), s);
    };
    t.boundJoin = [&, r](int into, int from) { fenceOn(r, laneQueue(into), laneQueue(from)); };
    if (exchange) {
      const Exchange& x = *made.exchange;
      scheduleDirectExchange(t, x.plans[i], ++g.directSerial[i], x.posted[i], exchangePeers(x, pairing, i));
    } else if (direct) {
      std::vector<PeerBuffers> posts(n);
      for (int q = 0; q < n; ++q) {
        if (q != i)
          posts[q] = {pairing[i][q], reinterpret_cast<uint64_t>(posted[q].input),
                      reinterpret_cast<uint64_t>(posted[q].outputBase)};
      }
      scheduleDirectAllgather(t, made.buffers.plans[i], ++g.directSerial[i], posted[i], posts);
    } else {
      scheduleStagingAllgather(t, made.buffers.plans[i], g.chunks[i]);
      t.flushCollected();
      fenceOn(r, drainQ, pushQ);  // the runner's pushDone_ event
    }
    t.flushCollected();
    t.bound = nullptr;
    t.boundJoin = nullptr;
    Step end;
    end.kind = Step::End;
    end.group = gi;
    end.call = c;
    add(r, drainQ, end);
    g.order[i].ended(drainQ);
    g.previousEnd[i] = {drainQ, queues_[r][drainQ].recorded};
  }

  bool ready(int r, const Step& s) {
    if (s.kind != Step::Operation)
      return nonOperationReady(r, s);
    Group& g = *groups_[s.group];
    return (s.direct ? g.direct : g.staging).ready(s.groupRank, s.op);
  }

  void execute(int r, const Step& s) {
    if (s.kind == Step::Operation) {
      Group& g = *groups_[s.group];
      (s.direct ? g.direct : g.staging).execute(s.groupRank, s.op);
    }
    if (s.kind == Step::Produce && calls_[s.call]->exchange) {
      const Exchange& x = *calls_[s.call]->exchange;
      produceInput(x.plans[s.member], x.sent[s.member]);
    } else if (s.kind == Step::Produce) {
      const Call& call = *calls_[s.call];
      produceInput(call.buffers.plans[s.member].input, call.original[s.member]);
    }
    if (s.kind != Step::End)
      return;
    forEachQueuedTouch([&](int p, int q, std::pair<int, int> touch) {
      if (touch.first == r && touch.second == s.call)
        fail(what_ + ": early completion: call " + std::to_string(s.call) + " ended on rank " + std::to_string(r) +
             " while rank " + std::to_string(p) + " still has a copy into or out of its buffers queued (queue " +
             std::to_string(q) + ")");
    });
  }

  std::string stepName(const Step& s) const {
    switch (s.kind) {
      case Step::Fence:
        return "a fence on " + streamName(s.queue) + " reaching step " + std::to_string(s.count);
      case Step::Produce:
        return "call " + std::to_string(s.call) + "'s input";
      case Step::End:
        return "call " + std::to_string(s.call) + "'s end";
      case Step::Operation:
        break;
    }
    static const char* const kinds[] = {"copy", "signal", "wait",   "reset",        "signal",
                                        "wait", "join",   "gather", "gather await", "mark"};
    static const char* const flags[] = {"Ready", "Credit", "Arrived", "Done"};
    std::string out = std::string("call ") + std::to_string(s.call) + "'s " + kinds[s.op.kind];
    if (s.op.kind == Op::Wait || s.op.kind == Op::WaitOne)
      out += std::string(" for ") + flags[static_cast<int>(s.op.flag)] + " " + std::to_string(s.op.value) +
             (s.op.kind == Op::WaitOne ? " from rank " + std::to_string(groups_[s.group]->members[s.op.peer]) : "");
    return out;
  }

  // Where each stream with steps left stands: its head step, and the stream ahead of it on its hardware queue.
  std::string heads() const {
    std::string out;
    for (int r = 0; r < W_; ++r) {
      for (int q = 0; q < queueCount(); ++q) {
        if (queues_[r][q].steps.empty())
          continue;
        const int ahead = earlierOnHardwareQueue(r, q);
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " " + streamName(q) + " at " +
               stepName(queues_[r][q].steps.front()) +
               (ahead < 0 ? "" : ", behind " + streamName(ahead) + " on their hardware queue");
      }
    }
    return out;
  }

  std::mt19937& rng_;
  bool ordered_;
  bool forked_;
  bool crossedOrders_;
  int W_ = 0;
  int groupStreams_ = 0;
  std::vector<std::unique_ptr<Group>> groups_;
  std::vector<std::unique_ptr<Call>> calls_;
  std::string what_;
};

// Failures: a model check of the fault protocol (csrc/collective/fault_release.hpp) on the real schedules. Two ranks,
// one group with a staging and a direct transport each, up to five calls a rank enqueues in turn on its push and
// drain lanes and, for a direct call's operations on the Push lane that name the peer, its one peer lane (async calls;
// staging or direct, every form staging takes, zero-size calls among them, exchanges of every kind in place of some
// direct all-gathers, their regions bounced or not). Enqueues, lane operations and the protocol's own steps run in one
// random interleaving, so a rank's calls may be enqueued long after the peer's (a rank may start late, and may stop for
// good after some prefix). Faults, each case some: a rank's watchdog declares the group failed at a random moment (its
// timeout, a size mismatch, a peer that exited); a call the ranks take different paths for (a zero-size call through
// staging on one rank and direct on the other, or different sizes; for an exchange, splits, roots or sizes apart), of
// which, as the call board guarantees, the rank that posts second reads the first's post and refuses (it fails; the
// buffers it posted it keeps for good), and the first may refuse too or go on, its peer then late for it; a rank stuck
// behind a late peer, which its watchdog ends when nothing else can move; and a rank's process killed at a random
// moment (nothing of it runs any more, its memory goes with it), which the survivor's watchdog notices. The fake
// watchdog releases waits by one of two rules:
//   New (the protocol): a failing rank stops enqueueing, errors its calls in flight, publishes "failed"; a healthy
//   rank refuses to enqueue once a peer published it, and its watchdog fails when it sees it; a failed rank whose
//   calls all ended writes releaseValue(last serial) into every flag word a failed peer waits on from it; a failed
//   rank whose peer's process is gone writes that value into its own flag words from that peer.
//   Old (before it): a failing rank writes the serial of its last call enqueued into every flag word of its own.
// Checked: (a) a call that ends without error holds bit-exact bytes when it ends; (b) no copy reads or writes a
// rank's buffers of a call after that call ended there, or buffers the rank never posted; (c) once every rank failed,
// every lane runs out (no hang); (d) a case without faults runs every call without error and without a timeout.
//
// Shared queue, crossed orders (--shared-queue-crossed): two such groups over the two ranks, up to three calls each,
// each rank issuing them in an order of its own that keeps each group's call order (a thread per group), rank 1's
// interleaving otherwise than rank 0's, and every stream of a rank (both groups' push and drain) on one hardware queue,
// a FIFO of the steps in the order the rank submitted them, as in CallsInFlight (earlierOnHardwareQueue): a wait at its
// head holds both groups. Faults as above, each group's own; the watchdog fails every group with a call stuck when
// nothing else can move, on each rank. Without faults the crossed orders may deadlock by themselves, so (d) is not
// checked there. Under the protocol this hangs: once both ranks failed both groups, each rank's lanes wait, directly
// or behind the other group's wait on their hardware queue, for a step of the peer's that sits behind the peer's own
// wait, so no rank's lanes of a group run out and no release (rule 3) is ever written.
//
// One hardware queue (--one-hardware-queue): every stream of a rank on one hardware queue, as with
// CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's setting), the transports' service stream included: the releases into
// failed peers (rule 3) are copies the watchdog makes on that stream, so they leave the queue only behind every step
// submitted before them. A rank whose peer's process is gone passes its own waits on it with a write from a context of
// its own (rule 4), which no queued work holds: no case may fail. With --own-release-on-queue that release too is a
// copy on the service stream (the legacy-IPC fallback's): it sits behind the very wait it would satisfy, the lanes
// never run out, and the cases where a process ends with a wait on it enqueued must be caught hanging.
enum class ReleaseRule { New, Old };

// What a FaultCase runs: the release rule, and the scenario (one group on a rank's own streams, or two groups whose
// calls the ranks issue in crossed orders, every stream of a rank on one hardware queue).
struct FaultOptions {
  ReleaseRule rule = ReleaseRule::New;
  bool sharedQueueCrossed = false;
  bool oneHardwareQueue = false;   // every stream of a rank, the service stream's releases included, on one queue
  bool ownReleaseOnQueue = false;  // a rank's own waits on a gone peer passed by a copy on the service stream
};

class FaultCase {
 public:
  FaultCase(std::mt19937& rng, int caseNo, const FaultOptions& options) : rng_(rng), o_(options) {
    const int groups = o_.sharedQueueCrossed ? 2 : 1;
    what_ =
        "faults case " + std::to_string(caseNo) + " (" + (o_.rule == ReleaseRule::New ? "new" : "old") + " rule" + "";
    for (int g = 0; g < groups; ++g)
      addGroup(groups > 1 ? "; group " + std::to_string(g) + ":" : ",");
    int calls[2] = {0, 0};
    for (int g = 0; g < groups; ++g) {
      calls[g] = groups > 1 ? pick(1, 3) : pick(1, 5);
      groups_[g]->calls = calls[g];
      total_ += calls[g];
    }
    faultFree_ = pick(0, 3) == 0;
    for (int r = 0; r < kW; ++r) {
      limit_[r] = total_;
      delay_[r] = 0;
    }
    if (pick(0, 1)) {
      const int late = pick(0, kW - 1);
      delay_[late] = pick(1, 120);
      what_ += ", rank " + std::to_string(late) + " starts after step " + std::to_string(delay_[late]);
    }
    if (!faultFree_) {
      if (pick(0, 2) == 0) {
        const int r = pick(0, kW - 1);
        limit_[r] = pick(0, total_ - 1);
        what_ += ", rank " + std::to_string(r) + " enqueues only " + std::to_string(limit_[r]) + " calls";
      }
      if (pick(0, 1)) {
        faultRank_ = pick(0, kW - 1);
        faultStep_ = pick(0, 150);
        faultGroup_ = groups > 1 ? pick(0, groups - 1) : 0;
        what_ += ", rank " + std::to_string(faultRank_) + " fails" +
                 (groups > 1 ? " group " + std::to_string(faultGroup_) : "") + " at step " + std::to_string(faultStep_);
      }
      if (pick(0, 3) == 0) {
        deathRank_ = pick(0, kW - 1);
        deathStep_ = pick(0, 150);
        what_ += ", rank " + std::to_string(deathRank_) + "'s process ends at step " + std::to_string(deathStep_);
      }
    }
    what_ += "; calls:";
    for (int g = 0; g < groups; ++g)
      for (int c = 0; c < calls[g]; ++c)
        plan(g, c, groups > 1);
    // The order each rank issues the calls in: one group's in call order; two groups' interleaved as two threads
    // a rank may, rank 1 otherwise than rank 0.
    std::vector<int> groupOfCall;
    for (int g = 0; g < groups; ++g)
      groupOfCall.insert(groupOfCall.end(), calls[g], g);
    for (int r = 0; r < kW; ++r) {
      std::vector<int> interleaving = groupOfCall;
      if (groups > 1) {
        do
          std::shuffle(interleaving.begin(), interleaving.end(), rng_);
        while (r > 0 && interleaving == rank0Order_);
        if (r == 0)
          rank0Order_ = interleaving;
        what_ += std::string(r ? "," : "; issued") + " r" + std::to_string(r) + ":";
      }
      int next[2] = {0, 0};
      for (int g : interleaving) {
        order_[r].push_back({g, next[g]++});
        if (groups > 1)
          what_ += " g" + std::to_string(g) + "." + std::to_string(next[g] - 1);
      }
    }
    what_ += ")";
    // Every stream of a rank on one hardware queue in the shared scenarios, else each on its own. The service
    // stream (serviceStream()) carries the releases where they are queued (--one-hardware-queue).
    for (int r = 0; r < kW; ++r) {
      queues_[r].resize(serviceStream() + 1);
      hardwareQueueOf_[r].resize(serviceStream() + 1);
      for (int q = 0; q <= serviceStream(); ++q)
        hardwareQueueOf_[r][q] = o_.sharedQueueCrossed || o_.oneHardwareQueue ? 0 : q;
    }
    if (o_.oneHardwareQueue)
      what_ += ", one hardware queue a rank";
  }

  // "" when every property held, else the failure.
  std::string run() {
    const int groups = static_cast<int>(groups_.size());
    for (int& step = step_;; ++step) {
      if (!failure_.empty())
        return failure_;
      if (step == faultStep_ && !group(faultGroup_).failed[faultRank_] && !gone_[faultRank_])
        fail(faultRank_, faultGroup_, "its watchdog's timeout");
      if (step == deathStep_ && !gone_[deathRank_]) {
        // Killed: nothing of it runs any more; what it posted is gone with it.
        gone_[deathRank_] = true;
        for (Queue& q : queues_[deathRank_])
          q.steps.clear();
      }
      std::vector<std::function<void()>> moves;
      for (int r = 0; r < kW; ++r) {
        if (gone_[r])
          continue;
        for (int q = 0; q <= serviceStream(); ++q)
          if (!queues_[r][q].steps.empty() && ready(r, queues_[r][q].steps.front()) &&
              earlierOnHardwareQueue(queues_[r], hardwareQueueOf_[r], q) < 0)
            moves.push_back([this, r, q] { runHead(r, q); });
        if (!failedEveryGroup(r) && next_[r] < limit_[r] && step >= delay_[r])
          moves.push_back([this, r] { enqueue(r); });
        for (int g = 0; g < groups; ++g) {
          Group& gr = group(g);
          if (!gr.failed[r] && gone_[1 - r])
            moves.push_back([this, r, g] { fail(r, g, "its watchdog saw the peer's process gone"); });
          if (o_.rule == ReleaseRule::New && mayPassOwnWaits(gr.failed[r], gone_[1 - r]) && !gr.passedOwn[r])
            moves.push_back([this, r, g] {
              group(g).passedOwn[r] = true;
              if (o_.oneHardwareQueue && o_.ownReleaseOnQueue)
                queueRelease(r, g, 1 - r, /*own=*/true);
              else
                passOwnWaits(r, g, 1 - r);
            });
          const bool peerFailed = gr.failed[1 - r];
          if (o_.rule == ReleaseRule::New && failsForPeer(gr.failed[r], peerFailed))
            moves.push_back([this, r, g] { fail(r, g, "its watchdog saw the peer's \"failed\""); });
          if (o_.rule == ReleaseRule::New && mayReleaseInto(gr.failed[r], quiesced(r, g), peerFailed, gr.released[r]))
            moves.push_back([this, r, g] {
              if (o_.oneHardwareQueue) {
                group(g).released[r] = true;
                queueRelease(r, g, 1 - r, /*own=*/false);
              } else {
                release(r, g, 1 - r);
              }
            });
        }
      }
      if (!moves.empty()) {
        moves[std::uniform_int_distribution<size_t>(0, moves.size() - 1)(rng_)]();
        continue;
      }
      // Nothing can move but time: a late rank's first call is still to come.
      bool lateToCome = false;
      for (int r = 0; r < kW; ++r)
        lateToCome |= !failedEveryGroup(r) && !gone_[r] && next_[r] < limit_[r] && step < delay_[r];
      lateToCome |= step < deathStep_ && !gone_[deathRank_];  // and a kill is still to come
      if (lateToCome)
        continue;
      // Nothing can move: a group still healthy on a rank with a call stuck (behind a late peer, or behind another
      // group's wait on their hardware queue) is failed there by its watchdog's timeout.
      std::vector<std::pair<int, int>> stuck;
      for (int r = 0; r < kW; ++r)
        for (int g = 0; g < groups; ++g)
          if (!group(g).failed[r] && !gone_[r] && !quiesced(r, g))
            stuck.push_back({r, g});
      if (!stuck.empty()) {
        if (faultFree_ && !o_.sharedQueueCrossed)
          return "fault-free run timed out: a call of a case without faults was stuck (" + what_ + ")";
        auto [r, g] = stuck[std::uniform_int_distribution<size_t>(0, stuck.size() - 1)(rng_)];
        fail(r, g, "a timeout while stuck");
        continue;
      }
      break;
    }
    if (!failure_.empty())
      return failure_;
    for (int r = 0; r < kW; ++r) {
      for (int g = 0; g < groups; ++g)
        if (!quiesced(r, g))
          return "hang: rank " + std::to_string(r) + "'s lanes never run out after every rank failed (" + heads() +
                 "; " + what_ + ")";
      if (!queues_[r][serviceStream()].steps.empty())
        return "hang: rank " + std::to_string(r) + "'s release never leaves its hardware queue (" + heads() + "; " +
               what_ + ")";
    }
    if (faultFree_ && !o_.sharedQueueCrossed) {
      for (int r = 0; r < kW; ++r)
        if (failedAnyGroup(r) || next_[r] != total_)
          return "fault-free run failed: rank " + std::to_string(r) + " (" + what_ + ")";
    }
    return "";
  }

 private:
  static constexpr int kW = 2;
  enum class Posted { No, Enqueued, Refused };
  struct Planned {
    size_t bytes = 0;
    Form form = Form::IntoTensor;
    bool direct[kW] = {false, false};
    bool diverges = false;          // the ranks post apart: the second poster refuses
    bool firstAlsoRefuses = false;  // the first poster read the second's post too
    Buffers buffers;
    std::vector<std::vector<char>> original;
    Pairing pairing[kW] = {Pairing::kPeerCameLate, Pairing::kPeerCameLate};
    bool exchange = false;  // an exchange's buffers instead of `buffers`
    Exchange x;
  };
  // One group over both ranks: its transports, serials, calls and each rank's state of the fault protocol.
  struct Group {
    World staging, direct;
    uint64_t chunks[kW] = {0, 0};
    uint32_t directSerial[kW] = {0, 0};
    int calls = 0;
    std::vector<Planned> planned;
    std::vector<Posted> posted[kW];
    std::vector<bool> ended[kW], endedWithError[kW];
    bool failed[kW] = {false, false}, released[kW] = {false, false}, passedOwn[kW] = {false, false};
    std::string why[kW];
  };
  struct Step {
    enum Kind { Operation, Fence, End, Release } kind = Operation;
    Op op{Op::Copy};
    int group = 0;
    int peer = 0;      // Release: the peer whose words it writes (own: this rank's words from that peer)
    bool own = false;  // Release: a rank's own waits on a gone peer, else the words a failed peer waits on
    bool direct = false;
    int after = 0;  // Fence: runs once queue `after` ran `count` steps
    uint64_t count = 0;
    int call = -1;  // End
    std::vector<std::pair<int, int>> touches;
    uint64_t submitted = 0;  // its place in the order the rank's host submitted work (its hardware queue's FIFO)
  };
  struct Queue {
    std::deque<Step> steps;
    uint64_t recorded = 0, executed = 0;
  };

  int pick(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  Group& group(int g) {
    return *groups_[g];
  }
  const Group& group(int g) const {
    return *groups_[g];
  }
  // Rank r's queues of group g: its push stream, its drain stream and, two ranks having one peer, its one peer lane.
  static constexpr int kStreamsPerGroup = 3;
  static int stream(int g, int lane) {
    return kStreamsPerGroup * g + std::min(lane, 2);
  }
  int serviceStream() const {
    return kStreamsPerGroup * static_cast<int>(groups_.size());
  }
  bool quiesced(int r, int g) const {
    for (int lane = 0; lane < kStreamsPerGroup; ++lane)
      if (!queues_[r][stream(g, lane)].steps.empty())
        return false;
    return true;
  }
  bool failedEveryGroup(int r) const {
    for (const auto& g : groups_)
      if (!g->failed[r])
        return false;
    return true;
  }
  bool failedAnyGroup(int r) const {
    for (const auto& g : groups_)
      if (g->failed[r])
        return true;
    return false;
  }
  void violation(const std::string& s) {
    if (failure_.empty())
      failure_ = s + " (" + what_ + ")";
  }

  void addGroup(const std::string& label) {
    groups_.push_back(std::make_unique<Group>());
    Group& gr = *groups_.back();
    const DrawnTransports d = drawTransports(rng_, kW, 128, gr.staging, gr.direct);
    for (int i = 0; i < kW; ++i) {
      gr.chunks[i] = d.start;
      gr.directSerial[i] = d.flagBase;
    }
    what_ += label + " staging slots=" + std::to_string(d.staging.slots) +
             " segment=" + std::to_string(d.staging.chunkBytes) +
             " chunk=" + std::to_string(d.staging.pipelineChunkBytes) +
             ", direct slots=" + std::to_string(d.direct.slots);
  }

  void plan(int g, int c, bool named) {
    Group& gr = group(g);
    Planned p;
    p.bytes = pick(0, 4) == 0 ? 0 : std::uniform_int_distribution<size_t>(1, 200)(rng_);
    const bool direct = pick(0, 1);
    p.exchange = direct && pick(0, 2) == 0;  // an exchange where a direct all-gather could be
    p.form = direct ? (pick(0, 1) ? Form::IntoTensor : Form::InPlace) : static_cast<Form>(pick(0, 3));
    for (int r = 0; r < kW; ++r)
      p.direct[r] = direct;
    if (!faultFree_ && pick(0, 5) == 0) {
      // Paths apart: a zero-size call through staging on one rank and direct on the other, or sizes apart (an
      // exchange: splits, roots or sizes apart, the path the same).
      p.diverges = true;
      const int other = pick(0, kW - 1);
      if (!p.exchange && (p.form == Form::IntoTensor || p.form == Form::InPlace))
        p.direct[other] = !p.direct[other];
      p.firstAlsoRefuses = pick(0, 2) == 0;
    }
    if (p.exchange) {
      p.x = makeExchange(static_cast<ExchangeKind>(pick(0, kExchangeKinds - 1)), kW, rng_);
    } else {
      p.buffers = makeCollective(p.form, kW, p.bytes, rng_);
      p.original = p.buffers.inputs;
      if (p.form == Form::InPlace)
        for (int i = 0; i < kW; ++i)
          p.original[i].assign(p.buffers.plans[i].input[0].ptr, p.buffers.plans[i].input[0].ptr + p.bytes);
    }
    what_ +=
        std::string(g || c ? "; " : " ") + (named ? "g" + std::to_string(g) + "." + std::to_string(c) + " " : "") +
        (p.exchange ? p.x.description + " "
                    : formName(p.form) + (" " + std::to_string(p.bytes)) + "B " + (p.direct[0] ? "direct" : "staging") +
                          (p.direct[0] != p.direct[1] ? "/other path" : "")) +
        (p.diverges ? " apart" : "");
    gr.planned.push_back(std::move(p));
    for (int r = 0; r < kW; ++r) {
      gr.posted[r].push_back(Posted::No);
      gr.ended[r].push_back(false);
      gr.endedWithError[r].push_back(false);
    }
  }

  // Rank i's buffers of a call: what a copy into or out of them touches.
  static std::vector<const std::vector<char>*> buffersOf(const Planned& p, int i) {
    if (p.exchange)
      return {&p.x.inputs[i], &p.x.outputs[i], &p.x.bounce[i]};
    return {&p.buffers.inputs[i], &p.buffers.outputs[i]};
  }

  // Whether a copy writes into rank i's buffers of a call (else it only reads them).
  static bool writesInto(const Op& op, const Planned& p, int i) {
    for (const std::vector<char>* v : buffersOf(p, i))
      if (op.bytes > 0 && !v->empty() && op.dst < v->data() + v->size() && v->data() < op.dst + op.bytes)
        return true;
    return false;
  }

  std::vector<std::pair<int, int>> touchesOf(int g, const Op& op) const {
    std::vector<std::pair<int, int>> found;
    auto overlaps = [](const char* p, size_t n, const std::vector<char>& v) {
      return n > 0 && !v.empty() && p < v.data() + v.size() && v.data() < p + n;
    };
    const Group& gr = group(g);
    for (int c = 0; c < gr.calls; ++c)
      for (int i = 0; i < kW; ++i)
        for (const std::vector<char>* v : buffersOf(gr.planned[c], i))
          if (overlaps(op.dst, op.bytes, *v) || overlaps(op.src, op.bytes, *v)) {
            found.push_back({i, c});
            break;
          }
    return found;
  }

  void fail(int r, int g, const std::string& why) {
    Group& gr = group(g);
    if (gr.failed[r])
      return;
    gr.failed[r] = true;  // every call in flight now carries an error; "failed" is published with it
    gr.why[r] = why;
    if (o_.rule == ReleaseRule::Old) {
      // The old rule: every flag word of its own, on each transport, to the serial of the last call enqueued.
      for (int t = 0; t < 2; ++t) {
        FakeTransport& mine = t ? *gr.direct.ranks[r] : *gr.staging.ranks[r];
        const uint32_t value = t ? gr.directSerial[r] : static_cast<uint32_t>(gr.chunks[r]);
        for (int q = 0; q < kW; ++q)
          if (q != r)
            forEachReleasedWord(mine.geometry().slots, [&](Flag f, int s) { mine.flag(f, q, s) = value; });
      }
    }
  }

  // A peer's process is gone: this failed rank writes its own flag words from that peer (rule 2's exception).
  void passOwnWaits(int r, int g, int peer) {
    Group& gr = group(g);
    for (int t = 0; t < 2; ++t) {
      FakeTransport& mine = t ? *gr.direct.ranks[r] : *gr.staging.ranks[r];
      const uint32_t value = releaseValue(t ? gr.directSerial[r] : static_cast<uint32_t>(gr.chunks[r]));
      forEachReleasedWord(mine.geometry().slots, [&](Flag f, int s) { mine.flag(f, peer, s) = value; });
    }
  }

  // The watchdog's release as the service stream's copy: it runs once it leaves the rank's hardware queue.
  void queueRelease(int r, int g, int peer, bool own) {
    Step s;
    s.kind = Step::Release;
    s.group = g;
    s.peer = peer;
    s.own = own;
    add(r, serviceStream(), s);
  }

  void release(int r, int g, int peer) {
    Group& gr = group(g);
    gr.released[r] = true;
    for (int t = 0; t < 2; ++t) {
      FakeTransport& theirs = t ? *gr.direct.ranks[peer] : *gr.staging.ranks[peer];
      const uint32_t value = releaseValue(t ? gr.directSerial[r] : static_cast<uint32_t>(gr.chunks[r]));
      forEachReleasedWord(theirs.geometry().slots, [&](Flag f, int s) { theirs.flag(f, r, s) = value; });
    }
  }

  // Rank r makes the next call of its order; a call of a group it failed is refused before anything is posted.
  void enqueue(int r) {
    const auto [g, c] = order_[r][next_[r]++];
    Group& gr = group(g);
    if (gr.failed[r])
      return;
    Planned& p = gr.planned[c];
    const int peer = 1 - r;
    if (o_.rule == ReleaseRule::New && !mayEnqueue(gr.failed[r], gr.failed[peer])) {
      fail(r, g, "the peer's \"failed\" read before enqueueing");
      return;
    }
    if (p.diverges) {
      const bool second = gr.posted[peer][c] != Posted::No;
      if (second || p.firstAlsoRefuses) {
        gr.posted[r][c] = Posted::Refused;  // its posted buffers stay with it for good
        fail(r, g, "a call posted apart from the peer's");
        return;
      }
    }
    const bool direct = p.direct[r];
    bool together = false;  // both at the mailbox at once: each pushes its own bytes, the peer's enqueue right behind
    if (direct) {
      if (gr.posted[peer][c] == Posted::Enqueued) {
        p.pairing[r] = p.pairing[peer] == Pairing::kEachPushesOwn ? Pairing::kEachPushesOwn : Pairing::kThisCameLate;
      } else {
        const bool peerIsThere =
            next_[peer] < static_cast<int>(order_[peer].size()) && order_[peer][next_[peer]] == std::make_pair(g, c);
        together = !p.diverges && p.direct[peer] && gr.posted[peer][c] == Posted::No && peerIsThere &&
                   !gr.failed[peer] && !gone_[peer] && next_[peer] < limit_[peer] && step_ >= delay_[peer] &&
                   pick(0, 2) == 0;
        p.pairing[r] = together ? Pairing::kEachPushesOwn : Pairing::kPeerCameLate;
      }
    }
    schedule(r, g, c);
    if (together) {
      ++next_[peer];
      p.pairing[peer] = Pairing::kEachPushesOwn;
      schedule(peer, g, c);
    }
  }

  // Records rank r's call c of group g on its lanes (its pairing already settled for the direct path).
  void schedule(int r, int g, int c) {
    Group& gr = group(g);
    Planned& p = gr.planned[c];
    gr.posted[r][c] = Posted::Enqueued;
    const bool direct = p.direct[r];
    FakeTransport& t = direct ? *gr.direct.ranks[r] : *gr.staging.ranks[r];
    t.bound = [this, r, g, direct](int lane, const Op& op) {
      Step s;
      s.op = op;
      s.group = g;
      s.direct = direct;
      if (op.kind == Op::Copy)
        s.touches = touchesOf(g, op);
      add(r, stream(g, lane), s);
    };
    t.boundJoin = [this, r, g](int into, int from) {
      if (into != from)
        fence(r, g, into, from);
    };
    t.bindPeerLanes(direct ? 1 : 0);
    if (p.exchange) {
      std::vector<std::vector<Pairing>> pairing(kW, std::vector<Pairing>(kW));
      pairing[r][1 - r] = p.pairing[r];
      scheduleDirectExchange(t, p.x.plans[r], ++gr.directSerial[r], p.x.posted[r], exchangePeers(p.x, pairing, r));
    } else if (direct) {
      const AllgatherPlan& plan = p.buffers.plans[r];
      std::vector<PeerBuffers> posts(kW);
      const int peer = 1 - r;
      posts[peer] = {p.pairing[r], reinterpret_cast<uint64_t>(p.buffers.plans[peer].input[0].ptr),
                     reinterpret_cast<uint64_t>(p.buffers.plans[peer].outputBase)};
      scheduleDirectAllgather(t, plan, ++gr.directSerial[r], {plan.input[0].ptr, plan.outputBase}, posts);
    } else {
      scheduleStagingAllgather(t, p.buffers.plans[r], gr.chunks[r]);
      fence(r, g);  // the runner's pushDone_ event
    }
    t.bound = nullptr;
    t.boundJoin = nullptr;
    Step end;
    end.kind = Step::End;
    end.group = g;
    end.call = c;
    add(r, stream(g, 1), end);
  }
  void add(int r, int q, Step s) {
    s.submitted = submitted_[r]++;
    queues_[r][q].steps.push_back(std::move(s));
    ++queues_[r][q].recorded;
  }
  // Group g's lane `into` waits for what its lane `from` recorded so far (by default drain for push).
  void fence(int r, int g, int into = 1, int from = 0) {
    Step s;
    s.kind = Step::Fence;
    s.group = g;
    s.after = stream(g, from);
    s.count = queues_[r][s.after].recorded;
    add(r, stream(g, into), s);
  }

  bool ready(int r, const Step& s) {
    if (s.kind == Step::Fence)
      return queues_[r][s.after].executed >= s.count;
    if (s.kind == Step::End || s.kind == Step::Release)
      return true;
    Group& gr = group(s.group);
    return (s.direct ? gr.direct : gr.staging).ready(r, s.op);
  }

  void runHead(int r, int q) {
    Step s = queues_[r][q].steps.front();
    queues_[r][q].steps.pop_front();
    ++queues_[r][q].executed;
    Group& gr = group(s.group);
    const std::string call = groups_.size() > 1 ? "call g" + std::to_string(s.group) + "." : "call ";
    if (s.kind == Step::Operation) {
      for (auto [owner, c] : s.touches) {
        if (gone_[owner])
          continue;  // its memory went with its process
        if (gr.posted[owner][c] == Posted::No)
          violation("a copy into or out of buffers never posted: rank " + std::to_string(r) + " touched rank " +
                    std::to_string(owner) + "'s buffers of " + call + std::to_string(c));
        else if (gr.ended[owner][c])
          violation("write after end: rank " + std::to_string(r) + " copied " +
                    (writesInto(s.op, gr.planned[c], owner) ? "into" : "out of") + " rank " + std::to_string(owner) +
                    "'s buffers of " + call + std::to_string(c) + " after that call ended " + "there (" +
                    (gr.endedWithError[owner][c] ? "with an error" : "without error") + ")");
      }
      (s.direct ? gr.direct : gr.staging).execute(r, s.op);
      return;
    }
    if (s.kind == Step::Release) {
      if (s.own)
        passOwnWaits(r, s.group, s.peer);
      else if (!gone_[s.peer])
        release(r, s.group, s.peer);
      return;
    }
    if (s.kind != Step::End)
      return;
    gr.ended[r][s.call] = true;  // its buffers go back to the allocator
    if (gr.failed[r]) {
      gr.endedWithError[r][s.call] = true;
      return;  // the call ends with the error
    }
    const Planned& p = gr.planned[s.call];
    if (p.exchange) {
      const std::string wrong = exchangeMismatch(p.x, r);
      if (!wrong.empty())
        violation("wrong bytes in a call that ended without error: " + call + std::to_string(s.call) + ": " + wrong);
      return;
    }
    for (int q = 0; q < kW; ++q) {
      size_t at = 0;
      for (const ByteSpan& span : p.buffers.plans[r].outputByRank[q]) {
        if (span.bytes > 0 && memcmp(span.ptr, p.original[q].data() + at, span.bytes) != 0) {
          violation("wrong bytes in a call that ended without error: " + call + std::to_string(s.call) + " on rank " +
                    std::to_string(r) + " holds wrong bytes for rank " + std::to_string(q));
          return;
        }
        at += span.bytes;
      }
    }
  }

  std::string streamName(size_t q) const {
    if (q == static_cast<size_t>(serviceStream()))
      return "service stream";
    static const char* const kLanes[] = {" push", " drain", " peer lane"};
    return "g" + std::to_string(q / kStreamsPerGroup) + kLanes[q % kStreamsPerGroup];
  }

  // Where each stream with steps left stands (for a hang's report).
  std::string heads() {
    static const char* const kFlagNames[] = {"Ready", "Credit", "Arrived", "Done"};
    std::string out;
    for (int r = 0; r < kW; ++r) {
      for (size_t q = 0; q < queues_[r].size(); ++q) {
        if (queues_[r][q].steps.empty())
          continue;
        const Step& s = queues_[r][q].steps.front();
        std::string at = s.kind == Step::Fence ? "a fence"
                         : s.kind == Step::Release
                             ? std::string(s.own ? "its release of its own waits on rank " : "its release of rank ") +
                                   std::to_string(s.peer)
                         : s.kind == Step::End ? "call " + std::to_string(s.call) + "'s end"
                         : s.op.kind == Op::Wait || s.op.kind == Op::WaitOne
                             ? std::string("a wait for ") + kFlagNames[static_cast<int>(s.op.flag)] +
                                   (ready(r, s) ? "" : " not reached")
                             : "an operation";
        const int ahead = earlierOnHardwareQueue(queues_[r], hardwareQueueOf_[r], static_cast<int>(q));
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " " + streamName(q) + " at " +
               at + (ahead < 0 ? "" : ", behind " + streamName(ahead) + " on their hardware queue");
      }
    }
    return out;
  }

  std::mt19937& rng_;
  FaultOptions o_;
  std::vector<std::unique_ptr<Group>> groups_;
  int total_ = 0;  // calls of every group
  bool faultFree_ = false;
  int limit_[kW] = {0, 0}, delay_[kW] = {0, 0}, next_[kW] = {0, 0};
  std::vector<std::pair<int, int>> order_[kW];  // (group, call) in the order the rank issues them
  std::vector<int> rank0Order_;                 // rank 0's interleaving of the two groups
  int faultRank_ = 0, faultStep_ = -1, faultGroup_ = 0;
  bool gone_[kW] = {false, false};
  int deathRank_ = 0, deathStep_ = -1;
  std::vector<Queue> queues_[kW];         // per group: stream(g, lane); then the service stream
  std::vector<int> hardwareQueueOf_[kW];  // [rank][queue]
  uint64_t submitted_[kW] = {0, 0};       // [rank]: steps submitted so far
  int step_ = 0;
  std::string failure_;
  std::string what_;
};

// Point-to-point (--p2p): a model check of send, recv and batch_isend_irecv on the DMA path, running the real code: a
// rank's call (a batch, or a lone send or recv as a batch of one) becomes steps by the real step formation
// (pairStepOpsOf, pair_steps.hpp: with each peer, the k-th send to it and the k-th recv from it form step k), each
// step a two-rank exchange on a transport of its pair alone, connected at the pair's first op, taking the pair's next
// serial; the real batch schedule (scheduleDirectP2pBatch, direct_p2p_batch.cpp) records the steps' operations on the
// pairs' fake transports: Arrived to every step's peer, then each step's copies (into a peer only after that peer's
// Arrived for that very step; push or pull as the mailbox settled the step's pair) and its Done, then the waits for
// every Done. 2 to 4 ranks run a random program valid under NCCL's rules, drawn as one sequence of
// steps that each rank's calls are a projection of: ring exchanges by batch (each member sends to the next and receives
// from the previous, listing the two as the code usually does or in any order), pipelines (lone sends and recvs along a
// chain of ranks, a few microbatches forward, then backward), batches with both directions to one peer, batches of
// random matched ops, and the group's collectives over every rank on the group's own transports (direct and staging
// all-gathers, exchanges of every kind). Each rank's calls go on its streams as CallsInFlight puts them (the group's
// push and drain streams and two caller streams; sync or async; forkFromCaller's fences and sdma::CallOrder), in a
// third of the cases on hardware queues. The ranks' CPUs enqueue in one random interleaving with the streams' steps, a
// rank possibly starting late, so each step's pair settles in the mailbox as the posting order says (each pushing its
// own bytes where the later rank posted within the earlier one's wait, else the later one moving both directions); a
// batch connects its new pairs at once, each rank's CPU waiting there until every such peer reached the same batch.
// Checked: when a call ends on a rank its buffers hold exactly their bytes, and no copy into or out of them is still
// queued anywhere (early completion); no copy touches a rank's buffers of an op before that rank's stream signalled
// its Arrived (copy before arrival), or after the call ended there; no hang.
//
// With --faults, these programs under the fault protocol as FaultCase runs it for two ranks, for any number of them:
// a rank that fails stops enqueueing; its watchdog or a peer's finds it; a quiesced failed rank releases every failed
// peer on the group's transports and on each pair's it connected (fault_release.hpp); a rank passes its own waits only
// on a peer whose process is gone; and a rank that refuses one of its p2p calls on its own arguments
// (P2pRunner::refuse): each step takes its pair's serial and posts as refused, without buffers, nothing is enqueued,
// the call raises (its buffers go back to the caller) and the rank fails a move later, so that a peer may post in
// between: a peer that posts after the refused post throws at that step, having posted its steps before it (whose
// buffers it keeps for good); one that posted before waits on the refusing rank until the release. Checked: a call that
// ends without error holds its bytes; no copy before arrival or after end; once every rank failed, every lane runs out;
// a case without faults completes.
//
// Wrong variants it must catch, each the real schedule's record reordered or its step formation replaced:
// --wait-before-arrived (each step run whole in turn in call order, as scheduleDirectExchange called op after op
// would: a ring of 3 or more ranks listed the usual way hangs, every time), --copy-before-arrived (a push into a peer
// without waiting for its Arrived) and, with --faults, --pass-own-waits (a failed rank passes its own waits on live
// peers too: its call ends, and its buffers go back, while a live peer still writes into them). And three rules the
// design needs beyond its words, each caught without it: --serials-in-call-order (each op a step of its own, numbered
// with a peer in each rank's own call order: ranks that list a batch's send and recv to each other in other orders, as
// NCCL allows, disagree on the serials), --signals-in-call-order (each op a step of its own, numbered in one order,
// run in call order: a later op's Arrived lets the peer copy with an earlier op's buffers before that op arrived, and
// the word then rolls back below a serial the peer waits for) and --connect-in-turn (a batch connecting its new pairs
// one after another in its call order, each CPU waiting for the peer at each: a ring's first batch waits in a circle).
// With --faults, --refusal-posts-buffers: a refused call posts its buffers as an ordinary post does, and a peer that
// reads it goes on: a later peer moves both directions with buffers the refusing rank's caller took back (write after
// end).
//
// Batches matched by lone calls, which NCCL's rules allow: --unmatched-batches adds batches whose peers make their ops
// with the batch's rank as lone calls (addUnmatchedBatch), one direction with each peer (both ways, the batch would
// pair a send and a recv in one step that the peer makes as two: the step formation refuses them as a mismatch). The
// real schedule serves them, its steps' Done each right after the step's copies; --done-after-every-copy (every Done
// after every step's copies) hangs about a fifth of the cases: a Done waits for copies of a later step whose peer
// signals Arrived only after its earlier call ended, which needs that Done. --interleaved-peers, the peers' lone calls
// with that rank interleaved with lone calls among themselves: the real schedule serves them, each peer's steps on
// lanes of its own after the Arrived phase; on lanes the peers share (--shared-lanes, or a pool too small) a few cases
// hang: a copy of one step waits for a peer held by a third rank that waits for a later step's Done. So do peer lanes
// on shared hardware queues (--peer-lanes-share-queues), a known limitation on GPUs.
struct P2POptions {
  enum class Mutation {
    None,
    WaitBeforeArrived,
    CopyBeforeArrived,
    PassOwnWaits,
    SerialsInCallOrder,
    SignalsInCallOrder,
    ConnectInTurn,
    RefusalPostsBuffers
  };
  bool faults = false;
  Mutation mutation = Mutation::None;
  bool sharedLanes = false;           // every peer's steps on the batch's two lanes, as one queue of steps
  bool peerLanesShareQueues = false;  // with interleaved peers, the peer lanes on hardware queues drawn as the others
  int lanePool = 3;                 // the runner's pairs of peer lanes: the k-th peer of a batch takes pair k mod this
  bool unmatchedBatches = false;    // batches that peers match by lone calls (addUnmatchedBatch)
  bool interleavedPeers = false;    // and those peers' lone calls among themselves in between
  bool doneAfterEveryCopy = false;  // each step's Done signalled after every step's copies, not after its own
};

// A send of `bytes` from member `sender` (0 or 1) of a pair to the other, as the pair's two-rank exchange: the
// sender's input region is the sent tensor, the receiver's output region the received one, each in an arena of poison
// and posted as it is or bounced (as makeExchange lays regions out). `ranks`: the pair's world ranks, for the poison.
Exchange makeSendRecv(int sender, uint64_t bytes, const int ranks[2], std::mt19937& rng) {
  Exchange x;
  x.kind = ExchangeKind::Broadcast;  // of two ranks, rooted at the sender: what a send and its recv move
  x.root = sender;
  x.plans.resize(2);
  x.inputs.resize(2);
  x.outputs.resize(2);
  x.sent.resize(2);
  x.bounce.resize(2);
  x.posted.resize(2);
  for (int r = 0; r < 2; ++r) {
    ExchangePlan& p = x.plans[r];
    p.sendTo.assign(2, {});
    p.recvFrom.assign(2, {});
    std::vector<uint64_t> inSizes, outSizes;
    if (r == sender) {
      p.sendTo[1 - r] = {0, bytes};
      p.inputBytes = bytes;
      inSizes = {bytes};
    } else {
      p.recvFrom[sender] = {0, bytes};
      p.outputBytes = bytes;
      outSizes = {bytes};
    }
    const std::vector<ByteSpan> in = layOut(x.inputs[r], inSizes, ranks[r], rng);
    const std::vector<ByteSpan> out = layOut(x.outputs[r], outSizes, ranks[r], rng);
    if (!in.empty())
      p.input = in.front().ptr;
    if (!out.empty())
      p.output = out.front().ptr;
    x.sent[r].resize(p.inputBytes);
    for (auto& c : x.sent[r])
      c = static_cast<char>(rng());
    if (p.inputBytes > 0)
      memcpy(in.front().ptr, x.sent[r].data(), p.inputBytes);
    const int bits = std::uniform_int_distribution<int>(0, 3)(rng);  // bit 0: input bounced, bit 1: output
    const bool inputBounced = p.inputBytes > 0 && (bits & 1);
    const bool outputBounced = p.outputBytes > 0 && (bits & 2);
    x.bounce[r].assign((inputBounced ? p.inputBytes : 0) + (outputBounced ? p.outputBytes : 0), 0x5a);
    x.posted[r] = {inputBounced ? x.bounce[r].data() : p.input,
                   outputBounced ? x.bounce[r].data() + (inputBounced ? p.inputBytes : 0) : p.output};
  }
  x.inputsAfter = x.inputs;
  x.outputsAfter = x.outputs;
  const int receiver = 1 - sender;
  if (bytes > 0)
    memcpy(x.outputsAfter[receiver].data() + (x.plans[receiver].output - x.outputs[receiver].data()),
           x.sent[sender].data(), bytes);
  return x;
}

// One operation of a schedule as a transport recorded it for one call: an operation on a lane, or a join of two lanes.
struct RecordedOp {
  bool join = false;
  int lane = 0;  // the lane, or the lane joined into
  int from = 0;  // a join: the lane joined
  Op op{Op::Copy};
};

// A step of the p2p model (P2PCase below); its touches name buffers (unit, member).
struct P2PStep : StreamStep {
  Op op{Op::Copy};
  World* world = nullptr;  // Operation: the transport it runs on
  int index = -1;          // Operation: the rank's index there
  int unit = -1;           // Operation
  int otherUnit = -1;      // Operation of a p2p step with both directions: its other op
  int item = -1;           // Operation, Produce, End
};

class P2PCase : RankStreams<P2PStep> {
 public:
  P2PCase(std::mt19937& rng, int caseNo, const P2POptions& options) : rng_(rng), o_(options) {
    W_ = pick(2, 4);
    what_ = "p2p case " + std::to_string(caseNo) + " (" + std::to_string(W_) + " ranks";
    const DrawnTransports d = drawTransports(rng_, W_, 256, groupStaging_, groupDirect_);
    what_ += ", group staging slots=" + std::to_string(d.staging.slots) +
             " segment=" + std::to_string(d.staging.chunkBytes) +
             " chunk=" + std::to_string(d.staging.pipelineChunkBytes);
    chunks_.assign(W_, d.start);
    directSerial_.assign(W_, d.flagBase);
    for (int a = 0; a < W_; ++a)
      for (int b = a + 1; b < W_; ++b) {
        auto p = std::make_unique<Pair>();
        p->ranks[0] = a;
        p->ranks[1] = b;
        pairs_.push_back(std::move(p));
      }
    pairSerial_.assign(W_, std::vector<uint32_t>(W_, 0));
    drawProgram();
    for (int r = 0; r < W_; ++r)
      addRank(kQueuesPerRank);
    order_.resize(W_);
    previousEnd_.assign(W_, {-1, 0});
    next_.assign(W_, 0);
    delay_.assign(W_, 0);
    limit_.resize(W_);
    for (int r = 0; r < W_; ++r)
      limit_[r] = static_cast<int>(program_[r].size());
    failed_.assign(W_, false);
    gone_.assign(W_, false);
    released_.assign(W_, std::vector<bool>(W_, false));
    passedOwn_.assign(W_, std::vector<bool>(W_, false));
    if (pick(0, 2) == 0)
      drawHardwareQueues();
    for (int r = 0; r < W_; ++r) {
      if (pick(0, 2) == 0) {
        delay_[r] = pick(1, 80);
        what_ += ", rank " + std::to_string(r) + " starts after step " + std::to_string(delay_[r]);
      }
    }
    if (o_.faults)
      drawFaults();
    what_ += "; program:" + programDescription_ + ")";
  }

  // Whether the program holds a ring exchange of 3 or more ranks, each listing its send to the next first: run whole
  // op after op (--wait-before-arrived), such a batch must hang.
  bool hasUsualRingOfThree() const {
    return usualRingOfThree_;
  }

  // "" when every property held, else the failure, its kind before the first ':'.
  std::string run() {
    for (;; ++step_) {
      if (!failure_.empty())
        return failure_;
      if (step_ == faultStep_ && !failed_[faultRank_] && !gone_[faultRank_])
        failRank(faultRank_, "its watchdog's timeout");
      if (step_ == deathStep_ && !gone_[deathRank_]) {
        gone_[deathRank_] = true;  // nothing of it runs any more; its memory goes with it
        for (Queue& q : queues_[deathRank_])
          q.steps.clear();
      }
      std::vector<std::function<void()>> moves;
      for (int r = 0; r < W_; ++r) {
        if (gone_[r])
          continue;
        for (int q = 0; q < kQueuesPerRank; ++q)
          if (!queues_[r][q].steps.empty() && ready(r, queues_[r][q].steps.front()) && earlierOnHardwareQueue(r, q) < 0)
            moves.push_back([this, r, q] { runHead(r, q); });
        if (canEnqueue(r))
          moves.push_back([this, r] { enqueue(r, true); });
        if (o_.mutation == P2POptions::Mutation::ConnectInTurn && canConnectInTurn(r))
          moves.push_back([this, r] { connect(*pairs_[nextPairToConnect(r)]); });
        if (o_.faults)
          addFaultMoves(r, moves);
      }
      if (!moves.empty()) {
        moves[std::uniform_int_distribution<size_t>(0, moves.size() - 1)(rng_)]();
        continue;
      }
      bool lateToCome = step_ < deathStep_ && !gone_[deathRank_];
      for (int r = 0; r < W_; ++r)
        lateToCome |= !failed_[r] && !gone_[r] && hasCallsLeft(r) && step_ < delay_[r];
      if (lateToCome)
        continue;
      // Nothing moves: a rank whose lanes or whose CPU (at a connect) wait for ever.
      std::vector<int> stuck;
      for (int r = 0; r < W_; ++r)
        if (!failed_[r] && !gone_[r] && (!quiesced(r) || hasCallsLeft(r)))
          stuck.push_back(r);
      if (stuck.empty())
        break;
      if (!o_.faults)
        return "hang: nothing can move (" + heads() + "; " + what_ + ")";
      if (faultFree_)
        return "fault-free run timed out: a call of a case without faults was stuck (" + heads() + "; " + what_ + ")";
      failRank(stuck[std::uniform_int_distribution<size_t>(0, stuck.size() - 1)(rng_)], "a timeout while stuck");
    }
    if (!failure_.empty())
      return failure_;
    for (int r = 0; r < W_; ++r)
      if (!quiesced(r))
        return "hang: rank " + std::to_string(r) + "'s lanes never run out after every rank failed (" + heads() + "; " +
               what_ + ")";
    if (!o_.faults || faultFree_)
      for (int r = 0; r < W_; ++r)
        if (failed_[r] || next_[r] != static_cast<int>(program_[r].size()))
          return std::string(o_.faults ? "fault-free run failed" : "unfinished") + ": rank " + std::to_string(r) +
                 " (" + what_ + ")";
    return "";
  }

 private:
  // A rank's streams: the group's push (0) and drain (1) streams, the caller streams C1 (2) and C2 (3), and the p2p
  // runner's pool of peer lanes: pair k's push (4 + 2k) and drain (5 + 2k).
  static constexpr int kMaxLanePool = 3;
  static constexpr int kQueuesPerRank = 4 + 2 * kMaxLanePool;
  static int peerPushQueue(int lanes) {
    return 4 + 2 * lanes;
  }
  enum class UnitKind { SendRecv, DirectAllgather, StagingAllgather, Exchange };
  // One exchange of bytes with its own serial: a p2p op (two ranks, on their pair's transport) or a collective.
  struct Unit {
    UnitKind kind = UnitKind::SendRecv;
    std::vector<int> members;                     // world ranks, by index on the unit's transport
    int pair = -1;                                // SendRecv: its pair
    int sender = 0;                               // SendRecv: the member that sends
    Exchange x;                                   // SendRecv, Exchange
    std::vector<std::vector<char>> freshOutputs;  // SendRecv, Exchange: the output arenas as the caller left them
    Buffers buffers;                              // the all-gathers
    std::vector<std::vector<char>> original;
    std::vector<std::vector<char>> bounce;
    std::vector<PostedBuffers> posted;
    std::vector<std::vector<Pairing>> pairing;  // [member][member], as the mailbox settled it
    std::vector<bool> postedBy, arrived, ended, endedWithError;
    std::vector<bool> refusedBy;    // the member refused it on its own arguments: posted as refused, no buffers
    std::vector<bool> keptBy;       // the member posted its buffers, then threw: kept for good, never given back
    std::vector<int64_t> serialBy;  // the serial each member gave it (-1: none yet)
    std::string description;

    int indexOf(int rank) const {
      return static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    }
    bool direct() const {
      return kind != UnitKind::StagingAllgather;
    }
  };
  // One step of the program: a call on every rank it names, with that rank's units in its call order.
  struct Item {
    bool collective = false;
    std::map<int, std::vector<int>> units;
  };
  struct Pair {
    int ranks[2] = {0, 0};
    World world;  // connected at the pair's first op
    bool connected = false;
  };
  using Step = P2PStep;

  int pick(int lo, int hi) {
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  Pair& pairOf(int a, int b) {
    const int lo = std::min(a, b), hi = std::max(a, b);
    for (auto& p : pairs_)
      if (p->ranks[0] == lo && p->ranks[1] == hi)
        return *p;
    fail("no pair " + std::to_string(a) + "," + std::to_string(b));
  }
  int pairIndex(int a, int b) {
    Pair& p = pairOf(a, b);
    for (size_t i = 0; i < pairs_.size(); ++i)
      if (pairs_[i].get() == &p)
        return static_cast<int>(i);
    return -1;
  }
  bool hasCallsLeft(int r) const {
    return next_[r] < limit_[r];
  }
  bool quiesced(int r) const {
    for (const Queue& q : queues_[r])
      if (!q.steps.empty())
        return false;
    return true;
  }
  bool anyPeerFailed(int r) const {
    for (int p = 0; p < W_; ++p)
      if (p != r && failed_[p])
        return true;
    return false;
  }
  void violation(const std::string& s) {
    if (failure_.empty())
      failure_ = s + " (" + what_ + ")";
  }

  // ---- The program.

  uint64_t p2pBytes() {
    return pick(0, 7) == 0 ? 0 : static_cast<uint64_t>(pick(1, 64));
  }
  int newItem() {
    items_.emplace_back();
    return static_cast<int>(items_.size()) - 1;
  }
  // A send from world rank `from` to `to` in item `it` (the receiver's in `itTo` where given), last in both ranks'
  // call order so far.
  void addSendRecv(int it, int from, int to, int itTo = -1) {
    auto u = std::make_unique<Unit>();
    u->kind = UnitKind::SendRecv;
    u->pair = pairIndex(from, to);
    const Pair& p = *pairs_[u->pair];
    u->members = {p.ranks[0], p.ranks[1]};
    u->sender = from == p.ranks[0] ? 0 : 1;
    const uint64_t bytes = p2pBytes();
    u->x = makeSendRecv(u->sender, bytes, p.ranks, rng_);
    u->description = std::to_string(from) + ">" + std::to_string(to) + " " + std::to_string(bytes) + "B";
    addUnit(it, std::move(u), to, itTo);
  }
  void addUnit(int it, std::unique_ptr<Unit> u, int elsewhere = -1, int itElsewhere = -1) {
    const int n = static_cast<int>(u->members.size());
    u->pairing.assign(n, std::vector<Pairing>(n, Pairing::kPeerCameLate));
    u->postedBy.assign(n, false);
    u->arrived.assign(n, false);
    u->ended.assign(n, false);
    u->endedWithError.assign(n, false);
    u->refusedBy.assign(n, false);
    u->keptBy.assign(n, false);
    u->serialBy.assign(n, -1);
    if (u->kind == UnitKind::SendRecv || u->kind == UnitKind::Exchange) {
      // The caller's stream writes the input, and last used the output's memory, when it reaches the call: until
      // then the input holds other bytes.
      u->freshOutputs = u->x.outputs;
      for (int i = 0; i < n; ++i)
        flipInput(u->x.plans[i]);
    } else {
      for (int i = 0; i < n; ++i)
        flipInput(u->buffers.plans[i].input);
    }
    const int id = static_cast<int>(units_.size());
    for (int r : u->members)
      items_[r == elsewhere && itElsewhere >= 0 ? itElsewhere : it].units[r].push_back(id);
    units_.push_back(std::move(u));
  }

  // The group's collective over every rank: a direct or staging all-gather, or an exchange of any kind.
  void addCollective() {
    const int it = newItem();
    items_[it].collective = true;
    auto u = std::make_unique<Unit>();
    for (int r = 0; r < W_; ++r)
      u->members.push_back(r);
    const int kind = pick(0, 3);
    if (kind >= 2) {
      u->kind = UnitKind::Exchange;
      u->x = makeExchange(static_cast<ExchangeKind>(pick(0, kExchangeKinds - 1)), W_, rng_);
      u->description = u->x.description;
    } else {
      u->kind = kind == 0 ? UnitKind::DirectAllgather : UnitKind::StagingAllgather;
      const bool direct = kind == 0;
      const Form form = direct ? (pick(0, 1) ? Form::IntoTensor : Form::InPlace) : static_cast<Form>(pick(0, 3));
      const size_t bytes = std::uniform_int_distribution<size_t>(1, 120)(rng_);
      u->buffers = makeCollective(form, W_, bytes, rng_);
      u->original = u->buffers.inputs;
      u->bounce.assign(W_, {});
      u->posted.resize(W_);
      for (int i = 0; i < W_; ++i) {
        if (form == Form::InPlace)
          u->original[i].assign(u->buffers.plans[i].input[0].ptr, u->buffers.plans[i].input[0].ptr + bytes);
        if (!direct)
          continue;
        const int bounced = pick(0, 3);
        if (bounced)
          u->bounce[i].assign(W_ * bytes, 0x5a);
        u->posted[i].input = bounced & 1 ? u->bounce[i].data() + i * bytes : u->buffers.plans[i].input[0].ptr;
        u->posted[i].outputBase = bounced & 2 ? u->bounce[i].data() : u->buffers.plans[i].outputBase;
      }
      u->description =
          std::string(direct ? "direct " : "staging ") + formName(form) + " " + std::to_string(bytes) + "B";
    }
    addUnit(it, std::move(u));
  }

  std::vector<int> someRanks(int lo) {
    std::vector<int> ranks(W_);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::shuffle(ranks.begin(), ranks.end(), rng_);
    ranks.resize(pick(lo, W_));
    return ranks;
  }
  // Each rank lists its ops of the item in an order of its own, but for the sends of one rank to another in the order
  // they match (the order they were drawn in), as NCCL matches each direction in order.
  void shuffleCallOrders(int it) {
    for (auto& [r, units] : items_[it].units) {
      std::shuffle(units.begin(), units.end(), rng_);
      std::map<std::pair<int, int>, std::vector<size_t>> placesOfDirection;
      for (size_t k = 0; k < units.size(); ++k)
        placesOfDirection[{units_[units[k]]->pair, units_[units[k]]->sender}].push_back(k);
      for (const auto& [direction, places] : placesOfDirection) {
        std::vector<int> ops;
        for (size_t k : places)
          ops.push_back(units[k]);
        std::sort(ops.begin(), ops.end());
        for (size_t j = 0; j < places.size(); ++j)
          units[places[j]] = ops[j];
      }
    }
  }

  // A ring exchange by batch: each member sends to the next and receives from the previous one.
  void addRing() {
    std::vector<int> ring = someRanks(2);
    if (W_ >= 3 && ring.size() < 3 && pick(0, 2) > 0)
      ring = someRanks(3);
    const int k = static_cast<int>(ring.size());
    const int it = newItem();
    // addSendRecv appends to both ranks' lists: build each rank's [send next, recv prev] afterwards.
    std::vector<int> sendOf(k);
    for (int i = 0; i < k; ++i) {
      addSendRecv(it, ring[i], ring[(i + 1) % k]);
      sendOf[i] = static_cast<int>(units_.size()) - 1;
    }
    const bool usual = pick(0, 1);
    for (int i = 0; i < k; ++i)
      items_[it].units[ring[i]] = {sendOf[i], sendOf[(i + k - 1) % k]};
    if (!usual)
      shuffleCallOrders(it);
    usualRingOfThree_ |= usual && k >= 3;
  }

  // A pipeline along a chain of ranks: lone sends and recvs, a few microbatches forward, then maybe backward.
  void addPipeline() {
    const std::vector<int> chain = someRanks(2);
    const int k = static_cast<int>(chain.size());
    const int microbatches = pick(1, 2);
    for (int mb = 0; mb < microbatches; ++mb)
      for (int i = 0; i + 1 < k; ++i)
        addSendRecv(newItem(), chain[i], chain[i + 1]);
    if (pick(0, 1))
      for (int mb = 0; mb < microbatches; ++mb)
        for (int i = k - 1; i > 0; --i)
          addSendRecv(newItem(), chain[i], chain[i - 1]);
  }

  // A batch with both directions to one peer, one or two ops each way.
  void addBothDirections() {
    const std::vector<int> two = someRanks(2);
    const int a = two[0], b = two[1];
    const int it = newItem();
    for (int n = pick(1, 2); n > 0; --n)
      addSendRecv(it, a, b);
    for (int n = pick(1, 2); n > 0; --n)
      addSendRecv(it, b, a);
    shuffleCallOrders(it);
  }

  // A batch of random matched ops: each rank that takes part lists its own in any order.
  void addRandomBatch() {
    const int it = newItem();
    for (int n = pick(1, 4); n > 0; --n) {
      const int from = pick(0, W_ - 1);
      const int to = (from + pick(1, W_ - 1)) % W_;
      addSendRecv(it, from, to);
    }
    shuffleCallOrders(it);
  }

  // A batch of one rank's ops with a few peers, each peer making its ops with that rank as lone calls, in the order
  // of the pair's serials (NCCL runs a batch's ops apart, so it takes them in any order); with interleaved peers,
  // lone calls among the peers (matched, in one order) fall between those.
  void addUnmatchedBatch() {
    const std::vector<int> ranks = someRanks(2);
    const int center = ranks[0];
    const int it = newItem();
    for (size_t k = 1; k < ranks.size(); ++k) {
      const bool centerSends = pick(0, 1);  // both ways, the batch's steps would pair ops the peer makes apart
      for (int n = pick(1, 3); n > 0; --n) {
        const int peer = ranks[k];
        const int call = newItem();
        if (centerSends)
          addSendRecv(it, center, peer, call);
        else
          addSendRecv(call, peer, center, it);
      }
    }
    shuffleCallOrders(it);
    if (o_.interleavedPeers && ranks.size() > 2) {
      for (int n = pick(1, 3); n > 0; --n) {
        const int a = ranks[pick(1, static_cast<int>(ranks.size()) - 1)];
        int b = a;
        while (b == a)
          b = ranks[pick(1, static_cast<int>(ranks.size()) - 1)];
        addSendRecv(newItem(), a, b);
      }
      std::shuffle(items_.begin() + it + 1, items_.end(), rng_);
    }
    // Each peer's calls with the center in the order the center numbers their ops (inSerialOrder).
    for (size_t k = 1; k < ranks.size(); ++k) {
      const int peer = ranks[k];
      std::vector<int> calls, ops;
      for (size_t call = it + 1; call < items_.size(); ++call) {
        auto found = items_[call].units.find(peer);
        if (found == items_[call].units.end())
          continue;
        const int op = found->second.front();
        if (std::count(units_[op]->members.begin(), units_[op]->members.end(), center)) {
          calls.push_back(static_cast<int>(call));
          ops.push_back(op);
        }
      }
      std::sort(ops.begin(), ops.end());  // each direction in the order the center lists it
      const std::vector<int> ordered = inSerialOrder(ops);
      for (size_t j = 0; j < calls.size(); ++j)
        items_[calls[j]].units[peer] = {ordered[j]};
    }
  }

  void drawProgram() {
    const size_t target = static_cast<size_t>(pick(2, 6));
    while (items_.size() < target) {
      if (o_.unmatchedBatches && pick(0, 2) == 0) {
        addUnmatchedBatch();
        continue;
      }
      switch (pick(0, 4)) {
        case 0:
          addCollective();
          break;
        case 1:
          addRing();
          break;
        case 2:
          addPipeline();
          break;
        case 3:
          addBothDirections();
          break;
        default:
          addRandomBatch();
          break;
      }
    }
    program_.resize(W_);
    sync_.resize(W_);
    caller_.resize(W_);
    for (size_t it = 0; it < items_.size(); ++it) {
      programDescription_ += std::string(it ? ";" : "") + " [";
      bool firstRank = true;
      for (const auto& [r, units] : items_[it].units) {
        program_[r].push_back(static_cast<int>(it));
        sync_[r].push_back(pick(0, 1));
        caller_[r].push_back(pick(0, 1));
        programDescription_ += std::string(firstRank ? "" : ", ") + "r" + std::to_string(r) +
                               (sync_[r].back() ? " sync on C" : " async from C") +
                               std::to_string(caller_[r].back() + 1) + ":";
        firstRank = false;
        if (items_[it].collective) {
          programDescription_ += " " + units_[units[0]]->description;
          continue;
        }
        for (int u : units)
          programDescription_ += " " + units_[u]->description;
      }
      programDescription_ += "]";
    }
  }

  // Each rank's streams on hardware queues, as CallsInFlight draws them: all on one, or a random few. With interleaved
  // peers, the peer lanes each on a hardware queue of its own, as the runner's pool, created at once, sits on
  // CUDA_DEVICE_MAX_CONNECTIONS queues taken in turn (sharing one, two peers' lanes are one queue of steps again).
  void drawHardwareQueues() {
    what_ += ", hardware queues";
    for (int r = 0; r < W_; ++r) {
      const int count = pick(0, 1) ? 1 : pick(1, kQueuesPerRank);
      for (int q = 0; q < kQueuesPerRank; ++q)
        hardwareQueueOf_[r][q] =
            o_.interleavedPeers && !o_.peerLanesShareQueues && q >= peerPushQueue(0) ? count + q : pick(0, count - 1);
      what_ += " r" + std::to_string(r) + ":";
      for (int q = 0; q < kQueuesPerRank; ++q)
        what_ += std::to_string(hardwareQueueOf_[r][q]);
    }
  }

  void drawFaults() {
    faultFree_ = pick(0, 3) == 0;
    if (faultFree_)
      return;
    if (pick(0, 2) == 0) {
      const int r = pick(0, W_ - 1);
      limit_[r] = pick(0, std::max(0, static_cast<int>(program_[r].size()) - 1));
      what_ += ", rank " + std::to_string(r) + " makes only " + std::to_string(limit_[r]) + " calls";
    }
    if (pick(0, 1)) {
      faultRank_ = pick(0, W_ - 1);
      faultStep_ = pick(0, 200);
      what_ += ", rank " + std::to_string(faultRank_) + " fails at step " + std::to_string(faultStep_);
    }
    if (pick(0, 2) == 0) {
      // A p2p call of a rank, refused there on its own arguments (P2pRunner::refuse).
      const int r = pick(0, W_ - 1);
      std::vector<int> p2pCalls;
      for (size_t k = 0; k < program_[r].size(); ++k)
        if (!items_[program_[r][k]].collective)
          p2pCalls.push_back(static_cast<int>(k));
      if (!p2pCalls.empty()) {
        refusingRank_ = r;
        refusedCall_ = p2pCalls[pick(0, static_cast<int>(p2pCalls.size()) - 1)];
        what_ += ", rank " + std::to_string(r) + " refuses its call " + std::to_string(refusedCall_);
      }
    }
    if (pick(0, 3) == 0) {
      deathRank_ = pick(0, W_ - 1);
      deathStep_ = pick(0, 200);
      what_ += ", rank " + std::to_string(deathRank_) + "'s process ends at step " + std::to_string(deathStep_);
    }
  }

  // ---- Enqueueing, as the runner is to: the connect, the mailbox, the streams, the batch.

  // Whether rank p's CPU is at a call with an op of `pair` (with `unit` where given): its next call, started, and it
  // still makes calls.
  bool cpuAt(int p, int pair, int unit = -1) const {
    if (gone_[p] || failed_[p] || !hasCallsLeft(p) || step_ < delay_[p])
      return false;
    for (int id : items_[program_[p][next_[p]]].units.at(p))
      if (unit >= 0 ? id == unit : units_[id]->pair == pair)
        return true;
    return false;
  }
  bool canEnqueue(int r) const {
    if (gone_[r] || failed_[r] || !hasCallsLeft(r) || step_ < delay_[r] || (r == refusingRank_ && refusalPosted_))
      return false;
    const int it = program_[r][next_[r]];
    if (o_.mutation == P2POptions::Mutation::ConnectInTurn)
      return nextPairToConnect(r) < 0;
    for (int id : items_[it].units.at(r)) {
      const Unit& u = *units_[id];
      if (u.kind != UnitKind::SendRecv || pairs_[u.pair]->connected)
        continue;
      if (!cpuAt(u.members[1 - u.indexOf(r)], u.pair))
        return false;  // the connect waits for the peer
    }
    return true;
  }

  // Connecting in turn: the first pair of rank r's next call, in its call order, not connected yet (-1: none).
  int nextPairToConnect(int r) const {
    for (int id : items_[program_[r][next_[r]]].units.at(r))
      if (units_[id]->kind == UnitKind::SendRecv && !pairs_[units_[id]->pair]->connected)
        return units_[id]->pair;
    return -1;
  }
  // Whether rank r and the peer of the pair it connects next both wait at that pair's connect.
  bool canConnectInTurn(int r) const {
    if (gone_[r] || failed_[r] || !hasCallsLeft(r) || step_ < delay_[r])
      return false;
    const int pair = nextPairToConnect(r);
    if (pair < 0)
      return false;
    const Pair& p = *pairs_[pair];
    const int peer = p.ranks[0] == r ? p.ranks[1] : p.ranks[0];
    return cpuAt(peer, pair) && nextPairToConnect(peer) == pair;
  }

  void connect(Pair& p) {
    StagingGeometry g;
    g.worldSize = 2;
    g.slots = pick(0, 1) ? 2 : 4;
    g.chunkBytes = 64;
    g.packs = false;
    const uint32_t bases[] = {0, 0xfffffffdu, static_cast<uint32_t>(rng_())};
    const uint32_t flagBase = bases[pick(0, 2)];
    for (int i = 0; i < 2; ++i) {
      p.world.ranks.push_back(std::make_unique<FakeTransport>(&p.world, i, g, flagBase));
      pairSerial_[p.ranks[i]][p.ranks[1 - i]] = flagBase;
    }
    p.connected = true;
  }

  // A batch's ops on rank r, each a step of its own, in an order both ranks compute alike: its call order, except that
  // each pair's ops go the lower rank's sends first, then the higher rank's, each direction in call order (NCCL
  // matches each direction in order, and lets the two ranks list a batch's sends and recvs to each other in any
  // order). What --signals-in-call-order numbers by, and the order of a peer's lone calls with an unmatched batch.
  std::vector<int> inSerialOrder(const std::vector<int>& callOrder) const {
    std::vector<int> out = callOrder;
    std::map<int, std::vector<size_t>> placesOfPair;
    for (size_t k = 0; k < out.size(); ++k)
      if (units_[out[k]]->kind == UnitKind::SendRecv)
        placesOfPair[units_[out[k]]->pair].push_back(k);
    for (const auto& [pair, places] : placesOfPair) {
      std::vector<int> ops;
      for (size_t k : places)
        ops.push_back(out[k]);
      std::stable_sort(ops.begin(), ops.end(), [this](int a, int b) { return units_[a]->sender < units_[b]->sender; });
      for (size_t j = 0; j < places.size(); ++j)
        out[places[j]] = ops[j];
    }
    return out;
  }

  // Rank r posts unit `id` in the mailbox: against each member that posted before, it came late or that member waited
  // for it; against one not there yet, that member posts within this rank's wait (`together`, whose next call holds
  // it) or comes late.
  void post(int r, int id, const std::vector<int>& together) {
    Unit& u = *units_[id];
    const int i = u.indexOf(r);
    u.postedBy[i] = true;
    if (!u.direct())
      return;
    for (size_t j = 0; j < u.members.size(); ++j) {
      if (static_cast<int>(j) == i)
        continue;
      if (u.postedBy[j])
        u.pairing[i][j] = u.pairing[j][i] == Pairing::kEachPushesOwn ? Pairing::kEachPushesOwn : Pairing::kThisCameLate;
      else
        u.pairing[i][j] = std::count(together.begin(), together.end(), u.members[j]) && cpuAt(u.members[j], u.pair, id)
                              ? Pairing::kEachPushesOwn
                              : Pairing::kPeerCameLate;
    }
  }

  std::vector<std::pair<int, int>> touchesOf(const Op& op) const {
    std::vector<std::pair<int, int>> found;
    for (size_t id = 0; id < units_.size(); ++id) {
      const Unit& u = *units_[id];
      for (size_t i = 0; i < u.members.size(); ++i)
        if (copyTouches(op, buffersOf(u, static_cast<int>(i))))
          found.push_back({static_cast<int>(id), static_cast<int>(i)});
    }
    return found;
  }
  static std::vector<const std::vector<char>*> buffersOf(const Unit& u, int i) {
    if (u.kind == UnitKind::SendRecv || u.kind == UnitKind::Exchange)
      return {&u.x.inputs[i], &u.x.outputs[i], &u.x.bounce[i]};
    return {&u.buffers.inputs[i], &u.buffers.outputs[i], &u.bounce[i]};
  }

  World& worldOf(const Unit& u) {
    if (u.kind == UnitKind::SendRecv)
      return pairs_[u.pair]->world;
    return u.kind == UnitKind::StagingAllgather ? groupStaging_ : groupDirect_;
  }

  // Runs unit u's schedule on rank r's transport, recording its operations.
  std::vector<RecordedOp> record(int r, int id) {
    Unit& u = *units_[id];
    const int i = u.indexOf(r);
    FakeTransport& t = *worldOf(u).ranks[i];
    std::vector<RecordedOp> ops;
    t.bound = [&ops](int lane, const Op& op) {
      RecordedOp o;
      o.lane = lane;
      o.op = op;
      ops.push_back(o);
    };
    t.boundJoin = [&ops](int into, int from) {
      RecordedOp o;
      o.join = true;
      o.lane = into;
      o.from = from;
      ops.push_back(o);
    };
    switch (u.kind) {
      case UnitKind::SendRecv:
        fail("a p2p op is recorded with its batch (p2pBatch)");
      case UnitKind::Exchange:
        scheduleDirectExchange(t, u.x.plans[i], ++directSerial_[r], u.x.posted[i], exchangePeers(u.x, u.pairing, i));
        break;
      case UnitKind::DirectAllgather: {
        std::vector<PeerBuffers> posts(W_);
        for (int q = 0; q < W_; ++q)
          if (q != i)
            posts[q] = {u.pairing[i][q], reinterpret_cast<uint64_t>(u.posted[q].input),
                        reinterpret_cast<uint64_t>(u.posted[q].outputBase)};
        scheduleDirectAllgather(t, u.buffers.plans[i], ++directSerial_[r], u.posted[i], posts);
        break;
      }
      case UnitKind::StagingAllgather:
        scheduleStagingAllgather(t, u.buffers.plans[i], chunks_[r]);
        break;
    }
    t.bound = nullptr;
    t.boundJoin = nullptr;
    return ops;
  }

  void emit(int r, int id, int it, const RecordedOp& o, const int laneQueue[2], int otherId = -1) {
    if (o.join) {
      fenceOn(r, laneQueue[o.lane], laneQueue[o.from]);
      return;
    }
    Unit& u = *units_[id];
    Step s;
    s.op = o.op;
    s.world = &worldOf(u);
    s.index = u.indexOf(r);
    s.unit = id;
    s.otherUnit = otherId;
    s.item = it;
    if (o.op.kind == Op::Copy)
      s.touches = touchesOf(o.op);
    add(r, laneQueue[o.lane], s);
  }

  // One step of a batch on a rank: its ops, each a unit, at most one each way.
  struct BatchStep {
    int units[2] = {-1, -1};  // the op this rank sends, the op it receives; -1 where it has none
    int first() const {
      return units[0] >= 0 ? units[0] : units[1];
    }
  };

  // Rank r's batch of ops (`callOrder`) as steps, in the order the batch runs them, with the real step formation
  // (pair_steps.hpp). The variants number each op as a step of its own: in call order (--serials-in-call-order), or
  // in the order inSerialOrder computes alike on both ranks and then run in call order (--signals-in-call-order).
  std::vector<BatchStep> stepsOf(int r, const std::vector<int>& callOrder) const {
    std::vector<BatchStep> steps;
    const bool opAlone = o_.mutation == P2POptions::Mutation::SerialsInCallOrder ||
                         o_.mutation == P2POptions::Mutation::SignalsInCallOrder;
    if (opAlone) {
      const std::vector<int> order =
          o_.mutation == P2POptions::Mutation::SerialsInCallOrder ? callOrder : inSerialOrder(callOrder);
      for (int id : order) {
        BatchStep s;
        s.units[sendsIn(r, id) ? 0 : 1] = id;
        steps.push_back(s);
      }
      return steps;
    }
    struct Direction {
      int peer;
      bool isSend;
    };
    std::vector<Direction> ops;
    for (int id : callOrder)
      ops.push_back({peerIn(r, id), sendsIn(r, id)});
    for (const PairStepOps& p : pairStepOpsOf(ops, r)) {
      BatchStep s;
      s.units[0] = p.send >= 0 ? callOrder[p.send] : -1;
      s.units[1] = p.recv >= 0 ? callOrder[p.recv] : -1;
      steps.push_back(s);
    }
    return steps;
  }
  bool sendsIn(int r, int id) const {
    return units_[id]->members[units_[id]->sender] == r;
  }
  int peerIn(int r, int id) const {
    const Unit& u = *units_[id];
    return u.members[1 - u.indexOf(r)];
  }

  // The step as its pair's two-rank exchange: each member's plan and posted regions, its sendTo and input from the op
  // it sends, its recvFrom and output from the op it receives (pairPlanOf's plan, on the model's arenas).
  Exchange stepExchange(const BatchStep& step) const {
    Exchange x;
    x.plans.resize(2);
    x.posted.resize(2);
    for (ExchangePlan& p : x.plans) {
      p.sendTo.assign(2, ByteRange{});
      p.recvFrom.assign(2, ByteRange{});
    }
    for (int id : step.units) {
      if (id < 0)
        continue;
      const Unit& u = *units_[id];
      const int from = u.sender, to = 1 - u.sender;
      x.plans[from].sendTo[to] = u.x.plans[from].sendTo[to];
      x.plans[from].input = u.x.plans[from].input;
      x.plans[from].inputBytes = u.x.plans[from].inputBytes;
      x.posted[from].input = u.x.posted[from].input;
      x.plans[to].recvFrom[from] = u.x.plans[to].recvFrom[from];
      x.plans[to].output = u.x.plans[to].output;
      x.plans[to].outputBytes = u.x.plans[to].outputBytes;
      x.posted[to].outputBase = u.x.posted[to].outputBase;
    }
    return x;
  }

  // Rank r's p2p call (a lone send or recv is a batch of one) through the real batch schedule,
  // scheduleDirectP2pBatch, on its pairs' transports, each step taking its pair's next serial, each peer's steps after
  // the Arrived phase on the pool's lanes as the copy-engine runner forks them (the k-th peer on pair k mod the pool,
  // forked from the Drain lane, joined into it at the end). The wrong variants reorder what it records:
  // --wait-before-arrived runs each step whole in turn, in call order (each step's phases before the next step's),
  // --done-after-every-copy moves every step's Done after every step's copies, both on the batch's two lanes, as is
  // --shared-lanes, which changes nothing else; --copy-before-arrived leaves out the waits for the peer's Arrived
  // before pushes.
  void p2pBatch(int r, int it, const std::vector<BatchStep>& batch, const int laneQueue[2]) {
    std::vector<DirectPairStep> steps;
    std::vector<FakeTransport*> transports;
    for (const BatchStep& b : batch) {
      const Unit& u = *units_[b.first()];
      const int i = u.indexOf(r), peer = u.members[1 - i];
      FakeTransport& t = *pairs_[u.pair]->world.ranks[i];
      const uint32_t serial = ++pairSerial_[r][peer];
      for (int id : b.units) {
        if (id < 0)
          continue;
        Unit& op = *units_[id];
        op.serialBy[i] = serial;
        if (op.serialBy[1 - i] >= 0 && op.serialBy[1 - i] != op.serialBy[i])
          violation("ranks disagree on a pair's serial: " + op.description + " is serial " +
                    std::to_string(op.serialBy[1 - i]) + " on rank " + std::to_string(peer) + ", " +
                    std::to_string(serial) + " on rank " + std::to_string(r));
      }
      const Exchange x = stepExchange(b);
      DirectPairStep s;
      s.transport = &t;
      s.plan = x.plans[i];
      s.serial = serial;
      s.posted = x.posted[i];
      s.peer = exchangePeers(x, u.pairing, i)[1 - i];
      steps.push_back(s);
      if (!std::count(transports.begin(), transports.end(), &t))
        transports.push_back(&t);
    }
    std::vector<size_t> order(steps.size());
    std::iota(order.begin(), order.end(), 0);
    // Numbered in the order of the steps, run in call order: --signals-in-call-order, and --wait-before-arrived,
    // which runs the steps whole as a batch calling scheduleDirectExchange op after op would (in the pairs' order
    // instead, steps run whole would not wait in a cycle: the smallest pair with a step left has both members at it).
    if (o_.mutation == P2POptions::Mutation::SignalsInCallOrder ||
        o_.mutation == P2POptions::Mutation::WaitBeforeArrived) {
      const std::vector<int>& calls = items_[it].units.at(r);
      auto place = [&](size_t k) {  // of the step's first op in call order
        std::ptrdiff_t at = static_cast<std::ptrdiff_t>(calls.size());
        for (int id : batch[k].units)
          if (id >= 0)
            at = std::min(at, std::find(calls.begin(), calls.end(), id) - calls.begin());
        return at;
      };
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return place(a) < place(b); });
    }
    std::vector<DirectPairStep> ordered;
    for (size_t k : order)
      ordered.push_back(steps[k]);
    // What the schedule records, with its step (in `order`), phase and the peer lanes it goes on (-1: the batch's
    // own); or a fork of peer lanes from the Drain lane, or the join of every forked one into it.
    struct Recorded {
      size_t step;
      P2pPhase phase;
      RecordedOp op;
      int lanes = -1;
      enum { Operation, Fork, Join } kind = Operation;
    };
    std::vector<Recorded> recorded;
    size_t current = 0;
    P2pPhase phase = P2pPhase::kArrive;
    std::map<const Transport*, int> lanesOf;  // each forked peer's pair of the pool
    auto lanesNow = [&] {
      auto found = lanesOf.find(ordered[current].transport);
      return phase == P2pPhase::kArrive || found == lanesOf.end() ? -1 : found->second;
    };
    for (FakeTransport* t : transports) {
      t->bound = [&](int lane, const Op& op) {
        RecordedOp o;
        o.lane = lane;
        o.op = op;
        recorded.push_back({current, phase, o, lanesNow()});
      };
      t->boundJoin = [&](int into, int from) {
        RecordedOp o;
        o.join = true;
        o.lane = into;
        o.from = from;
        recorded.push_back({current, phase, o, lanesNow()});
      };
    }
    struct PoolLanes : P2pPeerLanes {
      std::function<void(size_t, size_t)> onFork;
      std::function<void()> onJoin;
      void fork(size_t peer, size_t firstStep) override {
        onFork(peer, firstStep);
      }
      void join() override {
        onJoin();
      }
    } pool;
    pool.onFork = [&](size_t peer, size_t firstStep) {
      const int lanes = static_cast<int>(peer) % o_.lanePool;
      lanesOf[ordered[firstStep].transport] = lanes;
      Recorded f{firstStep, P2pPhase::kCopy, RecordedOp{}, lanes};
      f.kind = Recorded::Fork;
      recorded.push_back(f);
    };
    pool.onJoin = [&] {
      Recorded j{current, P2pPhase::kFinish, RecordedOp{}, -1};
      j.kind = Recorded::Join;
      recorded.push_back(j);
    };
    const bool ownLanes =
        !o_.sharedLanes && !o_.doneAfterEveryCopy && o_.mutation != P2POptions::Mutation::WaitBeforeArrived;
    scheduleDirectP2pBatch(
        ordered,
        [&](size_t step, P2pPhase p) {
          current = step;
          phase = p;
        },
        ownLanes ? &pool : nullptr);
    for (FakeTransport* t : transports) {
      t->bound = nullptr;
      t->boundJoin = nullptr;
    }
    auto isDoneSignal = [](const Recorded& o) {
      return !o.op.join && o.op.op.kind == Op::SignalOne && o.op.op.flag == Flag::Done;
    };
    if (o_.mutation == P2POptions::Mutation::WaitBeforeArrived)
      std::stable_sort(recorded.begin(), recorded.end(),
                       [](const Recorded& a, const Recorded& b) { return a.step < b.step; });
    if (o_.doneAfterEveryCopy)
      std::stable_sort(recorded.begin(), recorded.end(), [&](const Recorded& a, const Recorded& b) {
        auto place = [&](const Recorded& o) { return 2 * static_cast<int>(o.phase) + (isDoneSignal(o) ? 1 : 0); };
        return place(a) < place(b);
      });
    std::vector<int> forked;
    for (const Recorded& o : recorded) {
      if (o.kind == Recorded::Fork) {
        for (int q : {peerPushQueue(o.lanes), peerPushQueue(o.lanes) + 1})
          fenceOn(r, q, laneQueue[static_cast<int>(Lane::Drain)]);
        forked.push_back(o.lanes);
        continue;
      }
      if (o.kind == Recorded::Join) {
        for (int lanes : forked)
          fenceOn(r, laneQueue[static_cast<int>(Lane::Drain)], peerPushQueue(lanes) + 1);
        continue;
      }
      if (o_.mutation == P2POptions::Mutation::CopyBeforeArrived && !o.op.join && o.op.op.kind == Op::WaitOne &&
          o.op.op.flag == Flag::Arrived && o.op.lane == static_cast<int>(Lane::Push))
        continue;
      const BatchStep& b = batch[order[o.step]];
      const int other = b.units[0] >= 0 && b.units[1] >= 0 ? b.units[1] : -1;
      const int peerLanes[2] = {peerPushQueue(o.lanes), peerPushQueue(o.lanes) + 1};
      emit(r, b.first(), it, o.op, o.lanes < 0 ? laneQueue : peerLanes, other);
    }
  }

  // Rank r makes its next call. `allowTogether`: peers not yet at the mailbox may post within its wait (then they
  // make the call right after, without that choice themselves).
  void enqueue(int r, bool allowTogether) {
    const int k = next_[r]++;
    const int it = program_[r][k];
    if (o_.faults && !mayEnqueue(failed_[r], anyPeerFailed(r))) {
      failRank(r, "a peer's \"failed\" read before enqueueing");
      return;
    }
    Item& item = items_[it];
    const std::vector<int>& units = item.units.at(r);
    for (int id : units)  // a batch connects its new pairs at once: every such peer is at this call (canEnqueue)
      if (units_[id]->kind == UnitKind::SendRecv && !pairs_[units_[id]->pair]->connected)
        connect(*pairs_[units_[id]->pair]);
    std::vector<BatchStep> batch;
    if (item.collective)
      batch.push_back({{units.front(), -1}});
    else
      batch = stepsOf(r, units);
    if (o_.faults && r == refusingRank_ && k == refusedCall_) {
      refuse(r, batch);
      return;
    }
    if (o_.faults && !item.collective) {
      // The peer's post for a step's serial says it refused: this rank posts its steps in order up to that one, each
      // with its buffers, and throws there before it enqueues anything (CopyEngineDirect::arriveExchange,
      // PeerRefusedPost), keeping the buffers it posted for good (a peer that read a post may copy with them).
      const auto refusedAt = std::find_if(batch.begin(), batch.end(), [&](const BatchStep& b) {
        const Unit& u = *units_[b.first()];
        return u.refusedBy[1 - u.indexOf(r)];
      });
      if (refusedAt != batch.end()) {
        for (auto b = batch.begin(); b != refusedAt + 1; ++b) {
          post(r, b->first(), {});
          for (int id : b->units) {
            if (id < 0)
              continue;
            Unit& u = *units_[id];
            u.postedBy = units_[b->first()]->postedBy;
            u.pairing = units_[b->first()]->pairing;
            u.keptBy[u.indexOf(r)] = true;
          }
        }
        failRank(r, "it read a peer's refused post");
        return;
      }
    }
    std::vector<int> together;
    for (const BatchStep& b : batch) {
      const int id = b.first();
      const Unit& u = *units_[id];
      for (size_t j = 0; j < u.members.size() && allowTogether && u.direct(); ++j) {
        const int p = u.members[j];
        if (p != r && !u.postedBy[j] && !std::count(together.begin(), together.end(), p) && canEnqueue(p) &&
            cpuAt(p, u.pair, id) && !refusesNext(p) && !readsRefusalNext(p) && pick(0, 2) == 0)
          together.push_back(p);
      }
    }
    for (const BatchStep& b : batch) {  // a step posts once for its ops
      post(r, b.first(), together);
      for (int id : b.units)
        if (id >= 0 && id != b.first()) {
          units_[id]->pairing = units_[b.first()]->pairing;
          units_[id]->postedBy = units_[b.first()]->postedBy;
        }
    }
    // The streams, as CopyEngineRunner binds them: the caller's stream writes the inputs first; the lanes start where
    // it stands (forkFromCaller), the Drain lane after the previous call's end where CallOrder says so.
    const int callerQ = 2 + caller_[r][k];
    const int drainQ = sync_[r][k] ? callerQ : 1;
    int pushQ = 0;
    const Unit& first = *units_[units.front()];
    if (first.kind == UnitKind::StagingAllgather &&
        chunkCount(first.buffers.plans[r], groupStaging_.ranks[r]->geometry()) <= 1)
      pushQ = drainQ;
    Step produce;
    produce.kind = Step::Produce;
    produce.item = it;
    add(r, callerQ, produce);
    fenceOn(r, drainQ, callerQ);
    fenceOn(r, pushQ, callerQ);
    if (order_[r].mustWaitForPrevious(drainQ))
      fence(r, drainQ, previousEnd_[r].first, previousEnd_[r].second);
    const int laneQueue[2] = {pushQ, drainQ};
    if (item.collective) {
      for (const RecordedOp& o : record(r, units.front()))
        emit(r, units.front(), it, o, laneQueue);
      if (first.kind == UnitKind::StagingAllgather)
        fenceOn(r, drainQ, pushQ);  // the runner's pushDone_ event
    } else {
      p2pBatch(r, it, batch, laneQueue);
    }
    Step end;
    end.kind = Step::End;
    end.item = it;
    add(r, drainQ, end);
    order_[r].ended(drainQ);
    previousEnd_[r] = {drainQ, queues_[r][drainQ].recorded};
    for (int p : together)
      enqueue(p, false);
  }

  // Whether rank r's next call is the one it refuses.
  bool refusesNext(int r) const {
    return r == refusingRank_ && next_[r] == refusedCall_;
  }
  // Whether rank r's next call meets a refused post: it throws there, posting none of its steps after that one, so no
  // peer may count on it posting within that peer's wait.
  bool readsRefusalNext(int r) const {
    if (!hasCallsLeft(r))
      return false;
    for (int id : items_[program_[r][next_[r]]].units.at(r)) {
      const Unit& u = *units_[id];
      if (u.kind == UnitKind::SendRecv && u.refusedBy[1 - u.indexOf(r)])
        return true;
    }
    return false;
  }

  // Rank r refuses its p2p call on its own arguments: each step still takes its pair's serial and posts, as refused
  // (no buffers: a peer that posts later reads it and refuses too; one that posted earlier waits on this rank, and
  // its watchdog fails it), nothing is enqueued, the call raises (its buffers go back to the caller), the rank fails.
  // --refusal-posts-buffers posts the buffers as an ordinary post would: a later peer then goes on and moves both
  // directions with buffers the refusing rank's caller took back.
  void refuse(int r, const std::vector<BatchStep>& batch) {
    for (const BatchStep& b : batch) {
      Unit& first = *units_[b.first()];
      const int i = first.indexOf(r);
      const uint32_t serial = ++pairSerial_[r][first.members[1 - i]];
      post(r, b.first(), {});
      for (int id : b.units) {
        if (id < 0)
          continue;
        Unit& u = *units_[id];
        u.serialBy[i] = serial;
        u.postedBy[i] = true;
        u.pairing = first.pairing;
        u.refusedBy[i] = o_.mutation != P2POptions::Mutation::RefusalPostsBuffers;
        u.ended[i] = true;
        u.endedWithError[i] = true;
      }
    }
    refusalPosted_ = true;  // it fails next (addFaultMoves): peers may post in between
  }

  // ---- Running.

  bool ready(int r, const Step& s) const {
    return s.kind == Step::Operation ? s.world->ready(s.index, s.op) : nonOperationReady(r, s);
  }

  void produce(int r, int it) {
    for (int id : items_[it].units.at(r)) {
      Unit& u = *units_[id];
      const int i = u.indexOf(r);
      if (u.kind == UnitKind::SendRecv || u.kind == UnitKind::Exchange) {
        u.x.outputs[i] = u.freshOutputs[i];
        produceInput(u.x.plans[i], u.x.sent[i]);
        continue;
      }
      produceInput(u.buffers.plans[i].input, u.original[i]);
    }
  }

  // "" when member i's buffers of unit u hold what they must once its call ended.
  std::string mismatch(const Unit& u, int i) const {
    if (u.kind == UnitKind::SendRecv || u.kind == UnitKind::Exchange)
      return exchangeMismatch(u.x, i);
    for (int q = 0; q < W_; ++q) {
      size_t at = 0;
      for (const ByteSpan& s : u.buffers.plans[i].outputByRank[q]) {
        if (s.bytes > 0 && memcmp(s.ptr, u.original[q].data() + at, s.bytes) != 0)
          return "rank " + std::to_string(i) + " holds wrong bytes for rank " + std::to_string(q);
        at += s.bytes;
      }
    }
    return "";
  }

  void end(int r, int it) {
    const std::vector<int>& units = items_[it].units.at(r);
    if (!o_.faults) {
      forEachQueuedTouch([&](int p, int, std::pair<int, int> touch) {
        auto [id, i] = touch;
        if (units_[id]->members[i] == r && std::count(units.begin(), units.end(), id))
          violation("early completion: " + units_[id]->description + " ended on rank " + std::to_string(r) +
                    " while rank " + std::to_string(p) + " still has a copy into or out of its buffers queued");
      });
    }
    for (int id : units) {
      Unit& u = *units_[id];
      const int i = u.indexOf(r);
      u.ended[i] = true;  // its buffers go back to the caller
      if (failed_[r]) {
        u.endedWithError[i] = true;
        continue;
      }
      const std::string wrong = mismatch(u, i);
      if (!wrong.empty())
        violation(std::string(o_.faults ? "wrong bytes in a call that ended without error" : "wrong bytes") + ": " +
                  u.description + " on rank " + std::to_string(r) + ": " + wrong);
    }
  }

  void runHead(int r, int q) {
    const Step s = popHead(r, q);
    switch (s.kind) {
      case Step::Operation:
        for (auto [id, i] : s.touches) {
          const Unit& u = *units_[id];
          const int owner = u.members[i];
          if (gone_[owner] || u.keptBy[i])
            continue;  // its memory went with its process, or is kept for good
          if (u.ended[i])
            violation("write after end: rank " + std::to_string(r) + " copied into or out of rank " +
                      std::to_string(owner) + "'s buffers of " + u.description + " after that call ended there (" +
                      (u.endedWithError[i] ? "with an error" : "without error") + ")");
          else if (owner != r && u.direct() && !u.arrived[i])
            violation("copy before arrival: rank " + std::to_string(r) + " copied into or out of rank " +
                      std::to_string(owner) + "'s buffers of " + u.description + " before its stream signalled " +
                      "Arrived there");
        }
        s.world->execute(s.index, s.op);
        if (s.op.kind == Op::SignalOne && s.op.flag == Flag::Arrived) {
          units_[s.unit]->arrived[s.index] = true;
          if (s.otherUnit >= 0)
            units_[s.otherUnit]->arrived[s.index] = true;
        }
        break;
      case Step::Produce:
        produce(r, s.item);
        break;
      case Step::End:
        end(r, s.item);
        break;
      case Step::Fence:
        break;
    }
  }

  // ---- The fault protocol (fault_release.hpp), as FaultCase applies it, over every transport two ranks share.

  void failRank(int r, const std::string& why) {
    if (failed_[r])
      return;
    failed_[r] = true;  // every call in flight now carries an error; "failed" is published with it
    what_ += "; rank " + std::to_string(r) + " failed at step " + std::to_string(step_) + " (" + why + ")";
  }

  // Calls visit(transport of `holder`, index of `other` there, last serial of `writer` there) for every transport the
  // two ranks share: the group's staging and direct ones, and their pair's once connected.
  template <class Visit>
  void forEachSharedTransport(int holder, int other, int writer, Visit&& visit) {
    visit(*groupStaging_.ranks[holder], other, static_cast<uint32_t>(chunks_[writer]));
    visit(*groupDirect_.ranks[holder], other, directSerial_[writer]);
    Pair& p = pairOf(holder, other);
    if (p.connected) {
      const int h = p.ranks[0] == holder ? 0 : 1;
      visit(*p.world.ranks[h], 1 - h, pairSerial_[writer][writer == holder ? other : holder]);
    }
  }
  // Rank r writes its own flag words from `peer` (rule 4, a peer whose process is gone).
  void passOwnWaits(int r, int peer) {
    passedOwn_[r][peer] = true;
    forEachSharedTransport(r, peer, r, [&](FakeTransport& mine, int from, uint32_t last) {
      forEachReleasedWord(mine.geometry().slots, [&](Flag f, int s) { mine.flag(f, from, s) = releaseValue(last); });
    });
  }
  // Rank r writes into `peer` every flag word the peer waits on from it (rule 3).
  void release(int r, int peer) {
    released_[r][peer] = true;
    forEachSharedTransport(peer, r, r, [&](FakeTransport& theirs, int from, uint32_t last) {
      forEachReleasedWord(theirs.geometry().slots,
                          [&](Flag f, int s) { theirs.flag(f, from, s) = releaseValue(last); });
    });
  }

  void addFaultMoves(int r, std::vector<std::function<void()>>& moves) {
    if (r == refusingRank_ && refusalPosted_ && !failed_[r] && !gone_[r])
      moves.push_back([this, r] {
        refusalPosted_ = false;
        failRank(r, "it refused its call on its own arguments");
      });
    bool peerGone = false;
    for (int p = 0; p < W_; ++p)
      peerGone |= p != r && gone_[p];
    if (!failed_[r] && peerGone)
      moves.push_back([this, r] { failRank(r, "its watchdog saw a peer's process gone"); });
    if (failsForPeer(failed_[r], anyPeerFailed(r)))
      moves.push_back([this, r] { failRank(r, "its watchdog saw a peer's \"failed\""); });
    for (int p = 0; p < W_; ++p) {
      if (p == r)
        continue;
      const bool passes =
          o_.mutation == P2POptions::Mutation::PassOwnWaits ? failed_[r] : mayPassOwnWaits(failed_[r], gone_[p]);
      if (passes && !passedOwn_[r][p])
        moves.push_back([this, r, p] { passOwnWaits(r, p); });
      if (mayReleaseInto(failed_[r], quiesced(r), failed_[p], released_[r][p]))
        moves.push_back([this, r, p] { release(r, p); });
    }
  }

  // Where each stream with steps left stands, and each CPU with calls left (for a hang's report).
  std::string heads() const {
    static const char* const kFlagNames[] = {"Ready", "Credit", "Arrived", "Done"};
    static const char* const kStreams[] = {"push",        "drain",        "C1",          "C2",
                                           "peer 0 push", "peer 0 drain", "peer 1 push", "peer 1 drain",
                                           "peer 2 push", "peer 2 drain"};
    static_assert(sizeof(kStreams) / sizeof(kStreams[0]) == kQueuesPerRank);
    std::string out;
    for (int r = 0; r < W_; ++r) {
      if (gone_[r])
        continue;
      for (int q = 0; q < kQueuesPerRank; ++q) {
        if (queues_[r][q].steps.empty())
          continue;
        const Step& s = queues_[r][q].steps.front();
        std::string at;
        if (s.kind == Step::Fence)
          at = std::string("a fence on ") + kStreams[s.queue];
        else if (s.kind != Step::Operation)
          at = "a call's " + std::string(s.kind == Step::End ? "end" : "input");
        else if (s.op.kind == Op::WaitOne)
          at = units_[s.unit]->description + "'s wait for " + kFlagNames[static_cast<int>(s.op.flag)] + " " +
               std::to_string(s.op.value) + " from rank " + std::to_string(units_[s.unit]->members[s.op.peer]);
        else
          at = units_[s.unit]->description + "'s step";
        const int ahead = earlierOnHardwareQueue(r, q);
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " " + kStreams[q] + " at " + at +
               (ahead < 0 ? "" : std::string(", behind ") + kStreams[ahead] + " on their hardware queue");
      }
      if (!failed_[r] && hasCallsLeft(r))
        out += (out.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + "'s CPU at call " +
               std::to_string(next_[r]) + (step_ < delay_[r] ? "" : " (at a connect)");
    }
    return out;
  }

  std::mt19937& rng_;
  P2POptions o_;
  int W_ = 0;
  World groupStaging_, groupDirect_;
  std::vector<std::unique_ptr<Pair>> pairs_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<Item> items_;
  std::vector<std::vector<int>> program_;  // [rank]: its items in call order
  std::vector<std::vector<bool>> sync_;    // [rank][call]: its Drain lane on the caller's stream
  std::vector<std::vector<int>> caller_;   // [rank][call]: C1 (0) or C2 (1)
  std::string programDescription_;
  bool usualRingOfThree_ = false;
  std::vector<uint64_t> chunks_;
  std::vector<uint32_t> directSerial_;
  std::vector<std::vector<uint32_t>> pairSerial_;  // [rank][peer]: the last serial of their pair on the rank
  std::vector<CallOrder<int>> order_;
  std::vector<std::pair<int, uint64_t>> previousEnd_;  // [rank]: queue and count after its previous call's end
  std::vector<int> next_, delay_, limit_;
  std::vector<bool> failed_, gone_;
  std::vector<std::vector<bool>> released_, passedOwn_;
  bool faultFree_ = false;
  int faultRank_ = 0, faultStep_ = -1, deathRank_ = 0, deathStep_ = -1;
  int refusingRank_ = -1, refusedCall_ = -1;  // that rank refuses that call (its k-th) on its own arguments
  bool refusalPosted_ = false;                // its refused posts are out, its failure not yet published
  int step_ = 0;
  std::string failure_;
  std::string what_;
};

// --p2p: without a wrong variant every case must pass ("ok <cases>"); with one, every case runs and the cases it is
// caught in are counted by kind ("caught N of CASES cases: <kind> <count>; ..."), for --wait-before-arrived with the
// rings of 3 or more ranks listed the usual way ("rings of 3 or more ranks hang R of T;"), each of which must hang.
// One option of --p2p; false where it is none, or a second wrong variant, or --pass-own-waits before --faults.
bool parseP2POption(const char* arg, P2POptions& o) {
  const bool unmutated = o.mutation == P2POptions::Mutation::None;
  if (strcmp(arg, "--faults") == 0)
    o.faults = true;
  else if (unmutated && strcmp(arg, "--wait-before-arrived") == 0)
    o.mutation = P2POptions::Mutation::WaitBeforeArrived;
  else if (unmutated && strcmp(arg, "--copy-before-arrived") == 0)
    o.mutation = P2POptions::Mutation::CopyBeforeArrived;
  else if (unmutated && o.faults && strcmp(arg, "--pass-own-waits") == 0)
    o.mutation = P2POptions::Mutation::PassOwnWaits;
  else if (unmutated && strcmp(arg, "--serials-in-call-order") == 0)
    o.mutation = P2POptions::Mutation::SerialsInCallOrder;
  else if (unmutated && strcmp(arg, "--signals-in-call-order") == 0)
    o.mutation = P2POptions::Mutation::SignalsInCallOrder;
  else if (unmutated && o.faults && strcmp(arg, "--refusal-posts-buffers") == 0)
    o.mutation = P2POptions::Mutation::RefusalPostsBuffers;
  else if (unmutated && strcmp(arg, "--connect-in-turn") == 0)
    o.mutation = P2POptions::Mutation::ConnectInTurn;
  else if (strcmp(arg, "--unmatched-batches") == 0)
    o.unmatchedBatches = true;
  else if (strcmp(arg, "--interleaved-peers") == 0)
    o.unmatchedBatches = o.interleavedPeers = true;
  else if (strcmp(arg, "--done-after-every-copy") == 0)
    o.doneAfterEveryCopy = true;
  else if (strcmp(arg, "--shared-lanes") == 0)
    o.sharedLanes = true;
  else if (strcmp(arg, "--peer-lanes-share-queues") == 0)
    o.peerLanesShareQueues = true;
  else if (strncmp(arg, "--lane-pool=", 12) == 0 && atoi(arg + 12) >= 1 && atoi(arg + 12) <= 3)
    o.lanePool = atoi(arg + 12);
  else
    return false;
  return true;
}

int runP2P(std::mt19937& rng, int cases, const P2POptions& options) {
  const bool counts = options.mutation != P2POptions::Mutation::None || options.unmatchedBatches ||
                      options.doneAfterEveryCopy || options.sharedLanes || options.lanePool < 3 ||
                      options.peerLanesShareQueues;
  CaughtCases caught;
  int rings = 0, ringsHung = 0;
  for (int c = 0; c < cases; ++c) {
    P2PCase model(rng, c, options);
    const std::string failure = model.run();
    if (model.hasUsualRingOfThree()) {
      ++rings;
      ringsHung += failure.rfind("hang:", 0) == 0;
    }
    caught.addResult(failure, counts);
  }
  if (options.mutation != P2POptions::Mutation::WaitBeforeArrived)
    return caught.report(cases);
  return caught.report(
      cases, " rings of 3 or more ranks hang " + std::to_string(ringsHung) + " of " + std::to_string(rings) + ";");
}
}  // namespace

int main(int argc, char** argv) {
  const bool inFlight = argc >= 4 && strcmp(argv[3], "--calls-in-flight") == 0;
  const bool faults = argc >= 4 && strcmp(argv[3], "--faults") == 0;
  const bool exchanges = argc >= 4 && strcmp(argv[3], "--exchanges") == 0;
  const bool hardwareQueues = argc >= 4 && strcmp(argv[3], "--hardware-queues") == 0;
  const bool p2p = argc >= 4 && strcmp(argv[3], "--p2p") == 0;
  const bool capturedExchanges = argc >= 4 && strcmp(argv[3], "--captured-exchanges") == 0;
  const bool capturedP2p = argc >= 4 && strcmp(argv[3], "--captured-p2p") == 0;
  bool unordered = false, unforked = false, crossedOrders = false, withoutArrived = false, listingOrder = false;
  FaultOptions faultOptions;
  P2POptions p2pOptions;
  auto mutation = FakeTransport::Mutation::None;
  const bool mode = inFlight || faults || exchanges || hardwareQueues || p2p || capturedExchanges || capturedP2p;
  bool usage = argc < 3;
  auto parsePeerLaneFault = [](const char* arg) {
    if (peerLaneFault != PeerLaneFault::None)
      return false;
    if (strcmp(arg, "--unjoined-peer-lanes") == 0)
      peerLaneFault = PeerLaneFault::Unjoined;
    else if (strcmp(arg, "--unforked-peer-lanes") == 0)
      peerLaneFault = PeerLaneFault::Unforked;
    else if (strcmp(arg, "--flags-on-peer-lanes") == 0)
      peerLaneFault = PeerLaneFault::FlagsOnPeerLanes;
    else if (strcmp(arg, "--relay-waits-on-root-lane") == 0)
      peerLaneFault = PeerLaneFault::RelayWaitsOnRootLane;
    else if (strcmp(arg, "--drain-flags-behind-peer-lanes") == 0)
      peerLaneFault = PeerLaneFault::DrainFlagsBehindPeerLanes;
    return peerLaneFault != PeerLaneFault::None;
  };
  for (int a = mode ? 4 : 3; a < argc; ++a) {
    if ((!mode || inFlight || hardwareQueues || exchanges || faults) && parsePeerLaneFault(argv[a]))
      continue;
    if ((!mode || inFlight || hardwareQueues || exchanges) && strcmp(argv[a], "--many-ranks") == 0) {
      manyRanks = true;
      continue;
    }
    if ((inFlight || hardwareQueues) && strcmp(argv[a], "--collect-staging-flags") == 0) {
      collectStagingFlags = true;
      continue;
    }
    if ((inFlight || hardwareQueues) && strcmp(argv[a], "--signals-behind-waits") == 0) {
      stagingFlagsBehindWaits = true;
      continue;
    }
    if (p2p)
      usage |= !parseP2POption(argv[a], p2pOptions);
    else if (hardwareQueues && strcmp(argv[a], "--crossed-orders") == 0)
      crossedOrders = true;
    else if (inFlight && strcmp(argv[a], "--unordered") == 0)
      unordered = true;
    else if (inFlight && strcmp(argv[a], "--unforked") == 0)
      unforked = true;
    else if (faults && strcmp(argv[a], "--old-release") == 0)
      faultOptions.rule = ReleaseRule::Old;
    else if (faults && strcmp(argv[a], "--shared-queue-crossed") == 0)
      faultOptions.sharedQueueCrossed = true;
    else if (faults && strcmp(argv[a], "--one-hardware-queue") == 0)
      faultOptions.oneHardwareQueue = true;
    else if (faults && strcmp(argv[a], "--own-release-on-queue") == 0)
      faultOptions.ownReleaseOnQueue = true;
    else if (exchanges && mutation == FakeTransport::Mutation::None && strcmp(argv[a], "--skip-done-wait") == 0)
      mutation = FakeTransport::Mutation::SkipDoneWait;
    else if (exchanges && mutation == FakeTransport::Mutation::None && strcmp(argv[a], "--arrived-before-pack") == 0)
      mutation = FakeTransport::Mutation::ArrivedBeforePack;
    else if (capturedExchanges && strcmp(argv[a], "--without-arrived") == 0)
      withoutArrived = true;
    else if (capturedP2p && strcmp(argv[a], "--listing-order") == 0)
      listingOrder = true;
    else
      usage = true;
  }
  if (usage) {
    fprintf(
        stderr,
        "usage: %s SEED CASES [--many-ranks] [<wrong peer lanes>] [--calls-in-flight [--unordered] [--unforked] | "
        "--hardware-queues "
        "[--crossed-orders] | --faults [--old-release] [--shared-queue-crossed | --one-hardware-queue "
        "[--own-release-on-queue]] | --exchanges "
        "[--skip-done-wait | "
        "--arrived-before-pack] | --p2p [--faults] [--wait-before-arrived | --copy-before-arrived | --pass-own-waits | "
        "--serials-in-call-order | --signals-in-call-order | --connect-in-turn | --refusal-posts-buffers] "
        "[--unmatched-batches | "
        "--interleaved-peers] [--done-after-every-copy] [--shared-lanes] [--lane-pool=N] [--peer-lanes-share-queues] | "
        "--captured-exchanges "
        "[--without-arrived] | --captured-p2p "
        "[--listing-order]]\n"
        "  <wrong peer lanes>, also after --calls-in-flight, --hardware-queues, --exchanges or --faults: "
        "--unjoined-peer-lanes | --unforked-peer-lanes | --flags-on-peer-lanes | --relay-waits-on-root-lane | "
        "--drain-flags-behind-peer-lanes\n"
        "  --many-ranks, also after --calls-in-flight, --hardware-queues or --exchanges: 3 to 8 ranks\n",
        argv[0]);
    return 2;
  }
  std::mt19937 rng(static_cast<unsigned>(atoi(argv[1])));
  const int cases = atoi(argv[2]);
  if (p2p)
    return runP2P(rng, cases, p2pOptions);
  if (capturedExchanges)
    return runCapturedExchanges(rng, cases, withoutArrived);
  if (capturedP2p)
    return runCapturedP2p(rng, cases, listingOrder);
  const bool peerLanesWrong = peerLaneFault != PeerLaneFault::None;
  if (exchanges && mutation == FakeTransport::Mutation::None && !peerLanesWrong) {
    for (int c = 0; c < cases; ++c)
      exchangeCase(rng, c, mutation);
    printf("ok %d\n", cases);
    return 0;
  }
  if (exchanges) {
    // A wrong schedule: every case runs, and the cases it is caught in are counted by what caught it.
    failureEndsCase = true;
    CaughtCases caught;
    caught.runEach(cases, [&](int c) { exchangeCase(rng, c, mutation); }, "after that call ended", "write after end");
    return caught.report(cases);
  }
  if (faults) {
    // The protocol on its own streams stops at its first failure. The old rule and the shared hardware queues run
    // every case and count what they are caught at.
    const bool counts = faultOptions.rule == ReleaseRule::Old || faultOptions.sharedQueueCrossed ||
                        (faultOptions.oneHardwareQueue && faultOptions.ownReleaseOnQueue) || peerLanesWrong;
    CaughtCases caught;
    for (int c = 0; c < cases; ++c)
      caught.addResult(FaultCase(rng, c, faultOptions).run(), counts);
    return caught.report(cases);
  }
  if (peerLanesWrong && (inFlight || (hardwareQueues && !crossedOrders) || !mode)) {
    // Wrong peer lanes: every case runs, and the cases they are caught in are counted by what caught them.
    failureEndsCase = true;
    CaughtCases caught;
    caught.runEach(
        cases,
        [&](int c) {
          if (mode)
            CallsInFlight(rng, c, !unordered, !unforked, hardwareQueues).run();
          else
            directCase(rng, c);
        },
        "early completion", "early completion");
    return caught.report(cases);
  }
  if (inFlight || (hardwareQueues && !crossedOrders)) {
    for (int c = 0; c < cases; ++c)
      CallsInFlight(rng, c, !unordered, !unforked, hardwareQueues).run();
    printf("ok %d\n", cases);
    return 0;
  }
  if (hardwareQueues) {
    // Crossed orders: every case runs, and the hangs are counted. A hang is what crossed orders may cause, and only
    // where a hardware queue holds streams of both groups; anything else is a failure of the schedules.
    failureEndsCase = true;
    int hangs = 0, apart = 0;
    std::string first;
    for (int c = 0; c < cases; ++c) {
      CallsInFlight model(rng, c, true, true, true, true);
      const bool shared = model.groupsShareHardwareQueue();
      apart += !shared;
      try {
        model.run();
      } catch (const std::runtime_error& e) {
        const std::string failure = e.what();
        if (!shared || failure.find(": hang:") == std::string::npos) {
          fprintf(stderr, "FAIL: %s\n", failure.c_str());
          return 1;
        }
        if (first.empty())
          first = failure;
        ++hangs;
      }
    }
    if (first.empty()) {
      printf("ok %d\n", cases);
      return 0;
    }
    printf("caught %d of %d cases: hang %d; none in the %d cases whose groups share no hardware queue\n", hangs, cases,
           hangs, apart);
    fprintf(stderr, "FAIL: %s\n", first.c_str());
    return 1;
  }
  callCounts();
  for (int c = 0; c < cases; ++c) {
    stagingCase(rng, c);
    directCase(rng, c);
    capturedCase(rng, c);
    hierarchicalCase(rng, c);
  }
  printf("ok %d\n", cases);
  return 0;
}
