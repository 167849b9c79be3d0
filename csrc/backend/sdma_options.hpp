// The group's options, as ProcessGroupNCCL::Options carries NCCL's: the TORCH_SDMA_* knobs (docs/api.md, read by
// torch_sdma/_config.py) plus what torch hands every backend (timeout, group name). Bound to Python as
// torch_sdma.ProcessGroupSDMA.Options, so a caller may also pass one as pg_options.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace sdma {

// Staging per rank and group. GPU: 256 MiB carries a 1 GiB all-gather in 128 MiB chunks on two ranks, where one
// copy-engine copy runs near its best (about 356 GB/s at 64 MiB against 390 at 512 MiB on H200). CPU: one worker
// copies serially, so a small area loses nothing.
constexpr int64_t kDefaultStagingBytesCuda = int64_t{256} << 20;
constexpr int64_t kDefaultStagingBytesCpu = int64_t{32} << 20;
// Below this many bytes a CUDA collective of a group on one node goes to NCCL. Automatic (-1) by default: none on two
// ranks, where the direct path beat every other all-gather in place from 64 KiB (docs/results/2xH200.md);
// kManyRanksMinBytesCuda from three, where each call's flags between every pair of ranks cost more than the copies
// gain below it (on four H200s 0.60-0.87x NCCL from 64 KiB to 16 MiB, 1.00x at 32 MiB: docs/results/4xH200.md).
// Point-to-point moves one pair's bytes whatever the group's size: automatic is none there.
constexpr int64_t kDefaultMinBytesCuda = -1;
constexpr int64_t kManyRanksMinBytesCuda = int64_t{32} << 20;
constexpr int64_t kDefaultMinBytesCpu = 0;
// The same for a group that spans nodes, whose small all-gathers would add a node-local step to NCCL's over the
// network: never measured across real hosts, so NCCL keeps them up to where the copy engines won on one node
// before small messages were tuned.
constexpr int64_t kDefaultMinBytesCudaAcrossNodes = int64_t{16} << 20;
// Two staging slots: the next chunk's push overlaps this one's drain.
constexpr int kDefaultSlots = 2;
// On the direct path a rank waits at most this long at enqueue for peers that have not posted yet, so that each rank
// of a pair pushes its own bytes (both GPUs' copy engines) instead of settling the pair late (the later one moving
// both directions on one GPU's engines, at half the rate: docs/results/2xH200.md); never longer than that would
// cost (CopyEngineDirect), except for a peer that was late at the previous all-gather, which it waits for this
// long once (ArrivalMailbox), so that the peer catches up. On 2x H200 a 100 us cap let 1 GiB in place fall back in
// one bench run of two (255.8 GB/s against 381.4).
constexpr int64_t kDefaultDirectPeerWaitUs = 2000;
// The streams a rank's pushes to its peers spread over on the direct path (CopyEngineTransport::bindLanes): one, the
// group's push stream, visiting the peers nearest first. More run different peers' copies at once, on as many copy
// engines, which the measurements in docs/results/4xH200.md found slower on four H200s.
constexpr int kDefaultPeerLanes = 1;
struct SdmaOptions {
  bool disable = false;                                 // TORCH_SDMA_DISABLE
  int64_t stagingBytesCuda = kDefaultStagingBytesCuda;  // TORCH_SDMA_STAGING_BYTES
  int64_t stagingBytesCpu = kDefaultStagingBytesCpu;
  int64_t minBytesCuda = kDefaultMinBytesCuda;  // TORCH_SDMA_MIN_BYTES
  int64_t minBytesCpu = kDefaultMinBytesCpu;
  int64_t minBytesCudaAcrossNodes = kDefaultMinBytesCudaAcrossNodes;  // TORCH_SDMA_MIN_BYTES_ACROSS_NODES
  int slots = kDefaultSlots;                                          // TORCH_SDMA_SLOTS, a power of two
  int64_t chunkBytes = 0;                                             // TORCH_SDMA_CHUNK_BYTES; 0: automatic
  // TORCH_SDMA_DIRECT: all_gather_into_tensor without staging. On by default for CUDA tensors, where it beats staging
  // at every size it takes, unless the caching allocator uses expandable segments (which peers cannot map: each
  // call would go through a bounce area as large as its output); off for CPU tensors, where one worker copies
  // either way and staging is faster.
  bool directCuda = true;
  bool directCpu = false;
  // TORCH_SDMA_DIRECT unset and this rank's caching allocator makes expandable segments: directCuda was turned off
  // here, not by the user. The members still agree on the knob (unset); the group agrees on staging when it connects.
  bool directCudaFromAllocator = false;
  int64_t directPeerWaitUs = kDefaultDirectPeerWaitUs;  // TORCH_SDMA_DIRECT_PEER_WAIT_US
  int peerLanes = kDefaultPeerLanes;                    // TORCH_SDMA_PEER_LANES: local, like the wait above
  // TORCH_SDMA_DELEGATE: exchange collectives sent to the inner backend at every size, a comma list of all_to_all
  // (both forms), broadcast, gather, scatter, send and recv (either one: both).
  std::string delegate;
  bool log = true;  // TORCH_SDMA_LOG: one line per group at creation (written by the Python side)
  // TORCH_SDMA_TEST_PSEUDO_NODES (tests only): the pseudo-node of its host this process is placed on, "" for none.
  // Processes on one host with different pseudo-nodes form different nodes of the hierarchical path.
  std::string testPseudoNode;

  std::chrono::milliseconds timeout{600000};
  std::string groupName;
  std::vector<int64_t> globalRanks;  // the group's members' global ranks, in group-rank order
};

}  // namespace sdma
