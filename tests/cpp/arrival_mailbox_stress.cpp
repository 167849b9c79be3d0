// Stress test of csrc/transport/arrival_mailbox.hpp with real processes: W ranks run M collectives each with random
// delays over one shared mapping, each waiting a random while (none, or up to 60 us) for late peers, and the parent
// checks the rule the direct all-gather relies on: for every pair and serial the two ranks settled the same
// sharing (each pushes its own bytes, or exactly one of them came late), and every post a rank uses carried the
// addresses its owner posted for that serial. A small ring depth makes ranks overwrite slots and wait for peers.
// Usage: arrival_mailbox_stress W M DEPTH SEED; prints "pairs=... each_own=... ok" and exits 0 on success.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "forked_ranks.hpp"
#include "transport/arrival_mailbox.hpp"

using sdma::ArrivalMailbox;
using sdma::BufferPost;
using sdma::Pairing;

static BufferPost postOf(int rank, uint64_t serial) {
  return {uint64_t(rank) << 40 | serial, (uint64_t(rank) << 40 | serial) + 7, serial * 3 + rank};
}

int main(int argc, char** argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s W M DEPTH SEED\n", argv[0]);
    return 2;
  }
  const int W = atoi(argv[1]);
  const int M = atoi(argv[2]);
  const int depth = atoi(argv[3]);
  const unsigned seed = static_cast<unsigned>(atoi(argv[4]));
  const size_t boxBytes = ArrivalMailbox::bytesFor(W, depth);
  const size_t seenBytes = size_t(W) * W * (M + 1);
  void* mem = mmap(nullptr, boxBytes + seenBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return 2;
  }
  memset(mem, 0, boxBytes + seenBytes);
  auto* seen = static_cast<unsigned char*>(mem) + boxBytes;  // seen[(rank * W + peer) * (M + 1) + serial]

  for (int r = 0; r < W; ++r) {
    if (fork() == 0) {
      ArrivalMailbox box(mem, r, W, depth);
      std::mt19937 rng(seed * 131 + r);
      std::uniform_int_distribution<int> delay(0, 40);
      for (uint64_t s = 1; s <= uint64_t(M); ++s) {
        const int d = delay(rng);
        if (d > 37) {
          usleep(200);  // now and then fall far behind
        } else {
          for (volatile int i = 0; i < d * 50; ++i) {
          }
        }
        const auto wait = std::chrono::microseconds(delay(rng) < 20 ? 0 : 60);
        // Half the ranks wait longer for a peer that was late at the previous collective, as the direct path does.
        const auto lateWait = std::chrono::microseconds(r % 2 == 0 ? 300 : 0);
        auto got = box.arrive(s, postOf(r, s), std::chrono::milliseconds(20000), wait, lateWait);
        for (int q = 0; q < W; ++q) {
          if (q == r) {
            continue;
          }
          if (got[q].pairing != Pairing::kPeerCameLate) {
            const BufferPost want = postOf(q, s);
            if (got[q].post.input != want.input || got[q].post.output != want.output ||
                got[q].post.bytes != want.bytes) {
              fprintf(stderr, "rank %d serial %llu: peer %d's post is wrong\n", r, (unsigned long long)s, q);
              _exit(1);
            }
          }
          seen[(size_t(r) * W + q) * (M + 1) + s] = 1 + static_cast<unsigned char>(got[q].pairing);
        }
      }
      _exit(0);
    }
  }
  if (!forkedRanksSucceeded(W)) {
    return 1;
  }
  long pairs = 0, eachOwn = 0;
  const auto of = [](unsigned char v) { return static_cast<Pairing>(v - 1); };
  for (int i = 0; i < W; ++i) {
    for (int j = i + 1; j < W; ++j) {
      for (int s = 1; s <= M; ++s) {
        const Pairing ij = of(seen[(size_t(i) * W + j) * (M + 1) + s]);
        const Pairing ji = of(seen[(size_t(j) * W + i) * (M + 1) + s]);
        const bool agree = (ij == Pairing::kEachPushesOwn && ji == Pairing::kEachPushesOwn) ||
                           (ij == Pairing::kThisCameLate && ji == Pairing::kPeerCameLate) ||
                           (ij == Pairing::kPeerCameLate && ji == Pairing::kThisCameLate);
        if (!agree) {
          fprintf(stderr, "ranks %d and %d settled serial %d differently (%d / %d)\n", i, j, s, int(ij), int(ji));
          return 1;
        }
        ++pairs;
        eachOwn += ij == Pairing::kEachPushesOwn;
      }
    }
  }
  printf("pairs=%ld each_own=%ld ok\n", pairs, eachOwn);
  return 0;
}
