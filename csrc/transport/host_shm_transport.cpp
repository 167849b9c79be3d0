#include "transport/host_shm_transport.hpp"

#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "collective/rank_list.hpp"
#include "transport/host_shared_memory.hpp"
#include "transport/idle_backoff.hpp"

namespace sdma {
namespace {

// Collectives a rank's CPU may run ahead of a peer's before it waits for it (the arrival mailbox's ring).
constexpr int kMailboxDepth = 1024;

// "" when this process can read every peer's memory with process_vm_readv (ptrace rules permitting), else why not.
// Each member reads a word the others published the address of and checks it holds that member's pid.
std::string probePeerMemoryAccess(c10d::Store& store, int rank, int size, const std::vector<int>& pids) {
  const uint64_t mine = static_cast<uint64_t>(getpid());
  const auto addrs =
      exchangeWithGroup(store, "shm/cma", rank, size, std::to_string(reinterpret_cast<uintptr_t>(&mine)));
  std::string problem;
  for (int q = 0; q < size && problem.empty(); ++q) {
    if (q == rank) {
      continue;
    }
    uint64_t got = 0;
    iovec local{&got, sizeof(got)};
    iovec remote{reinterpret_cast<void*>(std::stoull(addrs[q])), sizeof(got)};
    const ssize_t n = process_vm_readv(pids[q], &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof(got)) || got != static_cast<uint64_t>(pids[q])) {
      problem = std::string("process_vm_readv of group rank ") + std::to_string(q) +
                " failed: " + (n < 0 ? strerror(errno) : "wrong bytes") +
                " (ptrace rules, e.g. kernel.yama.ptrace_scope)";
    }
  }
  // Every member keeps `mine` alive until all have read it: agreeing is the last collective step.
  return agreeOnPath(store, "shm/cma/verdict", rank, size, problem);
}

}  // namespace

std::string HostShmTransport::checkSameHost(c10d::Store& store, const std::string& key, int rank, int size,
                                            std::vector<MemberIdentity>* members) {
  const auto all = exchangeIdentities(store, key + "/info", rank, size, "");
  if (members) {
    *members = all;
  }
  return agreeOnPath(store, key + "/verdict", rank, size, memberOnAnotherHost(all, rank));
}

std::unique_ptr<HostShmTransport> HostShmTransport::connect(c10d::Store& store, int rank, int size,
                                                            const StagingGeometry& geometry, bool direct,
                                                            std::string* whyNot) {
  std::vector<MemberIdentity> members;
  std::string reason = checkSameHost(store, "shm/connect", rank, size, &members);
  if (!reason.empty()) {
    *whyNot = reason;
    return nullptr;
  }

  const std::vector<int> pids = pidsOf(members);
  std::string directUnavailable;
  if (direct) {
    directUnavailable = probePeerMemoryAccess(store, rank, size, pids);
    direct = directUnavailable.empty();
  }
  std::unique_ptr<HostShmTransport> t(new HostShmTransport(rank, size, geometry, direct));
  t->pids_ = pids;
  t->directUnavailable_ = directUnavailable;
  const std::string myName = randomSegmentName();
  std::string error;
  t->base_[rank] = mapSegment(myName, t->segmentBytes_, /*create=*/true, &error);
  reason = agreeOnPath(store, "shm/created", rank, size, error);
  if (!reason.empty()) {
    if (t->base_[rank]) {
      shm_unlink(myName.c_str());
    }
    *whyNot = reason;
    return nullptr;  // the destructor unmaps what was mapped
  }
  std::vector<std::string> names;
  try {
    names = exchangeWithGroup(store, "shm/name", rank, size, myName);
  } catch (...) {
    shm_unlink(myName.c_str());  // a peer that never came must not leave our segment in /dev/shm
    throw;
  }
  for (int q = 0; q < size && error.empty(); ++q) {
    if (q != rank) {
      t->base_[q] = mapSegment(names[q], t->segmentBytes_, /*create=*/false, &error);
    }
  }
  reason = agreeOnPath(store, "shm/mapped", rank, size, error);
  // Everyone has now mapped everything (or given up): no name is needed any more. Every member unlinks every
  // name, so a creator that dies right here still leaves nothing behind.
  for (const auto& name : names) {
    shm_unlink(name.c_str());
  }
  if (!reason.empty()) {
    *whyNot = reason;
    return nullptr;
  }
  if (direct) {
    // Rank 0's segment was created zeroed (ftruncate), so the mailbox starts empty.
    t->mailbox_ = std::make_unique<ArrivalMailbox>(t->base_[0] + t->flagWordBytes_, rank, size, kMailboxDepth,
                                                   size <= kMaxExchangeRanks);
  }
  return t;
}

