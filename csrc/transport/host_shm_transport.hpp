// Transport over POSIX shared memory for CPU tensors on one host. Each member creates one segment (flags, then
// staging) exclusively, owner-only, under an unguessable name; every member maps every segment once per group,
// and all names are unlinked as soon as everyone has mapped them, so nothing is left in /dev/shm even if every
// process is later killed.
//
// The schedule's operations are recorded, not run: the host runner's worker thread executes a collective's
// operations in order, the way a GPU stream runs them, so the calling thread never does the copies itself.
//
// In a group that spans nodes (docs/multinode.md) a transport spans one node: its members are that node's ranks,
// and setGroup() tells it who they are in the group, for its messages and for noticing that a rank of another node
// on the same host (a pseudo-node of tests) has gone.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <c10/core/ScalarType.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/arrival_mailbox.hpp"
#include "transport/peer_rendezvous.hpp"
#include "transport/transport.hpp"

namespace sdma {

class HostShmTransport : public Transport, public DirectTransport {
 public:
  // Work of another kind that runs in its place among the transport's operations, on the worker (the hierarchical
  // schedule's gathers between nodes). It throws to fail the collective.
  using Task = std::function<void(std::chrono::steady_clock::time_point deadline, const std::string& description)>;
  // Work that waits, in its place among the operations, as a wait does: it returns false while it cannot finish yet
  // (it runs again later) and true once done, and throws to fail the collective.
  using PollTask = std::function<bool(std::chrono::steady_clock::time_point deadline, const std::string& description)>;

  struct Op {
    enum class Kind { Copy, Signal, Wait, Reset, CopyToPeer, CopyFromPeer, RunTask, CompareSizes, Poll } kind;
    char* dst;
    const char* src;
    size_t bytes;
    Flag flag;
    int slot;
    uint32_t value;
    int peer = -1;        // Signal/Wait of one peer, or the peer whose memory a CopyTo/FromPeer touches
    uint64_t remote = 0;  // CopyToPeer/CopyFromPeer: the address in that peer's process
    std::shared_ptr<const Task> task = nullptr;      // RunTask
    std::shared_ptr<const PollTask> poll = nullptr;  // Poll
  };

  // Collective: "" when all members run on this host, else why not (the same answer on every member).
  // `members` receives every member's identity.
  static std::string checkSameHost(c10d::Store& store, const std::string& key, int rank, int size,
                                   std::vector<MemberIdentity>* members = nullptr);
  // Collective over the group. Returns null, with the reason in *whyNot, when the members are not all on this
  // host or shared memory cannot be had; all members then agree on that.
  // `direct`: also set up the direct path (an arrival mailbox, and copies straight between the members' memory
  // with process_vm_readv/writev) when every member can reach every other's memory; all members agree.
  static std::unique_ptr<HostShmTransport> connect(c10d::Store& store, int rank, int size,
                                                   const StagingGeometry& geometry, bool direct, std::string* whyNot);
  ~HostShmTransport() override;

  int rank() const override {
    return rank_;
  }
  const StagingGeometry& geometry() const override {
    return geometry_;
  }
  char* localSegment(int slot, int srcRank) override;
  char* packSegment(int slot) override;
  void copyLocal(Lane lane, void* dst, const void* src, size_t bytes) override;
  void pushChunkToPeers(Lane lane, int slot, const void* src, size_t bytes, size_t at) override;
  void pushChunkToPeer(Lane lane, int peer, int slot, const void* src, size_t bytes, size_t at) override;
  void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void resetOwnFlags(Lane lane, Flag flag, int slot) override;
  DirectTransport* direct() override {
    return mailbox_ ? this : nullptr;
  }

