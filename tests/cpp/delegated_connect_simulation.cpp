// Model check of how a CUDA call that torch_sdma hands to NCCL meets its peers (csrc/backend/exchange_collectives.cpp
// and process_group_sdma.cpp, docs/design.md "The call board"): NCCL runs an all-to-all, scatter or gather as sends and
// receives, and connects each direction with a peer at its first use, inside the call, on the caller's CPU, waiting
// there for the peer to connect the other end; its collectives (all_reduce, reduce_scatter, ...) connect their own
// channels with every peer at the first call of their kind (the group's first NCCL call creates the communicator, the
// same wait). No watcher sees a rank held there. Each rank has a caller thread, a watcher thread and a GPU; a random
// scheduler interleaves them.
//
// What the model covers:
// - The call board: each call posts what it is (or "refused", where the rank refused it on its own arguments, or
//   another call where the rank made another); a post reads the peers' posts of that number already there and fails
//   the rank's group on one unlike its own.
// - The design's rule: an exchange that sends to or receives from a peer in a direction no earlier exchange of the
//   rank used, and a collective of a kind NCCL has not run for the group (both marked once the inner call returned),
//   first waits until every peer posted the number or failed its group, and fails on a post unlike its own. Other calls
//   go to NCCL at once.
// - NCCL's connect: a rank's direction (send to q, or receive from q, on the exchanges' connections or on the channels
//   of one kind of collective, which need both directions with every peer) connects once q is inside a connect that
//   needs the other end (q's receive from it, or send to it, on the same connections), whatever call each is in; the
//   call returns once every direction it needs is connected, and its GPU work is enqueued. Nothing ends a connect but
//   the peer. A rank whose communicator the watcher aborted still connects at its next call (it has posted that call),
//   or, with --aborted-skips-connect, raises there at once and never connects: the design must hold either way.
// - The GPU: a call's work completes once every peer it moves bytes with enqueued that peer's work of the same number
//   and the same call; aborting the rank's communicator ends its works not complete.
// - The watcher of delegated collectives: a call whose peers had not all posted its number when it posted is watched
//   from its return; once every peer posted the number or failed its group, the watcher drops it (all alike) or fails
//   the group and aborts the communicator.
// - Programs of 2 to 4 ranks and up to 8 calls, each a collective of one of two kinds or an exchange of a random
//   pattern of who sends to whom, the same on every rank; faults, in two thirds of the cases: one rank refuses one
//   call, or makes another in its place (an exchange, a collective, or a call on the copy engines, which connects
//   nothing of NCCL's).
//
// Checks, per case, once nothing can move: no caller held in NCCL's connect or on the board, no GPU work left that
// nothing completes or aborts (a held stream), without a fault every call complete on every rank, and with a fault
// every rank's group failed (the fault named on every rank).
//
// What it does not cover: the bytes, NCCL's own timeouts, broadcast (NCCL runs it as a collective, not as sends and
// receives), ranks that exit, and the copy engines' own path (its connect waits for every peer's post by itself).
//
// Usage: delegated_connect_simulation SEED CASES [variant]. The design prints "ok <cases>" and exits 0; a failure
// prints "FAIL: <case>: <kind>: <what>" on stderr and exits 1. A wrong variant runs every case and prints "caught N of
// CASES cases: <kind> <count>; ..." (exit 1 where N > 0), the first case of each kind on stderr (every case with
// --every-case). The wrong variants:
// --no-await (every call goes to NCCL at once), --await-first-call-only (only the group's first delegated call waits),
// --await-pair-peers-only (the wait reads only the peers the call moves bytes with), --no-watcher (no watcher of
// delegated collectives), --exchanges-only (collectives never wait: a peer's other call at the first all_reduce held
// rank 0 in NCCL's communicator creation on two GPUs).
//
// Why the await reads every peer: a peer that finds a third rank's refusal (or other call) fails and never connects,
// so a rank that waited only for the peers it moves bytes with can be held in NCCL's connect by one of them. And why
// a failure after the await holds no one: a rank that outlives a post unlike its own is one that posted first (a later
// poster reads it and fails at once, posting nothing more), so where a member refused a call or made another, every
// rank that waits on a later call finds that member's post unlike or its group failed before it connects.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "model_cases.hpp"

