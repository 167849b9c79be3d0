// Transport over POSIX shared memory for CPU tensors on one host. Each member creates one segment (flags, then
// staging) exclusively, owner-only, under an unguessable name; every member maps every segment once per group,
// and all names are unlinked as soon as everyone has mapped them, so nothing is left in /dev/shm even if every
// process is later killed.
//
// The schedule's operations are recorded, not run: the host runner's worker thread executes a collective's
// operations in order, the way a GPU stream runs them, so the calling thread never does the copies itself.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

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
  struct Op {
    enum class Kind { Copy, Signal, Wait, Reset, CopyToPeer, CopyFromPeer } kind;
    char* dst;
    const char* src;
    size_t bytes;
    Flag flag;
    int slot;
    uint32_t value;
    int peer = -1;        // Signal/Wait of one peer (slot 0), or the peer whose memory a CopyTo/FromPeer touches
    uint64_t remote = 0;  // CopyToPeer/CopyFromPeer: the address in that peer's process
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
  void signalPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void waitPeers(Lane lane, Flag flag, int slot, uint32_t value) override;
  void resetOwnFlags(Lane lane, Flag flag, int slot) override;
  DirectTransport* direct() override {
    return mailbox_ ? this : nullptr;
  }

  void copyToPeer(Lane lane, int peer, uint64_t peerDst, const void* src, size_t bytes) override;
  void copyFromPeer(Lane lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) override;
  void signalPeer(Lane lane, int peer, Flag flag, uint32_t value) override;
  void waitPeer(Lane lane, int peer, Flag flag, uint32_t value) override;

  // Null unless the direct path was set up; then shared by all members (it lives in rank 0's segment).
  ArrivalMailbox* mailbox() {
    return mailbox_.get();
  }
  // Why the direct path is off ("" when it is on, or was not asked for).
  const std::string& directUnavailable() const {
    return directUnavailable_;
  }

  // The operations recorded since the last call.
  std::vector<Op> takeRecorded();
  // Runs operations in order on the calling thread. A wait gives up, throwing an error that names the peers
  // it was waiting for, at `deadline` or as soon as one of those peers' processes is gone.
  void execute(const std::vector<Op>& ops, std::chrono::steady_clock::time_point deadline,
               const std::string& description);

 private:
  HostShmTransport(int rank, int size, const StagingGeometry& geometry, bool direct);
  void copyWithPeer(const Op& op, const std::string& description);
  uint32_t* flagWord(int owner, Flag flag, int src, int slot) const;
  void waitFor(const Op& op, std::chrono::steady_clock::time_point deadline, const std::string& description);

  const int rank_;
  const int size_;
  const StagingGeometry geometry_;
  size_t flagBytes_ = 0;  // flags, then the mailbox (if direct): where staging starts
  size_t flagWordBytes_ = 0;
  size_t segmentBytes_ = 0;
  std::vector<char*> base_;  // every member's segment, mapped here; base_[rank_] is our own
  std::vector<int> pids_;
  std::vector<Op> recorded_;
  std::unique_ptr<ArrivalMailbox> mailbox_;
  std::string directUnavailable_;
};

}  // namespace sdma