  void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) override;
  void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) override;
  void signalPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override;
  void waitPeer(Lane lane, int peer, Flag flag, int slot, uint32_t value) override;
  void joinLane(Lane /*into*/, Lane /*from*/) override {}  // one worker runs both lanes in order

  // Null unless the direct path was set up; then shared by all members (it lives in rank 0's segment).
  ArrivalMailbox* mailbox() {
    return mailbox_.get();
  }
  // Why the direct path is off ("" when it is on, or was not asked for).
  const std::string& directUnavailable() const {
    return directUnavailable_;
  }

  // Member `member`'s process id, for a task that waits on it to notice that it exited.
  int pidOf(int member) const {
    return pids_[member];
  }
  // Records `task` to run in its place among the operations.
  void recordTask(Task task);
  // Records `task` to be polled in its place among the operations until it is done.
  void recordPollTask(PollTask task);
  // Records, as the collective's first operation, a comparison of what every member passed: this rank's bytes per
  // rank and dtype go to every peer, and the collective fails on every member, naming each one's size, unless all
  // are equal. Nothing has been copied when it fails, so no member returns wrong bytes.
  void recordSizeCheck(size_t bytesPerRank, c10::ScalarType dtype);
  // The transport spans one node of a larger group: `groupRankOf[member]` is each member's group rank, `group` every
  // group member's identity. Messages then name group ranks, and a wait also gives up once a group member on this host
  // has exited (it may be what the awaited peer waits for, through the inner backend).
  void setGroup(std::vector<int> groupRankOf, std::vector<MemberIdentity> group);

  // The operations recorded since the last call.
  std::vector<Op> takeRecorded();
  // Says why a collective cannot complete ("" while it may): checked by every wait every few milliseconds.
  using StopCheck = std::function<std::string()>;
  // Runs operations in order on the calling thread. A wait gives up, throwing an error that names the peers
  // it was waiting for, at `deadline` or as soon as one of those peers' processes is gone; or, naming `stop`'s
  // reason, once `stop` gives one (a peer posted another call on the group's call board).
  void execute(const std::vector<Op>& ops, std::chrono::steady_clock::time_point deadline,
               const std::string& description, const StopCheck& stop = {});
  // Where a sequence of operations stands between polls.
  struct Progress {
    size_t next = 0;                                       // the first operation not run yet
    std::chrono::steady_clock::time_point waitingSince{};  // since when the operation at `next` waits
    std::chrono::steady_clock::time_point nextCheck{};     // when that wait next checks its peers and the deadline
  };
  // Runs operations from `progress.next` on, in order, on the calling thread, until one has to wait: returns false
  // there (the next call goes on from it) and true once every operation ran. A wait gives up as execute's does, the
  // checks made every few milliseconds across calls; so one thread can run several sequences, none holding another.
  bool poll(const std::vector<Op>& ops, Progress& progress, std::chrono::steady_clock::time_point deadline,
            const std::string& description, const StopCheck& stop = {});

 private:
  HostShmTransport(int rank, int size, const StagingGeometry& geometry, bool direct);
  void copyWithPeer(const Op& op, const std::string& description);
  // One member's announcement of a collective's size, in each peer's segment. Two rows per member, by the serial's
  // parity: a member announces collective n+1 only once it finished n, which needs every peer past its comparison
  // for n, so it can run at most one collective ahead of the slowest peer's comparison.
  struct SizeAnnouncement {
    uint64_t bytes;
    uint32_t dtype;
    uint32_t serial;  // written last (release): 0 until the first announcement
  };
  SizeAnnouncement* announcement(int owner, int src, uint32_t serial) const;
  void compareSizes(const Op& op, std::chrono::steady_clock::time_point deadline, const std::string& description,
                    const StopCheck& stop);
  uint32_t* flagWord(int owner, Flag flag, int src, int slot) const;
  void waitFor(const Op& op, std::chrono::steady_clock::time_point deadline, const std::string& description,
               const StopCheck& stop);
  // The members a Wait still waits for.
  std::vector<int> pendingOf(const Op& op) const;
  // Throws where a wait that began at `start` must give up (`stop`, a member's exit, the deadline).
  void checkWaiting(const std::vector<int>& pending, std::chrono::steady_clock::time_point start,
                    std::chrono::steady_clock::time_point now, std::chrono::steady_clock::time_point deadline,
                    const std::string& description, const StopCheck& stop);
  // Runs one operation that never waits.
  void runNonWaiting(const Op& op, std::chrono::steady_clock::time_point deadline, const std::string& description,
                     const StopCheck& stop);
  static void stopIf(const StopCheck& stop, const std::string& description);

  const int rank_;
  const int size_;
  const StagingGeometry geometry_;
  size_t flagBytes_ = 0;  // flags, then the mailbox (if direct): where staging starts
  size_t flagWordBytes_ = 0;
  size_t segmentBytes_ = 0;
  size_t announcementsAt_ = 0;  // where the size announcements start in a segment
  uint32_t sizeSerial_ = 0;     // collectives whose sizes this rank announced
  std::vector<char*> base_;     // every member's segment, mapped here; base_[rank_] is our own
  std::vector<int> pids_;
  std::vector<Op> recorded_;
  std::vector<int> groupRankOf_;       // member -> group rank (the identity unless setGroup)
  std::vector<MemberIdentity> group_;  // empty unless setGroup
  int groupRank_ = 0;
  std::unique_ptr<ArrivalMailbox> mailbox_;
  std::string directUnavailable_;
};

}  // namespace sdma