namespace {

enum class Variant { kDesign, kNoAwait, kAwaitFirstCallOnly, kAwaitPairPeersOnly, kNoWatcher, kExchangesOnly };

using Rng = std::mt19937_64;
using Pattern = std::vector<std::vector<bool>>;  // [a][b]: rank a sends to rank b

// The connections a call needs: the exchanges' (kExchange), or the channels of one kind of collective.
constexpr int kExchange = 0;
constexpr int kCollectiveKinds = 2;

struct Call {
  int connections = kExchange;
  Pattern pattern;  // a collective's: every rank with every other, both ways; a copy-engine call's: empty
  bool operator==(const Call& o) const {
    return connections == o.connections && pattern == o.pattern;
  }
};

struct Case {
  int ranks = 2;
  std::vector<Call> calls;
  enum class Fault { kNone, kRefused, kOtherCall } fault = Fault::kNone;
  int faultRank = -1;
  int faultCall = -1;
  Call other;  // the faulted rank's call in place of call faultCall, for kOtherCall
};

Pattern randomPattern(Rng& rng, int ranks) {
  std::bernoulli_distribution sends(0.35);
  Pattern p(ranks, std::vector<bool>(ranks, false));
  for (int a = 0; a < ranks; ++a) {
    for (int b = 0; b < ranks; ++b) {
      p[a][b] = a != b && sends(rng);
    }
  }
  return p;
}

Call collective(int kind, int ranks) {
  Call call{1 + kind, Pattern(ranks, std::vector<bool>(ranks, true))};
  for (int a = 0; a < ranks; ++a) {
    call.pattern[a][a] = false;
  }
  return call;
}

Call randomCall(Rng& rng, int ranks) {
  const int k = std::uniform_int_distribution<int>(0, 2 * kCollectiveKinds)(rng);
  return k < kCollectiveKinds ? collective(k, ranks) : Call{kExchange, randomPattern(rng, ranks)};
}

Case makeCase(Rng& rng) {
  Case c;
  c.ranks = std::uniform_int_distribution<int>(2, 4)(rng);
  const int calls = std::uniform_int_distribution<int>(1, 8)(rng);
  for (int i = 0; i < calls; ++i) {
    c.calls.push_back(randomCall(rng, c.ranks));
  }
  const int f = std::uniform_int_distribution<int>(0, 2)(rng);
  if (f > 0) {
    c.fault = f == 1 ? Case::Fault::kRefused : Case::Fault::kOtherCall;
    c.faultRank = std::uniform_int_distribution<int>(0, c.ranks - 1)(rng);
    c.faultCall = std::uniform_int_distribution<int>(0, calls - 1)(rng);
    do {
      c.other = std::bernoulli_distribution(0.2)(rng)
                    ? Call{kExchange, Pattern(c.ranks, std::vector<bool>(c.ranks, false))}  // on the copy engines
                    : randomCall(rng, c.ranks);
    } while (c.other == c.calls[c.faultCall]);
  }
  return c;
}

// "exchange", "collective 1" (its kind), or, for a call that needs no NCCL connection, "copy engines" (the faulted
// rank's other call) or "empty exchange".
std::string kindOf(const Call& call, bool other = false) {
  if (call.connections != kExchange) {
    return "collective " + std::to_string(call.connections);
  }
  for (const auto& row : call.pattern) {
    for (bool sends : row) {
      if (sends) {
        return "exchange";
      }
    }
  }
  return other ? "copy engines" : "empty exchange";
}

std::string describe(const Case& c) {
  std::string s = std::to_string(c.ranks) + " ranks, " + std::to_string(c.calls.size()) + " calls";
  if (c.fault != Case::Fault::kNone) {
    s += std::string(c.fault == Case::Fault::kRefused ? ", rank " : ", another call on rank ") +
         std::to_string(c.faultRank) + (c.fault == Case::Fault::kRefused ? " refuses call " : " at call ") +
         std::to_string(c.faultCall) + " (" + kindOf(c.calls[c.faultCall]) +
         (c.fault == Case::Fault::kOtherCall ? " vs " + kindOf(c.other, true) : "") + ")";
  }
  return s;
}

// A direction of a rank: with a peer, sending (or receiving), on a call's connections.
struct Direction {
  int peer = 0;
  bool send = false;
  int connections = kExchange;
  bool operator<(const Direction& o) const {
    return std::tie(peer, send, connections) < std::tie(o.peer, o.send, o.connections);
  }
};

constexpr int kRefusedPost = -1;
constexpr int kOtherPost = -2;

class Simulation {
 public:
  Simulation(const Case& c, Variant variant, bool abortedSkipsConnect, Rng& rng)
      : c_(c), variant_(variant), abortedSkipsConnect_(abortedSkipsConnect), rng_(rng), ranks_(c.ranks) {}

