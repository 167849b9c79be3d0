// Runs the all-gather schedules (csrc/collective/) of W ranks against a fake transport that records every call, then
// executes the recorded operations of all ranks' lanes in a random interleaving that honours only the flags, the
// way independent streams on W GPUs would. Checks that every rank's output holds every rank's bytes, that no
// interleaving deadlocks, that flag serials survive wrapping past 2^32, and the call counts the per-call CPU cost
// rests on. The hierarchical schedule runs over fake nodes with a fake inner all-gather on rails (a rendezvous of
// the rail's members), its gathers on a third lane, with push and drain sharing a lane (one GPU stream), or with all
// of a rank's operations in one queue, as the host runner's single worker runs them. Usage: schedule_simulation SEED
// CASES; prints "ok <cases>" and exits 0 on success.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "collective/captured_allgather.hpp"
#include "collective/direct_allgather.hpp"
#include "collective/hierarchical_allgather.hpp"
#include "collective/staging_allgather.hpp"

using namespace sdma;

namespace {

[[noreturn]] void fail(const std::string& what) {
  fprintf(stderr, "FAIL: %s\n", what.c_str());
  exit(1);
}

// Gather and AwaitGather are the fake inner all-gather's (FakeRail below).
struct Op {
  enum Kind { Copy, Signal, Wait, Reset, SignalOne, WaitOne, Join, Gather, AwaitGather } kind;
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

// The queues a rank's operations go to: one per lane, and the inner all-gathers' own.
constexpr int kQueues = 3;
constexpr int kGatherQueue = 2;

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
  void pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes) override;
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
  void copyToPeer(Lane lane, int, uint64_t peerDst, const void* src, size_t bytes) override {
    record(lane, {Op::Copy, reinterpret_cast<char*>(peerDst), static_cast<const char*>(src), bytes});
  }
  void copyFromPeer(Lane lane, int, void* dst, uint64_t peerSrc, size_t bytes) override {
    record(lane, {Op::Copy, static_cast<char*>(dst), reinterpret_cast<const char*>(peerSrc), bytes});
  }
  void signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override {
    record(lane, {Op::SignalOne, nullptr, nullptr, 0, flag, slot, value, peer});
  }
  void waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override {
    record(lane, {Op::WaitOne, nullptr, nullptr, 0, flag, slot, value, peer});
  }
  void joinLane(Lane into, Lane from) override {
    const int fromQueue = queueOf(static_cast<int>(from));
    if (fromQueue != queueOf(static_cast<int>(into))) {
      Op join{Op::Join};
      join.peer = fromQueue;
      join.fence = recorded[fromQueue];
      record(into, join);
    }
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
    const int q = queueOf(lane);
    lanes[q].push_back(op);
    ++recorded[q];
  }
  std::deque<Op> lanes[kQueues];
  uint64_t recorded[kQueues] = {0, 0, 0};
  uint64_t executed[kQueues] = {0, 0, 0};
  std::map<std::string, int> calls;

 private:
  void record(Lane lane, Op op) {
    recordOn(static_cast<int>(lane), op);
  }

  World* world_;
  int rank_;
  StagingGeometry g_;
  std::vector<char> staging_;
  std::vector<uint32_t> flags_;
};

struct World {
  std::vector<std::unique_ptr<FakeTransport>> ranks;

  // Executes every lane's operations in a random order that respects each lane's order and its waits.
  void run(std::mt19937& rng, const std::string& what) {
    const int W = static_cast<int>(ranks.size());
    while (true) {
      std::vector<std::pair<int, int>> runnable;
      bool anyLeft = false;
      for (int r = 0; r < W; ++r) {
        for (int l = 0; l < 2; ++l) {
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
        break;
    }
  }
};

void FakeTransport::pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) {
  for (int k = 1; k < g_.worldSize; ++k) {
    const int peer = (rank_ + k) % g_.worldSize;
    FakeTransport& p = *world_->ranks[peer];
    record(lane, {Op::Copy, p.staging_.data() + g_.segmentOffset(slot, rank_, peer) + at, static_cast<const char*>(src),
                  bytes});
  }
  ++calls["pushChunkToPeers"];
}

void FakeTransport::pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes) {
  FakeTransport& p = *world_->ranks[peer];
  record(lane,
         {Op::Copy, p.staging_.data() + g_.segmentOffset(slot, rank_, peer), static_cast<const char*>(src), bytes});
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
// lanes run apart (two GPU streams) or as one (one stream, or the host runner's worker).
void directCase(std::mt19937& rng, int caseNo) {
  const int W = std::uniform_int_distribution<int>(2, 5)(rng);
  StagingGeometry g;
  g.worldSize = W;
  g.slots = std::uniform_int_distribution<int>(0, 1)(rng) ? 2 : 4;
  g.chunkBytes = 64;
  g.packs = false;
  const uint32_t bases[] = {0, 0xfffffffdu, static_cast<uint32_t>(rng())};
  const uint32_t flagBase = bases[std::uniform_int_distribution<int>(0, 2)(rng)];
  World world;
  const bool oneQueue = std::uniform_int_distribution<int>(0, 1)(rng);
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
      scheduleDirectAllgather(*world.ranks[r], b.plans[r], serial, posted[r], posts);
    }
    const std::string what = "direct case " + std::to_string(caseNo) + " (W=" + std::to_string(W) + ", " +
                             std::to_string(g.slots) + " slots, " + formName(form) + ", " +
                             std::to_string(bytes) + " bytes, serial " + std::to_string(serial) + ", bounced " +
                             bounced + (oneQueue ? ", one lane" : ", two lanes") + ")";
    world.run(rng, what);
    checkOutputs(b, original, what);
  }
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
}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s SEED CASES\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(static_cast<unsigned>(atoi(argv[1])));
  const int cases = atoi(argv[2]);
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