HostShmTransport::HostShmTransport(int rank, int size, const StagingGeometry& geometry, bool direct)
    : rank_(rank), size_(size), geometry_(geometry), base_(size, nullptr), pids_(size, 0), groupRankOf_(size) {
  for (int q = 0; q < size; ++q) {
    groupRankOf_[q] = q;
  }
  groupRank_ = rank;
  const size_t words = kFlagKinds * static_cast<size_t>(size) * geometry.slots;
  flagWordBytes_ = roundUp(words * sizeof(uint32_t), kPageBytes);
  announcementsAt_ =
      flagWordBytes_ +
      (direct ? roundUp(ArrivalMailbox::bytesFor(size, kMailboxDepth, size <= kMaxExchangeRanks), kPageBytes) : 0);
  flagBytes_ = announcementsAt_ + roundUp(2 * static_cast<size_t>(size) * sizeof(SizeAnnouncement), kPageBytes);
  segmentBytes_ = flagBytes_ + geometry.bytes();
}

HostShmTransport::~HostShmTransport() {
  for (char* p : base_) {
    if (p) {
      munmap(p, segmentBytes_);
    }
  }
}

uint32_t* HostShmTransport::flagWord(int owner, Flag flag, int src, int slot) const {
  const size_t index = (static_cast<size_t>(flag) * size_ + src) * geometry_.slots + slot;
  return reinterpret_cast<uint32_t*>(base_[owner]) + index;
}

char* HostShmTransport::localSegment(int slot, int srcRank) {
  return base_[rank_] + flagBytes_ + geometry_.segmentOffset(slot, srcRank, rank_);
}

char* HostShmTransport::packSegment(int slot) {
  return base_[rank_] + flagBytes_ + geometry_.packSegmentOffset(slot);
}

void HostShmTransport::copyLocal(Lane, void* dst, const void* src, size_t bytes) {
  recorded_.push_back(
      {Op::Kind::Copy, static_cast<char*>(dst), static_cast<const char*>(src), bytes, Flag::Ready, 0, 0});
}

void HostShmTransport::pushChunkToPeers(Lane, int slot, const void* src, size_t bytes, size_t at) {
  for (int k = 1; k < size_; ++k) {
    const int peer = (rank_ + k) % size_;
    char* dst = base_[peer] + flagBytes_ + geometry_.segmentOffset(slot, rank_, peer) + at;
    recorded_.push_back({Op::Kind::Copy, dst, static_cast<const char*>(src), bytes, Flag::Ready, 0, 0});
  }
}

void HostShmTransport::pushChunkToPeer(Lane, int peer, int slot, const void* src, size_t bytes, size_t at) {
  char* dst = base_[peer] + flagBytes_ + geometry_.segmentOffset(slot, rank_, peer) + at;
  recorded_.push_back({Op::Kind::Copy, dst, static_cast<const char*>(src), bytes, Flag::Ready, 0, 0});
}

void HostShmTransport::signalPeers(Lane, Flag flag, int slot, uint32_t value) {
  recorded_.push_back({Op::Kind::Signal, nullptr, nullptr, 0, flag, slot, value});
}

void HostShmTransport::waitPeers(Lane, Flag flag, int slot, uint32_t value) {
  recorded_.push_back({Op::Kind::Wait, nullptr, nullptr, 0, flag, slot, value});
}

void HostShmTransport::resetOwnFlags(Lane, Flag flag, int slot) {
  recorded_.push_back({Op::Kind::Reset, nullptr, nullptr, 0, flag, slot, 0});
}