  // "" where every check held, else "<kind>: <what>".
  std::string run() {
    for (int steps = 0; steps < 100000; ++steps) {
      std::vector<std::function<void()>> moves;
      for (int r = 0; r < c_.ranks; ++r) {
        callerMoves(r, moves);
        watcherMoves(r, moves);
        gpuMoves(r, moves);
      }
      if (moves.empty()) {
        return check();
      }
      moves[std::uniform_int_distribution<size_t>(0, moves.size() - 1)(rng_)]();
    }
    return "livelock: past 100000 steps";
  }

 private:
  enum class Phase { kPost, kAwait, kConnect, kDone, kStopped };
  struct Work {
    int call = 0;
    int post = 0;
    bool complete = false;
    bool aborted = false;
  };
  struct Rank {
    size_t pc = 0;
    Phase phase = Phase::kPost;
    bool groupFailed = false;
    std::vector<int> posts;         // the board: this rank's post of each number
    std::set<Direction> used;       // the design's marks, after the inner call returned
    std::set<Direction> connected;  // NCCL's connectors
    std::vector<int> watched;       // call numbers
    std::vector<Work> works;
    bool sawEveryPost = false;  // at its post of the current call
  };

  const Call& callOf(int r, int call) const {
    return c_.fault == Case::Fault::kOtherCall && r == c_.faultRank && call == c_.faultCall ? c_.other : c_.calls[call];
  }
  int postOf(int r, int call) const {
    if (c_.fault != Case::Fault::kNone && r == c_.faultRank && call == c_.faultCall) {
      return c_.fault == Case::Fault::kRefused ? kRefusedPost : kOtherPost;
    }
    return call;
  }
  std::set<Direction> directionsOf(int r, int call) const {
    const Call& c = callOf(r, call);
    std::set<Direction> d;
    for (int q = 0; q < c_.ranks; ++q) {
      if (c.pattern[r][q]) {
        d.insert({q, true, c.connections});
      }
      if (c.pattern[q][r]) {
        d.insert({q, false, c.connections});
      }
    }
    return d;
  }
  bool posted(int q, int call) const {
    return ranks_[q].posts.size() > static_cast<size_t>(call);
  }
  // Whether every peer posted `call` or failed its group (the board shows either); `unlike`: one of them is not
  // `post`.
  // `pairPeersOnly`: only the peers the call moves bytes with.
  bool everyPeerPostedOrFailed(int r, int call, int post, bool* unlike, bool pairPeersOnly = false) const {
    *unlike = false;
    std::set<int> pairPeers;
    for (const Direction& d : directionsOf(r, call)) {
      pairPeers.insert(d.peer);
    }
    for (int q = 0; q < c_.ranks; ++q) {
      if (q == r || (pairPeersOnly && !pairPeers.count(q))) {
        continue;
      }
      if (posted(q, call)) {
        *unlike = *unlike || ranks_[q].posts[call] != post;
      } else if (ranks_[q].groupFailed) {
        *unlike = true;
      } else {
        return false;
      }
    }
    return true;
  }
  void failGroup(int r) {
    Rank& me = ranks_[r];
    me.groupFailed = true;
    for (Work& w : me.works) {  // the communicator's abort
      if (!w.complete) {
        w.aborted = true;
      }
    }
  }

