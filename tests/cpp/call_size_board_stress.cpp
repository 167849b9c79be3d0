// Stress test of csrc/transport/call_size_board.hpp with real processes, each rank a fork() over one shared mapping.
//
// Mismatch trials: W ranks post the sizes of CALLS all-gathers with random delays (now and then one falls far behind,
// so that small ring depths make ranks reuse posts and wait); every size differs from call to call, and at one call
// chosen per trial one rank posts another size; now and then a rank waits for every peer's post first, as a call that
// connects staging does. The parent checks the rules staging's size check relies on:
// - before that call no rank ever found another size;
// - at it at least one rank did (that rank refuses the call, so no rank can complete it);
// - every rank that found nothing there finds the other size afterwards, as its watchdog does (peerPostedOtherSize).
// Agreeing run (MISMATCH=0): every rank posts every call's size while a second thread per rank reads the peers'
// recent posts the way the watchdog does, racing their reuse; neither may ever report another size.
// Usage: call_size_board_stress W TRIALS CALLS DEPTH SEED MISMATCH; prints "... ok" and exits 0 on success.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "forked_ranks.hpp"
#include "transport/call_size_board.hpp"

using sdma::CallSizeBoard;

namespace {

uint64_t sizeOf(uint64_t serial) {
  return 4096 + (serial * 2654435761u) % 100000;
}

// What rank r did at a serial, as the parent reads it.
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

// One trial; returns false (having said why) when a rule broke. `refusedBy` counts trials by refusing ranks.
bool mismatchTrial(int W, int calls, int depth, unsigned seed, int* refusers) {
  std::mt19937 pick(seed);
  const uint64_t bad = std::uniform_int_distribution<uint64_t>(1, uint64_t(calls))(pick);
  const int badRank = std::uniform_int_distribution<int>(0, W - 1)(pick);
  const size_t boardBytes = CallSizeBoard::bytesFor(W, depth);
  const size_t outcomeBytes = size_t(W) * (calls + 1);
  void* mem = mmap(nullptr, boardBytes + outcomeBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  memset(mem, 0, boardBytes + outcomeBytes);
  auto* outcome = static_cast<unsigned char*>(mem) + boardBytes;  // outcome[rank * (calls + 1) + serial]
  for (int r = 0; r < W; ++r) {
    if (fork() == 0) {
      CallSizeBoard board(mem, r, W, depth);
      std::mt19937 rng(seed * 131 + r);
      for (uint64_t s = 1; s <= bad; ++s) {
        randomDelay(rng);
        // Every other trial the odd rank passes an empty input: 0 bytes is a size like any other.
        const uint64_t other = (seed & 1) ? 0 : sizeOf(s) + 8;
        const uint64_t mine = s == bad && r == badRank ? other : sizeOf(s);
        // Now and then a call connects memory, and its rank waits for every peer's post (as staging that grows).
        const bool connects = std::uniform_int_distribution<int>(0, 4)(rng) == 0;
        const auto found = board.post(s, mine, std::chrono::milliseconds(20000), connects);
        unsigned char& o = outcome[r * (calls + 1) + s];
        if (found.peer >= 0) {
          o = kFoundOther;
          break;  // refuses: the group fails here
        }
        if (s < bad) {
          o = kAgreed;
          continue;
        }
        // Enqueued: the watchdog looks for a peer that posted another size.
        o = kWatchdogMissed;
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
        while (o == kWatchdogMissed && std::chrono::steady_clock::now() < until) {
          for (int q = 0; q < W; ++q) {
            if (q != r && board.peerPostedOtherSize(q, s, mine)) {
              o = kWatchdogFound;
            }
          }
        }
      }
      _exit(0);
    }
  }
  bool ok = forkedRanksSucceeded(W);
  int refused = 0;
  for (int r = 0; r < W && ok; ++r) {
    for (uint64_t s = 1; s < bad; ++s) {
      if (outcome[r * (calls + 1) + s] != kAgreed) {
        fprintf(stderr, "seed %u: rank %d at serial %llu (before the mismatch at %llu): outcome %d\n", seed, r,
                static_cast<unsigned long long>(s), static_cast<unsigned long long>(bad), outcome[r * (calls + 1) + s]);
        ok = false;
      }
    }
    const unsigned char o = outcome[r * (calls + 1) + bad];
    refused += o == kFoundOther;
    if (o != kFoundOther && o != kWatchdogFound) {
      fprintf(stderr, "seed %u: rank %d at the mismatch (serial %llu): outcome %d\n", seed, r,
              static_cast<unsigned long long>(bad), o);
      ok = false;
    }
  }
  if (ok && refused == 0) {
    fprintf(stderr, "seed %u: no rank refused the mismatched call at serial %llu\n", seed,
            static_cast<unsigned long long>(bad));
    ok = false;
  }
  if (ok) {
    ++refusers[refused];
  }
  munmap(mem, boardBytes + outcomeBytes);
  return ok;
}

bool agreeingRun(int W, int calls, int depth, unsigned seed) {
  const size_t boardBytes = CallSizeBoard::bytesFor(W, depth);
  void* mem = mmap(nullptr, boardBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return false;
  }
  memset(mem, 0, boardBytes);
  for (int r = 0; r < W; ++r) {
    if (fork() == 0) {
      CallSizeBoard board(mem, r, W, depth);
      std::atomic<uint64_t> posted{0};
      std::atomic<bool> done{false};
      std::atomic<uint64_t> falseMismatches{0};
      // The watchdog's reads race the peers' reuse of their posts: a torn read must count as gone, never as a size.
      std::thread watchdog([&] {
        std::mt19937 rng(seed * 7 + r);
        while (!done.load()) {
          const uint64_t upTo = posted.load();
          if (upTo == 0) {
            continue;
          }
          const uint64_t s = upTo - std::min<uint64_t>(upTo - 1, rng() % (2 * uint64_t(depth)));
          for (int q = 0; q < W; ++q) {
            if (q != r && board.peerPostedOtherSize(q, s, sizeOf(s))) {
              falseMismatches.fetch_add(1);
            }
          }
        }
      });
      std::mt19937 rng(seed * 131 + r);
      bool ok = true;
      for (uint64_t s = 1; s <= uint64_t(calls); ++s) {
        randomDelay(rng);
        const bool connects = std::uniform_int_distribution<int>(0, 4)(rng) == 0;
        if (board.post(s, sizeOf(s), std::chrono::milliseconds(20000), connects).peer >= 0) {
          fprintf(stderr, "rank %d: serial %llu found another size where all agree\n", r,
                  static_cast<unsigned long long>(s));
          ok = false;
          break;
        }
        posted.store(s);
      }
      done.store(true);
      watchdog.join();
      if (falseMismatches.load() != 0) {
        fprintf(stderr, "rank %d: the watchdog's reads found another size %llu times where all agree\n", r,
                static_cast<unsigned long long>(falseMismatches.load()));
        ok = false;
      }
      _exit(ok ? 0 : 1);
    }
  }
  const bool ok = forkedRanksSucceeded(W);
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
