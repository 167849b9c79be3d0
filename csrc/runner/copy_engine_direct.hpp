// What the copy-engine runner keeps for the direct path (docs/design.md, "Direct"): the Arrived and Done flags
// (a copy-engine transport of their own, apart from staging), the arrival mailbox in host memory the members share,
// the export of this rank's buffers, the mappings of the peers', the log through which each rank retires the
// allocations it freed (so that peers unmap them), and the bounce area that stands in for a buffer peers cannot map.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective/allgather_plan.hpp"
#include "collective/direct_allgather.hpp"
#include "collective/exchange_plan.hpp"
#include "runner/collective_runner.hpp"
#include "runner/size_mismatch.hpp"
#include "transport/arrival_mailbox.hpp"
#include "transport/copy_engine_transport.hpp"
#include "transport/group_region.hpp"
#include "transport/peer_segments.hpp"
#include "transport/retired_segments.hpp"

namespace sdma {

// A rank waits for late peers at most as long as the wait saves: the later rank of a pair moving both
// directions copies bytesPerRank once more per peer on its own GPU, at about this rate (H200 over NVLink: 390 GB/s).
// So a 1 GiB all-gather of two ranks waits up to 1.3 ms, one of 16 MiB 21 us, capped by the knob.
constexpr size_t kCopyEngineBytesPerUs = 400000;

class CopyEngineDirect {
 public:
  // Collective: every member calls it at the same all-gather (the group's first on the direct path), with the same
  // options. `options.peerWait`: the longest an all-gather waits at enqueue for peers that have not posted, so that
  // each pushes its own bytes (arrival_mailbox.hpp): for a peer late at the previous all-gather; for the others no
  // longer than the copy the wait saves (kCopyEngineBytesPerUs).
  CopyEngineDirect(const c10::intrusive_ptr<c10d::Store>& groupStore, int rank, int size, int device,
                   const std::vector<MemberIdentity>& members, const DirectPathOptions& options);
  ~CopyEngineDirect();

  // One all-gather's part of the direct schedule, decided at enqueue (waiting at most the peer wait).
  struct Arrival {
    uint64_t serial = 0;  // the mailbox's; the flags carry its low 32 bits
    PostedBuffers posted;
    std::vector<PeerBuffers> peers;  // how each pair is shared, and the peer buffers this rank copies with, mapped here
    std::vector<PairRanges> ranges;  // an exchange: what each peer posted about its pair with this rank
    // The transport it runs on, the mappings and the bounce area the copies use: kept until the collective is done.
    std::shared_ptr<CopyEngineTransport> transport;
    std::vector<std::shared_ptr<void>> holds;
  };
  // Posts this rank's buffers for the next direct all-gather (bouncing those peers cannot map), settles each pair
  // and maps the peer buffers this rank will copy with. Waits longer than the peer wait only when a peer's CPU is a
  // mailbox's depth behind; past `timeout` that throws. A peer that posted another size for the same serial makes it
  // throw too, naming both sizes, after this rank's post is out (so that the peer's watchdog sees the mismatch).
  Arrival arrive(const AllgatherPlan& plan, std::chrono::milliseconds timeout);
  // The same for an exchange (collective/exchange_plan.hpp), in the same serials: its regions posted (bounced where
  // packed or not mappable), its ranges posted per peer. A peer whose ranges disagree with this rank's makes it throw
  // RangeMismatch, after this rank's post is out.
  Arrival arriveExchange(const ExchangePlan& plan, std::chrono::milliseconds timeout);
  // A point-to-point op this rank refused on its own arguments: its serial, posted with kRefusedPost and the
  // `directions` it would have moved, no buffers (a peer that reads it throws PeerRefusedPost from arriveExchange).
  void arriveRefused(uint64_t directions, std::chrono::milliseconds timeout);
  // The directions of group rank q's refused post for `serial` (kRefusedPost), if that is what it posted: for the
  // watchdog of a rank that did not wait for q at arriveExchange.
  std::optional<uint64_t> peerRefused(int q, uint64_t serial) const {
    const auto bytes = mailbox_->peerPostedBytes(q, serial);
    if (!bytes || (*bytes & kRefusedPost) == 0) {
      return std::nullopt;
    }
    return *bytes & ~kRefusedPost;
  }
  // Whether arriveExchange() can serve this group (its mailbox carries ranges).
  bool exchanges() const {
    return mailbox_->carriesRanges();
  }

  // What the peers posted for `serial`, for the watchdog: whether group rank q has reached it on its CPU, and, if it
  // posted another size than `bytesPerRank`, that size.
  bool peerReached(int q, uint64_t serial) const {
    return mailbox_->peerReached(q, serial);
  }
  std::optional<uint64_t> peerPostedOtherSize(int q, uint64_t serial, uint64_t bytesPerRank) const {
    return mailbox_->peerPostedOtherSize(q, serial, bytesPerRank);
  }
  // The Arrived and Done flags, and the serial of the last direct all-gather enqueued: what a failed group's release
  // writes (docs/design.md, "Failures").
  const std::shared_ptr<CopyEngineTransport>& flags() const {
    return transport_;
  }
  uint64_t lastSerial() const {
    return serial_;
  }
  // Whether this rank's post for `serial` would find its ring slot free at once (every peer read the post `depth`
  // serials before): a caller that must not wait for a peer posts only then.
  bool roomFor(uint64_t serial) const {
    return mailbox_->roomFor(serial);
  }
  // Device memory held outside the caching allocator: the bounce area.
  size_t heldBytes() const;
  ArrivalMailbox::PairTally pairs() const {
    return mailbox_->tally();
  }
  // The peers' memory mapped here: bounded by what they hold, as they report their frees.
  size_t peerMappedBytes() const {
    return peerSegments_.mappedBytes();
  }

 private:
  std::chrono::microseconds peerWaitFor(size_t bytesPerRank) const;
  // Posts `post` (and `ranges`) for the next serial and settles every pair; the serial goes into `a`.
  std::vector<ArrivalMailbox::PeerArrival> post(Arrival& a, const BufferPost& post, size_t peerWaitBytes,
                                                std::chrono::milliseconds timeout,
                                                const std::vector<PairRanges>* ranges = nullptr);
  // The bounce area, at least `bytes` large (a larger one replaces it; collectives in flight hold the old one).
  const std::shared_ptr<BounceArea>& bounceOf(size_t bytes);
  // Tells the peers which allocations this rank exported to them it has freed since its last all-gather.
  void retireFreedAllocations();
  // Drops the mappings of what the peers retired.
  void forgetPeersFreedAllocations();

  const c10::intrusive_ptr<c10d::Store> store_;
  const int rank_;
  const int size_;
  const int device_;
  const std::vector<MemberIdentity> members_;
  const DirectPathOptions options_;
  // Arrived and Done (slot 0 of a one-page staging that nothing else uses), connected with the group's first direct
  // all-gather.
  std::shared_ptr<CopyEngineTransport> transport_;
  GroupRegion mailboxRegion_;
  std::unique_ptr<ArrivalMailbox> mailbox_;
  GroupRegion retiredRegion_;
  std::unique_ptr<RetiredSegmentLog> retired_;
  SegmentExporter exporter_;
  PeerSegmentMap peerSegments_;
  std::shared_ptr<BounceArea> bounce_;
  uint64_t serial_ = 0;
};

}  // namespace sdma