void HostShmTransport::copyToPeer(Lane, int peer, uint64_t peerDst, const void* src, size_t bytes) {
  recorded_.push_back(
      {Op::Kind::CopyToPeer, nullptr, static_cast<const char*>(src), bytes, Flag::Ready, 0, 0, peer, peerDst});
}

void HostShmTransport::copyFromPeer(Lane, int peer, void* dst, uint64_t peerSrc, size_t bytes) {
  recorded_.push_back(
      {Op::Kind::CopyFromPeer, static_cast<char*>(dst), nullptr, bytes, Flag::Ready, 0, 0, peer, peerSrc});
}

void HostShmTransport::signalPeer(Lane, int peer, Flag flag, int slot, uint32_t value) {
  recorded_.push_back({Op::Kind::Signal, nullptr, nullptr, 0, flag, slot, value, peer});
}

void HostShmTransport::waitPeer(Lane, int peer, Flag flag, int slot, uint32_t value) {
  recorded_.push_back({Op::Kind::Wait, nullptr, nullptr, 0, flag, slot, value, peer});
}

void HostShmTransport::copyWithPeer(const Op& op, const std::string& description) {
  // process_vm_* may move fewer bytes than asked (it stops at a page it cannot access); go on from there.
  size_t done = 0;
  while (done < op.bytes) {
    const size_t left = op.bytes - done;
    ssize_t n;
    if (op.kind == Op::Kind::CopyToPeer) {
      iovec local{const_cast<char*>(op.src) + done, left};
      iovec remote{reinterpret_cast<void*>(op.remote + done), left};
      n = process_vm_writev(pids_[op.peer], &local, 1, &remote, 1, 0);
    } else {
      iovec local{op.dst + done, left};
      iovec remote{reinterpret_cast<void*>(op.remote + done), left};
      n = process_vm_readv(pids_[op.peer], &local, 1, &remote, 1, 0);
    }
    TORCH_CHECK_WITH(DistBackendError, n > 0, "torch_sdma: ", description, " failed: copying ",
                     op.kind == Op::Kind::CopyToPeer ? "to" : "from", " group rank ", groupRankOf_[op.peer], " (pid ",
                     pids_[op.peer], "): ", n < 0 ? strerror(errno) : "no progress");
    done += static_cast<size_t>(n);
  }
}

void HostShmTransport::recordTask(Task task) {
  recorded_.push_back({Op::Kind::RunTask, nullptr, nullptr, 0, Flag::Ready, 0, 0, -1, 0,
                       std::make_shared<const Task>(std::move(task))});
}

void HostShmTransport::recordPollTask(PollTask task) {
  Op op{Op::Kind::Poll, nullptr, nullptr, 0, Flag::Ready, 0, 0};
  op.poll = std::make_shared<const PollTask>(std::move(task));
  recorded_.push_back(std::move(op));
}

void HostShmTransport::recordSizeCheck(size_t bytesPerRank, c10::ScalarType dtype) {
  // The op carries the serial in `value` and the dtype in `slot`.
  recorded_.push_back(
      {Op::Kind::CompareSizes, nullptr, nullptr, bytesPerRank, Flag::Ready, static_cast<int>(dtype), ++sizeSerial_});
}

HostShmTransport::SizeAnnouncement* HostShmTransport::announcement(int owner, int src, uint32_t serial) const {
  return reinterpret_cast<SizeAnnouncement*>(base_[owner] + announcementsAt_) + 2 * src + serial % 2;
}

void HostShmTransport::stopIf(const StopCheck& stop, const std::string& description) {
  if (stop) {
    const std::string why = stop();
    TORCH_CHECK_WITH(DistBackendError, why.empty(), "torch_sdma: ", description, " failed: ", why);
  }
}