  // The inner call begins. With abortedSkipsConnect_, on a communicator the watcher aborted it raises at once.
  Phase enterInnerCall(int r) const {
    return abortedSkipsConnect_ && ranks_[r].groupFailed ? Phase::kStopped : Phase::kConnect;
  }

  bool awaits(int r, int call) const {
    switch (variant_) {
      case Variant::kNoAwait:
        return false;
      case Variant::kAwaitFirstCallOnly:
        return call == 0;
      case Variant::kExchangesOnly:
        if (callOf(r, call).connections != kExchange) {
          return false;
        }
        [[fallthrough]];
      default:
        for (const Direction& d : directionsOf(r, call)) {
          if (!ranks_[r].used.count(d)) {
            return true;
          }
        }
        return false;
    }
  }

  void callerMoves(int r, std::vector<std::function<void()>>& moves) {
    Rank& me = ranks_[r];
    const int call = static_cast<int>(me.pc);
    switch (me.phase) {
      case Phase::kPost:
        moves.push_back([this, r, call] {
          Rank& m = ranks_[r];
          if (m.groupFailed) {  // the group refuses later calls
            m.phase = Phase::kStopped;
            return;
          }
          const int post = postOf(r, call);
          m.posts.push_back(post);
          if (post == kRefusedPost) {  // it raises once every peer posted the number; the group is failed
            failGroup(r);
            m.phase = Phase::kStopped;
            return;
          }
          bool unlike = false;
          m.sawEveryPost = true;
          for (int q = 0; q < c_.ranks; ++q) {
            if (q != r && posted(q, call)) {
              unlike = unlike || ranks_[q].posts[call] != post;
            } else if (q != r) {
              m.sawEveryPost = false;
            }
          }
          if (unlike) {
            failGroup(r);
            m.phase = Phase::kStopped;
            return;
          }
          m.phase = awaits(r, call) ? Phase::kAwait : enterInnerCall(r);
        });
        break;
      case Phase::kAwait: {
        bool unlike = false;
        if (everyPeerPostedOrFailed(r, call, postOf(r, call), &unlike, variant_ == Variant::kAwaitPairPeersOnly)) {
          moves.push_back([this, r, unlike] {
            Rank& m = ranks_[r];
            if (unlike) {
              failGroup(r);
              m.phase = Phase::kStopped;
            } else {
              m.sawEveryPost = true;
              m.phase = enterInnerCall(r);
            }
          });
        }
        break;
      }
      case Phase::kConnect: {
        bool all = true;
        for (const Direction& d : directionsOf(r, call)) {
          if (me.connected.count(d)) {
            continue;
          }
          all = false;
          const int q = d.peer;
          const Rank& peer = ranks_[q];
          const Direction otherEnd{r, !d.send, d.connections};
          if (peer.phase == Phase::kConnect && !peer.connected.count(otherEnd) &&
              directionsOf(q, static_cast<int>(peer.pc)).count(otherEnd)) {
            moves.push_back([this, r, q, d, otherEnd] {
              ranks_[r].connected.insert(d);
              ranks_[q].connected.insert(otherEnd);
            });
          }
        }
        if (all) {
          moves.push_back([this, r, call] {
            Rank& m = ranks_[r];
            m.works.push_back({call, postOf(r, call)});
            for (const Direction& d : directionsOf(r, call)) {
              m.used.insert(d);
            }
            if (!m.sawEveryPost && variant_ != Variant::kNoWatcher) {
              m.watched.push_back(call);
            }
            if (m.groupFailed) {  // the watcher aborted meanwhile: the work is the communicator's, aborted
              m.works.back().aborted = true;
            }
            m.phase = ++m.pc == c_.calls.size() ? Phase::kDone : Phase::kPost;
          });
        }
        break;
      }
      default:
        break;
    }
  }

  void watcherMoves(int r, std::vector<std::function<void()>>& moves) {
    const Rank& me = ranks_[r];
    for (size_t k = 0; k < me.watched.size(); ++k) {
      const int call = me.watched[k];
      bool unlike = false;
      if (everyPeerPostedOrFailed(r, call, postOf(r, call), &unlike)) {
        moves.push_back([this, r, k, unlike] {
          Rank& m = ranks_[r];
          m.watched.erase(m.watched.begin() + static_cast<long>(k));
          if (unlike) {
            failGroup(r);
          }
        });
      }
    }
  }

