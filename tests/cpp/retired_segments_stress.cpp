// Stress test of how a rank's frees reach its peers (csrc/transport/freed_allocations.hpp, retired_segments.hpp).
// 1. The process-wide freed-allocation log: threads note frees while a reader reads; the reader sees each base
//    exactly once and in order, or is told that it lost some (and then reads on from the newest).
// 2. The retired-segment rings, with real processes over one shared mapping: every rank retires ids in bursts and
//    reads its peers' rings at random moments. A reader sees each peer's ids in order, none twice and none made up;
//    a gap comes only with readNew() returning false. Slow readers make owners lap their rings.
// Usage: retired_segments_stress W M SEED; prints "... ok" and exits 0 on success.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "transport/freed_allocations.hpp"
#include "transport/retired_segments.hpp"

using sdma::FreedAllocationReader;
using sdma::RetiredSegment;
using sdma::RetiredSegmentLog;

static int fail(const char* what, unsigned long long a, unsigned long long b) {
  fprintf(stderr, "FAIL: %s (%llu, %llu)\n", what, a, b);
  return 1;
}

// Bases noted by one thread, 1, 2, 3, ...: the reader checks order by value.
static int checkFreedLog(unsigned seed) {
  constexpr uint64_t kNotes = 200000;
  FreedAllocationReader reader;
  std::thread noter([] {
    for (uint64_t b = 1; b <= kNotes; ++b) {
      sdma::noteAllocationFreed(b);
      if (b % 1000 == 0) {
        std::this_thread::yield();
      }
    }
  });
  std::mt19937 rng(seed);
  uint64_t last = 0, losses = 0;
  std::vector<uint64_t> bases;
  while (last < kNotes) {
    bases.clear();
    const bool complete = reader.readNew(&bases);
    losses += complete ? 0 : 1;
    bool gapAllowed = !complete;
    for (uint64_t b : bases) {
      if (b <= last || (!gapAllowed && b != last + 1)) {
        noter.join();
        return fail("freed log out of order", last, b);
      }
      last = b;
      gapAllowed = false;
    }
    if (rng() % 4 == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 20000));
    }
  }
  noter.join();
  printf("freed log: %llu notes, %llu losses reported\n", (unsigned long long)kNotes, (unsigned long long)losses);
  return 0;
}

static int runRank(void* shared, std::atomic<int>* started, std::atomic<int>* finished, int rank, int W, int M,
                   unsigned seed) {
  RetiredSegmentLog log(shared, rank, W);
  // A reader sees what is retired after it joined: all join before any rank retires.
  started->fetch_add(1);
  while (started->load() < W) {
    std::this_thread::yield();
  }
  std::mt19937 rng(seed * 131 + rank);
  std::vector<uint64_t> last(W, 0);
  std::vector<bool> lost(W, false);  // a gap may follow a read that reported a loss
  std::vector<RetiredSegment> seen;
  uint64_t published = 0;
  auto readPeers = [&]() -> int {
    for (int q = 0; q < W; ++q) {
      if (q == rank) {
        continue;
      }
      seen.clear();
      lost[q] = lost[q] || !log.readNew(q, &seen);
      for (const auto& s : seen) {
        if (s.id <= last[q] || (!lost[q] && s.id != last[q] + 1) || s.kind != s.id % 3) {
          return fail("ring entry out of order or corrupt", last[q], s.id);
        }
        last[q] = s.id;
        lost[q] = false;
      }
    }
    return 0;
  };
  // A burst of up to twice a ring's length, so that readers who pause get lapped.
  while (published < static_cast<uint64_t>(M)) {
    const uint64_t burst = rng() % (2 * RetiredSegmentLog::kEntries);
    for (uint64_t i = 0; i < burst && published < static_cast<uint64_t>(M); ++i) {
      ++published;
      log.publish({static_cast<uint32_t>(published % 3), published});
    }
    if (int rc = readPeers()) {
      return rc;
    }
    if (rng() % 3 == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    }
  }
  // Read until every peer is done retiring, then once more: each peer's last id was seen, or a loss reported.
  finished->fetch_add(1);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (finished->load() < W) {
    if (int rc = readPeers()) {
      return rc;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return fail("peers never finished", rank, 0);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (int rc = readPeers()) {
    return rc;
  }
  for (int q = 0; q < W; ++q) {
    if (q != rank && last[q] != static_cast<uint64_t>(M) && !lost[q]) {
      return fail("a peer's last retirements neither seen nor reported lost", q, last[q]);
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: %s W M SEED\n", argv[0]);
    return 2;
  }
  const int W = atoi(argv[1]);
  const int M = atoi(argv[2]);
  const unsigned seed = static_cast<unsigned>(atoi(argv[3]));
  if (int rc = checkFreedLog(seed)) {
    return rc;
  }
  const size_t bytes = RetiredSegmentLog::bytesFor(W);
  void* mem =
      mmap(nullptr, bytes + 2 * sizeof(std::atomic<int>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return 2;
  }
  std::vector<pid_t> children;
  for (int r = 0; r < W; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      auto* counters = reinterpret_cast<std::atomic<int>*>(static_cast<char*>(mem) + bytes);
      _exit(runRank(mem, &counters[0], &counters[1], r, W, M, seed));
    }
    children.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failures) {
    fprintf(stderr, "%d rank(s) failed\n", failures);
    return 1;
  }
  printf("rings: %d ranks x %d retirements ok\n", W, M);
  return 0;
}
