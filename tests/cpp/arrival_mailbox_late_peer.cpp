// The late-peer wait of csrc/transport/arrival_mailbox.hpp, with two real processes and delays far from every
// limit (a short wait of 20 ms, a long one of 1 s, rank 1 arriving 200 ms late where it is late):
//   serial 1: rank 1 late -> rank 0 stops after the short wait: settled late;
//   serial 2: rank 1 late again -> rank 0 waits the long wait for it, each pushes its own bytes;
//   serial 3: rank 1 late -> a short wait again (it was on time at serial 2): settled late;
//   serial 4: rank 1 2.5 s late -> the long wait runs out: settled late;
//   serial 5: (both start together) rank 1 late -> a short wait only, after a long one in vain: settled late;
//   serial 6: (both start together) -> each pushes its own bytes;
//   serial 7: rank 1 late -> a short wait again: settled late.
// Usage: arrival_mailbox_late_peer; prints the pairings rank 0 settled and "ok", exits 0 on success.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "forked_ranks.hpp"
#include "transport/arrival_mailbox.hpp"

using sdma::ArrivalMailbox;
using sdma::BufferPost;
using sdma::Pairing;

namespace {

constexpr int kSerials = 7;
// Rank 1's delay before each serial, in ms (index 0 unused).
constexpr int kLateMs[kSerials + 1] = {0, 200, 200, 200, 2500, 200, 0, 200};
// Serials before which both ranks meet first (on a spin barrier in the shared mapping).
constexpr bool kMeetFirst[kSerials + 1] = {false, true, false, false, false, true, true, false};
// What rank 0 must settle with rank 1 at each serial.
constexpr Pairing kWant[kSerials + 1] = {Pairing::kPeerCameLate,  Pairing::kPeerCameLate, Pairing::kEachPushesOwn,
                                         Pairing::kPeerCameLate,  Pairing::kPeerCameLate, Pairing::kPeerCameLate,
                                         Pairing::kEachPushesOwn, Pairing::kPeerCameLate};

BufferPost postOf(int rank, uint64_t serial) {
  return {uint64_t(rank) << 40 | serial, (uint64_t(rank) << 40 | serial) + 7, 64};
}

}  // namespace

int main() {
  const size_t boxBytes = ArrivalMailbox::bytesFor(2, 4);
  const size_t meetBytes = sizeof(std::atomic<int>) * (kSerials + 1);
  const size_t seenBytes = 2 * (kSerials + 1);
  // The box, then one meeting counter per serial, then what each rank settled per serial.
  void* mem =
      mmap(nullptr, boxBytes + meetBytes + seenBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) {
    perror("mmap");
    return 2;
  }
  memset(mem, 0, boxBytes + meetBytes + seenBytes);
  auto* meet = reinterpret_cast<std::atomic<int>*>(static_cast<char*>(mem) + boxBytes);
  auto* seen = static_cast<unsigned char*>(mem) + boxBytes + meetBytes;  // seen[rank * (kSerials + 1) + serial]

  for (int r = 0; r < 2; ++r) {
    if (fork() == 0) {
      ArrivalMailbox box(mem, r, 2, 4);
      for (uint64_t s = 1; s <= kSerials; ++s) {
        if (kMeetFirst[s]) {
          meet[s].fetch_add(1);
          while (meet[s].load() < 2) {
          }
        }
        if (r == 1 && kLateMs[s] > 0) {
          usleep(kLateMs[s] * 1000);
        }
        auto got = box.arrive(s, postOf(r, s), std::chrono::milliseconds(20000), std::chrono::milliseconds(20),
                              std::chrono::milliseconds(1000));
        seen[r * (kSerials + 1) + s] = 1 + static_cast<unsigned char>(got[1 - r].pairing);
      }
      _exit(0);
    }
  }
  if (!forkedRanksSucceeded(2)) {
    return 1;
  }
  for (int s = 1; s <= kSerials; ++s) {
    const auto mine = static_cast<Pairing>(seen[s] - 1);
    const auto theirs = static_cast<Pairing>(seen[kSerials + 1 + s] - 1);
    printf("serial %d: rank 0 %d, rank 1 %d\n", s, int(mine), int(theirs));
    const bool agree = (mine == Pairing::kEachPushesOwn) == (theirs == Pairing::kEachPushesOwn);
    if (mine != kWant[s] || !agree) {
      fprintf(stderr, "serial %d: rank 0 settled %d (want %d), rank 1 %d\n", s, int(mine), int(kWant[s]), int(theirs));
      return 1;
    }
  }
  printf("ok\n");
  return 0;
}
