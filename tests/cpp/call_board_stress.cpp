// Stress test of csrc/transport/call_board.hpp with real processes, each rank a fork() over one shared mapping.
//
// Mismatch trials: W ranks post CALLS calls with random delays (now and then one falls far behind, so that small ring
// depths make ranks reuse posts and wait); the calls differ from one sequence number to the next (a collective, a
// route, a size), and at one sequence number chosen per trial one rank posts another call: another collective,
// another route, or another size (0 bytes every third trial). Now and then a rank waits for every peer's post after
// its own, as a call that connects memory does. The parent checks the rules the board's users rely on:
// - before that call no rank ever found another call;
// - at it at least one rank did (that rank refuses the call, so no rank can complete it), in the same words whichever
//   rank found it (of more than two ranks, each names its pair with the odd one);
// - every rank that found nothing there finds the other call afterwards, as its watcher does (differing()), also a
//   rank whose wait at that call the refuser's failure mark stopped;
// - a rank that goes on posting past it while the refusing rank stopped is stopped by the refuser's failure mark once
//   the ring makes it wait, long before the timeout.
// Agreeing run (MISMATCH=0): every rank posts every call while a second thread per rank reads the peers' recent
// posts the way a watcher does, racing their reuse; neither may ever report another call. The same thread asks
// whether a peer reached a sequence number (reached(), what a watchdog names peers by): yes for every number the peer
// had posted, also once the ring reused its post, and never for one past the number it was posting.
// Usage: call_board_stress W TRIALS CALLS DEPTH SEED MISMATCH; prints "... ok" and exits 0 on success.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <thread>

#include "forked_ranks.hpp"
#include "transport/call_board.hpp"

using sdma::CallBoard;
using sdma::CallOp;
using sdma::CallPost;