void HostShmTransport::compareSizes(const Op& op, std::chrono::steady_clock::time_point deadline,
                                    const std::string& description, const StopCheck& stop) {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) {
      SizeAnnouncement* a = announcement(q, rank_, op.value);
      a->bytes = op.bytes;
      a->dtype = static_cast<uint32_t>(op.slot);
      __atomic_store_n(&a->serial, op.value, __ATOMIC_RELEASE);
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto nextStopCheck = start + std::chrono::milliseconds(10);
  for (int q = 0; q < size_; ++q) {
    while (q != rank_ && __atomic_load_n(&announcement(rank_, q, op.value)->serial, __ATOMIC_ACQUIRE) != op.value) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= nextStopCheck) {
        nextStopCheck = now + std::chrono::milliseconds(10);
        stopIf(stop, description);
      }
      if (!processAlive(pids_[q])) {
        stopIf(stop, description);  // a peer that refused the call and exited: its reason first
        TORCH_CHECK_WITH(DistBackendError, false, "torch_sdma: ", description, " failed: group rank ", groupRankOf_[q],
                         " (pid ", pids_[q], ") exited while this rank was waiting for it");
      }
      TORCH_CHECK_WITH(DistBackendError, now < deadline, "torch_sdma: ", description, " timed out after ",
                       std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count(),
                       " ms waiting for group ranks [", groupRankOf_[q], "], which never reached it");
      std::this_thread::sleep_for(std::chrono::microseconds(now - start < std::chrono::milliseconds(2) ? 0 : 50));
    }
  }
  bool differ = false;
  std::string sizes;
  for (int q = 0; q < size_; ++q) {
    const uint64_t bytes = q == rank_ ? op.bytes : announcement(rank_, q, op.value)->bytes;
    const auto dtype = static_cast<c10::ScalarType>(q == rank_ ? op.slot : announcement(rank_, q, op.value)->dtype);
    differ = differ || bytes != op.bytes || dtype != static_cast<c10::ScalarType>(op.slot);
    sizes += (sizes.empty() ? "" : ", ") + std::string("group rank ") + std::to_string(groupRankOf_[q]) + " " +
             std::to_string(bytes) + " bytes of " + c10::toString(dtype);
  }
  TORCH_CHECK_WITH(DistBackendError, !differ, "torch_sdma: ", description,
                   " failed: the ranks passed inputs of different sizes or dtypes (bytes per rank: ", sizes,
                   "); every rank must pass an input of the same size and dtype, and nothing was copied");
}

void HostShmTransport::setGroup(std::vector<int> groupRankOf, std::vector<MemberIdentity> group) {
  groupRankOf_ = std::move(groupRankOf);
  group_ = std::move(group);
  groupRank_ = groupRankOf_[rank_];
}

std::vector<HostShmTransport::Op> HostShmTransport::takeRecorded() {
  std::vector<Op> out;
  out.swap(recorded_);
  return out;
}

void HostShmTransport::runNonWaiting(const Op& op, std::chrono::steady_clock::time_point deadline,
                                     const std::string& description, const StopCheck& stop) {
  switch (op.kind) {
    case Op::Kind::Copy:
      memcpy(op.dst, op.src, op.bytes);
      break;
    case Op::Kind::Signal:
      // Release: the peer that sees the new value also sees every byte copied before it.
      for (int k = 1; k < size_; ++k) {
        const int peer = (rank_ + k) % size_;
        if (op.peer < 0 || op.peer == peer) {
          __atomic_store_n(flagWord(peer, op.flag, rank_, op.slot), op.value, __ATOMIC_RELEASE);
        }
      }
      break;
    case Op::Kind::Reset:
      for (int q = 0; q < size_; ++q) {
        if (q != rank_) {
          __atomic_store_n(flagWord(rank_, op.flag, q, op.slot), 0u, __ATOMIC_RELEASE);
        }
      }
      break;
    case Op::Kind::CopyToPeer:
    case Op::Kind::CopyFromPeer:
      copyWithPeer(op, description);
      break;
    case Op::Kind::RunTask:
      (*op.task)(deadline, description);
      break;
    case Op::Kind::CompareSizes:
      compareSizes(op, deadline, description, stop);
      break;
    case Op::Kind::Wait:
    case Op::Kind::Poll:
      break;
  }
}