  void gpuMoves(int r, std::vector<std::function<void()>>& moves) {
    const Rank& me = ranks_[r];
    for (size_t k = 0; k < me.works.size(); ++k) {
      const Work& w = me.works[k];
      if (w.complete || w.aborted) {
        continue;
      }
      bool met = true;
      for (const Direction& d : directionsOf(r, w.call)) {
        bool peerEnqueued = false;
        for (const Work& o : ranks_[d.peer].works) {
          peerEnqueued = peerEnqueued || (o.call == w.call && o.post == w.post);
        }
        met = met && peerEnqueued;
      }
      if (met) {
        moves.push_back([this, r, k] { ranks_[r].works[k].complete = true; });
      }
    }
  }

  std::string check() const {
    for (int r = 0; r < c_.ranks; ++r) {
      const Rank& me = ranks_[r];
      const std::string who = "rank " + std::to_string(r) + " at call " + std::to_string(me.pc);
      if (me.phase == Phase::kConnect) {
        return "hang in NCCL's connect: " + who;
      }
      if (me.phase == Phase::kAwait) {
        return "hang on the board: " + who;
      }
      for (const Work& w : me.works) {
        if (!w.complete && !w.aborted) {
          return "held stream: rank " + std::to_string(r) + "'s call " + std::to_string(w.call);
        }
      }
      if (c_.fault == Case::Fault::kNone && (me.phase != Phase::kDone || me.groupFailed)) {
        return "not complete: " + who;
      }
      if (c_.fault != Case::Fault::kNone && !me.groupFailed) {
        return "fault not named: " + who + " ended without its group failing";
      }
    }
    return "";
  }

  const Case& c_;
  const Variant variant_;
  const bool abortedSkipsConnect_;
  Rng& rng_;
  std::vector<Rank> ranks_;
};

}  // namespace

int main(int argc, char** argv) {
  Variant variant = Variant::kDesign;
  bool abortedSkipsConnect = false;
  bool everyCase = false;
  bool usage = argc < 3;
  for (int a = 3; a < argc; ++a) {
    const bool designSoFar = variant == Variant::kDesign;
    if (designSoFar && strcmp(argv[a], "--no-await") == 0) {
      variant = Variant::kNoAwait;
    } else if (designSoFar && strcmp(argv[a], "--await-first-call-only") == 0) {
      variant = Variant::kAwaitFirstCallOnly;
    } else if (designSoFar && strcmp(argv[a], "--await-pair-peers-only") == 0) {
      variant = Variant::kAwaitPairPeersOnly;
    } else if (designSoFar && strcmp(argv[a], "--no-watcher") == 0) {
      variant = Variant::kNoWatcher;
    } else if (designSoFar && strcmp(argv[a], "--exchanges-only") == 0) {
      variant = Variant::kExchangesOnly;
    } else if (strcmp(argv[a], "--aborted-skips-connect") == 0) {
      abortedSkipsConnect = true;
    } else if (strcmp(argv[a], "--every-case") == 0) {
      everyCase = true;
    } else {
      usage = true;
    }
  }
  if (usage) {
    fprintf(stderr,
            "usage: %s SEED CASES [--no-await | --await-first-call-only | --await-pair-peers-only | --no-watcher | "
            "--exchanges-only] [--aborted-skips-connect] [--every-case]\n",
            argv[0]);
    return 2;
  }
  const uint64_t seed = strtoull(argv[1], nullptr, 10);
  return model::reportCases(seed, atoi(argv[2]), variant == Variant::kDesign, everyCase,
                            [&](int i) -> std::optional<model::CaseFailure> {
                              Rng rng(seed * 1000003u + static_cast<uint64_t>(i));
                              const Case c = makeCase(rng);
                              const std::string f = Simulation(c, variant, abortedSkipsConnect, rng).run();
                              if (f.empty()) {
                                return std::nullopt;
                              }
                              return model::CaseFailure{f.substr(0, f.find(':')), "(" + describe(c) + "): " + f};
                            });
}