namespace {

// What every rank calls at sequence number s when all agree.
CallPost callAt(uint64_t s) {
  CallPost p;
  switch (s % 4) {
    case 0:
      p.op = CallOp::kAllreduce;
      p.route = CallPost::kInnerCuda;
      break;
    case 1:
      p.op = CallOp::kAllgather;
      p.route = CallPost::kDmaCuda;
      p.bytes = 4096 + (s * 2654435761u) % 100000;
      break;
    default:
      p.op = CallOp::kAllgatherIntoTensor;
      p.route = (s % 4) == 2 ? CallPost::kDmaCpu : CallPost::kDmaCuda;
      p.bytes = 4096 + (s * 2654435761u) % 100000;
      break;
  }
  return p;
}

// The odd rank's call at the mismatch, by the trial: another collective, another route, another size.
CallPost otherCall(uint64_t s, unsigned seed) {
  CallPost p = callAt(s);
  switch (seed % 3) {
    case 0:
      p.op = p.op == CallOp::kBroadcast ? CallOp::kAllreduce : CallOp::kBroadcast;
      break;
    case 1:
      p.route = p.route == CallPost::kInnerCpu ? CallPost::kDmaCpu : CallPost::kInnerCpu;
      break;
    default:
      p.op = CallOp::kAllgatherIntoTensor;
      p.route = CallPost::kDmaCuda;
      p.bytes = (seed / 3) % 2 ? 0 : callAt(s).bytes + 8;
      if (callAt(s).op != p.op || callAt(s).route != p.route) {
        p.bytes = 0;
      }
      break;
  }
  return p;
}

// What rank r did at a sequence number, as the parent reads it.
enum Outcome : unsigned char { kNotReached = 0, kAgreed = 1, kFoundOther = 2, kWatchdogFound = 3, kWatchdogMissed = 4 };

void randomDelay(std::mt19937& rng) {
  const int d = std::uniform_int_distribution<int>(0, 40)(rng);
  if (d > 38) {
    usleep(300);  // fall far behind now and then
  } else {
    for (volatile int i = 0; i < d * 40; ++i) {
    }
  }
}

constexpr size_t kWordsBytes = 512;

// One trial; returns false (having said why) when a rule broke. `refusers[k]` counts trials refused by k ranks.
bool mismatchTrial(int W, int calls, int depth, unsigned seed, int* refusers) {
  std::mt19937 pick(seed);
  const uint64_t bad = std::uniform_int_distribution<uint64_t>(1, uint64_t(calls))(pick);
  const int badRank = std::uniform_int_distribution<int>(0, W - 1)(pick);
  const size_t boardBytes = CallBoard::bytesFor(W, depth);
  const size_t outcomeBytes = size_t(W) * (calls + 1);
  const size_t wordsBytes = size_t(W) * kWordsBytes;
  const size_t total = boardBytes + outcomeBytes + wordsBytes + size_t(W);
  void* mem = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  memset(mem, 0, total);
  auto* outcome = static_cast<unsigned char*>(mem) + boardBytes;  // outcome[rank * (calls + 1) + seq]
  auto* words = reinterpret_cast<char*>(outcome + outcomeBytes);  // what each rank found, in the board's words
  auto* stoppedInTime = reinterpret_cast<unsigned char*>(words + wordsBytes);
  for (int r = 0; r < W; ++r) {
    if (fork() == 0) {
      CallBoard board(mem, r, W, depth, {}, "g");
      std::mt19937 rng(seed * 131 + r);
      for (uint64_t s = 1; s <= bad; ++s) {
        randomDelay(rng);
        const CallPost mine = s == bad && r == badRank ? otherCall(s, seed) : callAt(s);
        // Now and then a call connects memory, and its rank waits for every peer's post (as staging that grows).
        const bool connects = std::uniform_int_distribution<int>(0, 4)(rng) == 0;
        CallBoard::Differing found;
        try {
          found = board.post(s, mine, std::chrono::milliseconds(20000));
          if (!found && connects) {
            found = board.awaitPeers(s, mine, std::chrono::milliseconds(20000));
          }
        } catch (const CallBoard::Stopped& e) {
          if (s != bad) {
            fprintf(stderr, "seed %u: rank %d stopped at seq %llu, before the mismatch: %s\n", seed, r,
                    static_cast<unsigned long long>(s), e.what());
            _exit(3);
          }
          // A rank that refused the mismatch failed it while this one still waited there (for the ring, or for a
          // slower peer's post): this rank found nothing at the call and looks on, as its watcher does.
        }
        unsigned char& o = outcome[r * (calls + 1) + s];
        if (found) {
          o = kFoundOther;
          snprintf(words + r * kWordsBytes, kWordsBytes, "%s", board.describe(s, mine, found).c_str());
          board.fail(s, "refused");
          _exit(0);  // refuses: posts nothing more
        }
        if (s < bad) {
          o = kAgreed;
          continue;
        }
        // Enqueued: the watcher looks for a peer that posted another call.
        o = kWatchdogMissed;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (o == kWatchdogMissed && std::chrono::steady_clock::now() < until) {
          if (const auto d = board.differing(s, mine)) {
            o = kWatchdogFound;
            snprintf(words + r * kWordsBytes, kWordsBytes, "%s", board.describe(s, mine, d).c_str());
          }
        }
      }
      // Goes on as if it had not noticed: the ring brings it to wait for the refusing rank, whose failure mark stops
      // it (the timeout is far away).
      const auto start = std::chrono::steady_clock::now();
      try {
        for (uint64_t s = bad + 1; s <= bad + 2 * uint64_t(depth) + 1; ++s) {
          board.post(s, callAt(s), std::chrono::milliseconds(20000));
        }
      } catch (const CallBoard::Stopped&) {
        stoppedInTime[r] = std::chrono::steady_clock::now() - start < std::chrono::seconds(2);
      }
      _exit(0);
    }
  }
  bool ok = forkedRanksSucceeded(W);
  int refused = 0;
  for (int r = 0; r < W && ok; ++r) {
    for (uint64_t s = 1; s < bad; ++s) {
      if (outcome[r * (calls + 1) + s] != kAgreed) {
        fprintf(stderr, "seed %u: rank %d at seq %llu (before the mismatch at %llu): outcome %d\n", seed, r,
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(bad), outcome[r * (calls + 1) + s]);
        ok = false;
      }
    }
    const unsigned char o = outcome[r * (calls + 1) + bad];
    refused += o == kFoundOther;
    if (o != kFoundOther && o != kWatchdogFound) {
      fprintf(stderr, "seed %u: rank %d at the mismatch (seq %llu): outcome %d\n", seed, r,
              static_cast<unsigned long long>(bad), o);
      ok = false;
    } else if (W == 2 ? strcmp(words + r * kWordsBytes, words) != 0
                      : strstr(words + r * kWordsBytes, (" rank " + std::to_string(badRank)).c_str()) == nullptr) {
      // Two ranks say the same words; of more, each names its own pair with the odd rank.
      fprintf(stderr, "seed %u: rank %d says \"%s\", rank 0 \"%s\" (odd rank %d)\n", seed, r, words + r * kWordsBytes,
              words, badRank);
      ok = false;
    } else if (o == kWatchdogFound && !stoppedInTime[r]) {
      fprintf(stderr, "seed %u: rank %d was not stopped by the refusing rank's failure mark\n", seed, r);
      ok = false;
    }
  }
  if (ok && refused == 0) {
    fprintf(stderr, "seed %u: no rank refused the differing call at seq %llu\n", seed,
            static_cast<unsigned long long>(bad));
    ok = false;
  }
  if (ok) {
    ++refusers[refused];
  }
  munmap(mem, total);
  return ok;
}

bool agreeingRun(int W, int calls, int depth, unsigned seed) {
  const size_t boardBytes = CallBoard::bytesFor(W, depth);
  void* mem = mmap(nullptr, boardBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  memset(mem, 0, boardBytes);
  // Each rank's last posted sequence number, beside the board, for the reached() checks.
  auto* postedOf = static_cast<std::atomic<uint64_t>*>(
      mmap(nullptr, sizeof(std::atomic<uint64_t>) * W, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (postedOf == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  for (int q = 0; q < W; ++q) {
    new (&postedOf[q]) std::atomic<uint64_t>(0);
  }
  for (int r = 0; r < W; ++r) {
    if (fork() == 0) {
      CallBoard board(mem, r, W, depth);
      std::atomic<uint64_t>& posted = postedOf[r];
      std::atomic<bool> done{false};
      std::atomic<uint64_t> falseMismatches{0};
      std::atomic<uint64_t> wrongReached{0};
      // The watcher's reads race the peers' reuse of their posts: a torn read must count as gone, never as a call.
      std::thread watcher([&] {
        std::mt19937 rng(seed * 7 + r);
        while (!done.load()) {
          const uint64_t upTo = posted.load();
          if (upTo == 0) {
            continue;
          }
          const uint64_t s = upTo - std::min<uint64_t>(upTo - 1, rng() % (2 * uint64_t(depth)));
          if (board.differing(s, callAt(s))) {
            falseMismatches.fetch_add(1);
          }
          const int q = static_cast<int>(rng() % W);
          if (q == r) {
            continue;
          }
          const uint64_t before = postedOf[q].load();
          const uint64_t asked = 1 + rng() % (before + 3);
          const bool reached = board.reached(q, asked);
          // A peer that posted `asked` reached it; one still posting before() + 1 may show it, but never a later one.
          if ((asked <= before && !reached) || (reached && asked > postedOf[q].load() + 1)) {
            wrongReached.fetch_add(1);
          }
        }
      });
      std::mt19937 rng(seed * 131 + r);
      bool ok = true;
      for (uint64_t s = 1; s <= uint64_t(calls); ++s) {
        randomDelay(rng);
        const bool connects = std::uniform_int_distribution<int>(0, 4)(rng) == 0;
        CallBoard::Differing found = board.post(s, callAt(s), std::chrono::milliseconds(20000));
        if (!found && connects) {
          found = board.awaitPeers(s, callAt(s), std::chrono::milliseconds(20000));
        }
        if (found) {
          fprintf(stderr, "rank %d: seq %llu found another call where all agree\n", r,
                  static_cast<unsigned long long>(s));
          ok = false;
          break;
        }
        posted.store(s);
      }
      done.store(true);
      watcher.join();
      if (falseMismatches.load() != 0) {
        fprintf(stderr, "rank %d: the watcher's reads found another call %llu times where all agree\n", r,
                static_cast<unsigned long long>(falseMismatches.load()));
        ok = false;
      }
      if (wrongReached.load() != 0) {
        fprintf(stderr, "rank %d: reached() answered wrongly %llu times\n", r,
                static_cast<unsigned long long>(wrongReached.load()));
        ok = false;
      }
      _exit(ok ? 0 : 1);
    }
  }
  const bool ok = forkedRanksSucceeded(W);
  munmap(postedOf, sizeof(std::atomic<uint64_t>) * W);
  munmap(mem, boardBytes);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s W TRIALS CALLS DEPTH SEED MISMATCH\n", argv[0]);
    return 2;
  }
  const int W = atoi(argv[1]);
  const int trials = atoi(argv[2]);
  const int calls = atoi(argv[3]);
  const int depth = atoi(argv[4]);
  const unsigned seed = static_cast<unsigned>(atoi(argv[5]));
  const bool mismatch = atoi(argv[6]) != 0;
  if (!mismatch) {
    if (!agreeingRun(W, calls, depth, seed)) {
      return 1;
    }
    printf("agreeing calls=%d depth=%d ok\n", calls, depth);
    return 0;
  }
  int refusers[65] = {};
  for (int t = 0; t < trials; ++t) {
    if (!mismatchTrial(W, calls, depth, seed * 1000 + t, refusers)) {
      return 1;
    }
  }
  printf("trials=%d", trials);
  for (int k = 1; k <= W; ++k) {
    printf(" refused_by_%d=%d", k, refusers[k]);
  }
  printf(" ok\n");
  return 0;
}