void HostShmTransport::execute(const std::vector<Op>& ops, std::chrono::steady_clock::time_point deadline,
                               const std::string& description, const StopCheck& stop) {
  for (const Op& op : ops) {
    if (op.kind == Op::Kind::Wait) {
      waitFor(op, deadline, description, stop);
    } else if (op.kind == Op::Kind::Poll) {
      const auto start = std::chrono::steady_clock::now();
      while (!(*op.poll)(deadline, description)) {
        idleBackoff(std::chrono::steady_clock::now() - start);
      }
    } else {
      runNonWaiting(op, deadline, description, stop);
    }
  }
}

bool HostShmTransport::poll(const std::vector<Op>& ops, Progress& progress,
                            std::chrono::steady_clock::time_point deadline, const std::string& description,
                            const StopCheck& stop) {
  for (; progress.next < ops.size(); ++progress.next) {
    const Op& op = ops[progress.next];
    if (op.kind == Op::Kind::Poll) {
      if (!(*op.poll)(deadline, description)) {
        return false;
      }
    } else if (op.kind == Op::Kind::Wait) {
      const std::vector<int> pending = pendingOf(op);
      if (!pending.empty()) {
        const auto now = std::chrono::steady_clock::now();
        if (progress.waitingSince == std::chrono::steady_clock::time_point{}) {
          progress.waitingSince = now;
          progress.nextCheck = now + std::chrono::milliseconds(10);
        } else if (now >= progress.nextCheck) {
          progress.nextCheck = now + std::chrono::milliseconds(10);
          checkWaiting(pending, progress.waitingSince, now, deadline, description, stop);
        }
        return false;
      }
    } else {
      runNonWaiting(op, deadline, description, stop);
    }
    progress.waitingSince = {};
  }
  return true;
}

std::vector<int> HostShmTransport::pendingOf(const Op& op) const {
  std::vector<int> pending;
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && (op.peer < 0 || op.peer == q) &&
        !flagReached(__atomic_load_n(flagWord(rank_, op.flag, q, op.slot), __ATOMIC_ACQUIRE), op.value)) {
      pending.push_back(q);
    }
  }
  return pending;
}

void HostShmTransport::checkWaiting(const std::vector<int>& pending, std::chrono::steady_clock::time_point start,
                                    std::chrono::steady_clock::time_point now,
                                    std::chrono::steady_clock::time_point deadline, const std::string& description,
                                    const StopCheck& stop) {
  stopIf(stop, description);
  // Only for the messages below, which name the group ranks still pending.
  auto pendingRanks = [&] {
    std::vector<int> ranks;
    for (int q : pending) {
      ranks.push_back(groupRankOf_[q]);
    }
    return rankList(ranks);
  };
  // The whole group's exits first: a peer that failed because another rank died exits soon after, and naming
  // only that peer would hide the rank that died first.
  if (!group_.empty()) {
    const std::string exited = exitedMembersOnThisHost(group_, groupRank_);
    TORCH_CHECK_WITH(DistBackendError, exited.empty(), "torch_sdma: ", description, " failed: ", exited,
                     " exited while this rank was waiting for group ranks ", pendingRanks(), " of its node");
  }
  for (int q : pending) {
    if (!processAlive(pids_[q])) {
      TORCH_CHECK_WITH(DistBackendError, false, "torch_sdma: ", description, " failed: group rank ", groupRankOf_[q],
                       " (pid ", pids_[q], ") exited while this rank was waiting for it");
    }
  }
  if (now >= deadline) {
    TORCH_CHECK_WITH(DistBackendError, false, "torch_sdma: ", description, " timed out after ",
                     std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count(),
                     " ms waiting for group ranks ", pendingRanks(), ", which never reached it");
  }
}

void HostShmTransport::waitFor(const Op& op, std::chrono::steady_clock::time_point deadline,
                               const std::string& description, const StopCheck& stop) {
  const auto start = std::chrono::steady_clock::now();
  auto nextLivenessCheck = start + std::chrono::milliseconds(10);
  for (uint64_t spin = 0;; ++spin) {
    const std::vector<int> pending = pendingOf(op);
    if (pending.empty()) {
      return;
    }
    if (spin < 256) {
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= nextLivenessCheck) {
      nextLivenessCheck = now + std::chrono::milliseconds(10);
      checkWaiting(pending, start, now, deadline, description, stop);
    }
    idleBackoff(now - start);
  }
}

}  // namespace sdma
