#include "runner/shared_memory_runner.hpp"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "collective/direct_allgather.hpp"
#include "collective/direct_exchange.hpp"
#include "collective/hierarchical_allgather.hpp"
#include "collective/staging_allgather.hpp"
#include "runner/kept_for_life.hpp"
#include "runner/size_mismatch.hpp"
#include "runner/test_dispatch.hpp"
#include "runner/test_faults.hpp"
#include "work/interpreter_exit.hpp"

namespace sdma {

namespace {

// CPU copies reach any address of a peer (process_vm_readv/writev), so a list form's pieces are posted where they
// are, as ranges from the lowest piece, rather than packed into a bounce area: no copy on either side and no fresh
// pages per call. `ranges` are offsets into the packed pieces; on success they become offsets from `*region`. A range
// that spans two pieces keeps the bounce area (false).
bool postPiecesInPlace(const std::vector<ByteSpan>& pieces, std::vector<ByteRange>& ranges, char** region) {
  char* base = nullptr;
  for (const ByteSpan& piece : pieces) {
    if (piece.bytes > 0 && (!base || piece.ptr < base)) {
      base = piece.ptr;
    }
  }
  if (!base) {
    return false;
  }
  std::vector<ByteRange> placed = ranges;
  for (ByteRange& range : placed) {
    if (range.bytes == 0) {
      range.offset = 0;
      continue;
    }
    uint64_t start = 0;
    bool found = false;
    for (const ByteSpan& piece : pieces) {
      if (range.offset >= start && range.offset + range.bytes <= start + piece.bytes) {
        range.offset = static_cast<uint64_t>(piece.ptr - base) + (range.offset - start);
        found = true;
        break;
      }
      start += piece.bytes;
    }
    if (!found) {
      return false;
    }
  }
  ranges = std::move(placed);
  *region = base;
  return true;
}

// An input piece that is also an output keeps the bounce area: peers would write it while others still read it.

}  // namespace

std::string sharedMemoryPathProblem(c10d::Store& store, int rank, int size) {
  return HostShmTransport::checkSameHost(store, "shm/create", rank, size);
}

std::unique_ptr<CollectiveRunner> connectSharedMemoryRunner(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                            int size, const StagingGeometry& geometry, bool direct,
                                                            const std::string& groupName, std::string* whyNot) {
  // The direct path is set up whatever `direct` says: the exchanges need it (all-gathers take it only if asked).
  auto transport = HostShmTransport::connect(*store, rank, size, geometry, /*direct=*/true, whyNot);
  if (!transport) {
    return nullptr;
  }
  if (direct && !transport->directUnavailable().empty()) {
    LOG(WARNING) << "torch_sdma: group '" << groupName << "' runs CPU all-gathers through staging, not "
                 << "directly: " << transport->directUnavailable();
  }
  return std::make_unique<SharedMemoryRunner>(std::move(transport), direct);
}

std::unique_ptr<CollectiveRunner> connectHierarchicalSharedMemoryRunner(
    const c10::intrusive_ptr<c10d::Store>& nodeStore, const StagingGeometry& nodeGeometry, HierarchicalSetup setup,
    std::string* whyNot) {
  const int L = setup.layout.ranksPerNode();
  auto transport = HostShmTransport::connect(*nodeStore, setup.localIndex(), L, nodeGeometry, /*direct=*/false, whyNot);
  if (!transport) {
    return nullptr;
  }
  transport->setGroup(setup.layout.node(setup.node()), setup.members);
  return std::make_unique<SharedMemoryRunner>(std::move(transport), std::move(setup));
}

SharedMemoryRunner::SharedMemoryRunner(std::unique_ptr<HostShmTransport> transport, bool allgatherDirect)
    : transport_(std::move(transport)),
      allgatherDirect_(allgatherDirect),
      order_(!testUnorderedRequested()),
      injectWorkerFault_(testFaultRequested("worker")),
      syncOnCaller_(testSyncOnCallerRequested()) {
  worker_ = GuardedThread([this] { workerLoop(); }, [this](const std::string& why) { abandonQueued(why); });
}

SharedMemoryRunner::SharedMemoryRunner(std::unique_ptr<HostShmTransport> transport, HierarchicalSetup setup)
    : transport_(std::move(transport)),
      rail_(std::make_unique<HostRailAllgather>(*transport_, std::move(setup), transport_->geometry().chunkBytes)),
      order_(!testUnorderedRequested()),
      injectWorkerFault_(testFaultRequested("worker")),
      syncOnCaller_(testSyncOnCallerRequested()) {
  worker_ = GuardedThread([this] { workerLoop(); }, [this](const std::string& why) { abandonQueued(why); });
}

SharedMemoryRunner::~SharedMemoryRunner() {
  worker_.stopAndJoin(mutex_, wake_, stop_);
  if (rail_) {
    std::unique_lock<std::mutex> lock(mutex_);
    const bool failed = failure_.happened();
    lock.unlock();
    rail_->setup().closeRail(failed);
  }
}

c10::intrusive_ptr<c10d::Work> SharedMemoryRunner::run(PlannedAllgather& planned, const CollectivePath& /*path*/,
                                                       bool asyncOp, const CollectiveInfo& info) {
  const AllgatherPlan& plan = planned.plan;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_.refuse(info);
  }
  transport_->recordSizeCheck(plan.bytesPerRank, planned.outputs.front().scalar_type());
  ArrivalMailbox* mailbox = transport_->mailbox();
  // By the form alone, the same on every member (an all-gather of no bytes never comes here: the backend settles it
  // on the call board).
  const bool direct = allgatherDirect_ && mailbox && plan.outputBase;
  if (direct) {
    const uint64_t serial = ++directSerial_;
    // One worker thread copies for this rank whichever way a pair is shared, so nobody waits for late peers, and
    // the later rank of a late pair moves both directions: landing would only add a copy (and the landing area
    // would be this transport's staging, whose flags the staging schedule counts on).
    const auto settled = mailbox->arrive(serial,
                                         {reinterpret_cast<uint64_t>(plan.input.front().ptr),
                                          reinterpret_cast<uint64_t>(plan.outputBase), plan.bytesPerRank},
                                         info.timeout);
    std::vector<PeerBuffers> peers(settled.size());
    for (size_t q = 0; q < settled.size(); ++q) {
      peers[q] = {settled[q].pairing, settled[q].post.input, settled[q].post.output};
    }
    scheduleDirectAllgather(*transport_, plan, static_cast<uint32_t>(serial), {plan.input.front().ptr, plan.outputBase},
                            peers);
  } else if (rail_) {
    scheduleHierarchicalAllgather(*transport_, *rail_, rail_->setup().layout, plan, chunks_);
  } else {
    scheduleStagingAllgather(*transport_, plan, chunks_);
  }
  return enqueue(c10::make_intrusive<HostWork>(info, std::move(planned.outputs), std::move(planned.keepAlive)), direct,
                 asyncOp, info);
}

c10::intrusive_ptr<c10d::Work> SharedMemoryRunner::enqueue(c10::intrusive_ptr<HostWork> work, bool postedBuffers,
                                                           bool asyncOp, const CollectiveInfo& info, bool exchange,
                                                           uint64_t mailboxSerial, std::vector<PairRanges> pairs) {
  std::unique_lock<std::mutex> lock(mutex_);
  Job job{transport_->takeRecorded(),
          work,
          order_.issue(),
          postedBuffers,
          info.board,
          info.seq,
          info.post,
          exchange,
          mailboxSerial,
          std::move(pairs)};
  if (syncOnCaller_ && !asyncOp) {
    runInTurn(job, lock);
    return work;
  }
  queue_.push_back(std::move(job));
  lock.unlock();
  wake_.notify_one();
  return work;
}

CollectivePath SharedMemoryRunner::pathFor(const PlannedExchange& /*planned*/) {
  if (rail_) {
    return CollectivePath::inner("the group spans nodes");
  }
  const ArrivalMailbox* mailbox = transport_->mailbox();
  if (!mailbox) {
    return CollectivePath::inner(transport_->directUnavailable());
  }
  if (!mailbox->carriesRanges()) {
    return CollectivePath::inner("a group of more than " + std::to_string(kMaxExchangeRanks) + " ranks");
  }
  return CollectivePath::dma(CollectivePath::kDirect);
}

c10::intrusive_ptr<c10d::Work> SharedMemoryRunner::run(PlannedExchange& planned, bool asyncOp,
                                                       const CollectiveInfo& info) {
  ExchangePlan& plan = planned.plan;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_.refuse(info);
  }
  // The list forms' pieces are posted where they are, or else packed into regions of their own; the work keeps both
  // (and keeps them for good if it fails).
  char* region = nullptr;
  if (plan.inputPacked() && !spansOverlap(plan.inputPieces, outputRegion(plan)) &&
      postPiecesInPlace(plan.inputPieces, plan.sendTo, &region)) {
    plan.input = region;
  }
  if (plan.outputPacked() && postPiecesInPlace(plan.outputPieces, plan.recvFrom, &region)) {
    plan.output = region;
  }
  PostedBuffers posted{plan.input, plan.output};
  if (plan.inputPacked()) {
    planned.keepAlive.push_back(at::empty({static_cast<int64_t>(plan.inputBytes)}, at::kByte));
    posted.input = static_cast<const char*>(planned.keepAlive.back().data_ptr());
  }
  if (plan.outputPacked()) {
    planned.keepAlive.push_back(at::empty({static_cast<int64_t>(plan.outputBytes)}, at::kByte));
    posted.outputBase = static_cast<char*>(planned.keepAlive.back().data_ptr());
  }
  const uint64_t serial = ++directSerial_;
  const std::vector<PairRanges> mine = pairRangesOf(plan);
  const auto settled = transport_->mailbox()->arrive(
      serial,
      {reinterpret_cast<uint64_t>(posted.input), reinterpret_cast<uint64_t>(posted.outputBase), plan.outputBytes},
      info.timeout, std::chrono::microseconds(0), std::chrono::microseconds(0), &mine);
  std::vector<ExchangePeer> peers(settled.size());
  for (size_t q = 0; q < settled.size(); ++q) {
    const ArrivalMailbox::PeerArrival& peer = settled[q];
    peers[q] = {{peer.pairing, peer.post.input, peer.post.output}, peer.ranges};
    const int p = static_cast<int>(q);
    if (p == transport_->rank() || peer.pairing == Pairing::kPeerCameLate) {
      continue;
    }
    const std::string differs = pairDisagreement(transport_->rank(), p, plan.sendTo[q].bytes, plan.recvFrom[q].bytes,
                                                 peer.ranges.sends.bytes, peer.ranges.expects.bytes);
    if (!differs.empty()) {
      // Posted: a peer that read the post may copy with these buffers until its own failure stops it.
      keepTensorsForLife(std::move(planned.keepAlive));
      const std::string reason = info.describe() + " failed: " + differs;
      if (info.board) {
        info.board->fail(info.seq, reason);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      failure_.record("torch_sdma: " + reason);
      C10_THROW_ERROR(DistBackendError, "torch_sdma: " + reason);
    }
  }
  scheduleDirectExchange(*transport_, plan, static_cast<uint32_t>(serial), posted, peers);
  return enqueue(c10::make_intrusive<HostWork>(info, std::move(planned.outputs), std::move(planned.keepAlive)),
                 /*postedBuffers=*/true, asyncOp, info, /*exchange=*/true, serial, mine);
}

std::string SharedMemoryRunner::pairDisagreementOf(const Job& job, int peer) const {
  BufferPost post;
  PairRanges theirs;
  // The peer's post stays until it posts `depth` exchanges more, which a failed peer never does.
  if (job.pairs.empty() || static_cast<size_t>(peer) >= job.pairs.size() ||
      !transport_->mailbox()->readPeerPost(peer, job.mailboxSerial, &post, &theirs)) {
    return "";
  }
  const PairRanges& mine = job.pairs[peer];
  return pairDisagreement(transport_->rank(), peer, mine.sends.bytes, mine.expects.bytes, theirs.sends.bytes,
                          theirs.expects.bytes);
}

void SharedMemoryRunner::runInTurn(Job& job, std::unique_lock<std::mutex>& lock) {
  order_.awaitTurn(lock, job.ticket, failure_);
  const std::string broken = failure_.reason();
  lock.unlock();
  std::exception_ptr error;
  if (!broken.empty()) {
    error = std::make_exception_ptr(C10_BUILD_ERROR(
        DistBackendError,
        "torch_sdma: " + job.work->description() + " not run: an earlier collective on this group failed: " + broken));
  } else {
    try {
      transport_->execute(job.ops, job.work->deadline(), job.work->description(), [this, &job] {
        if (!job.board) {
          return std::string();
        }
        const CallBoard::Differing d = job.board->differing(job.seq, job.post);
        if (d) {
          return job.board->describe(job.seq, job.post, d);
        }
        // A peer that failed an earlier call makes no further ones, and an exchange's peer that failed this one (it
        // found its pair disagreeing after this rank had read its post) never comes either; one that failed a later
        // call has enqueued this one. An all-gather whose peer failed this very call keeps waiting for what it waits
        // on, so that a peer that exited is named as such.
        const auto [peer, at] = job.board->failedPeer();
        if (peer < 0 || at > job.seq || (at == job.seq && !job.exchange)) {
          return std::string();
        }
        const std::string differs = at == job.seq ? pairDisagreementOf(job, peer) : "";
        return "group rank " + std::to_string(job.board->groupRankOf(peer)) +
               " failed its collective of sequence number " + std::to_string(at) +
               (differs.empty() ? "" : " because the pair's sizes differ: " + differs);
      });
    } catch (const std::exception& e) {
      error = std::current_exception();
      if (job.board) {
        std::string why = messageOf(e);
        job.board->fail(job.seq, why.rfind("torch_sdma: ", 0) == 0 ? why.substr(12) : why);
      }
      lock.lock();
      failure_.record(e.what());
      lock.unlock();
    }
  }
  if (error && job.postedBuffers) {
    // A late peer may still read and write these buffers by the addresses this rank posted (its copies wait only for
    // this rank's Arrived, which may be out): they are never given back (docs/design.md, "Failures").
    keepTensorsForLife(job.work->takeKeptTensors());
  }
  job.work->complete(error);
  lock.lock();
  order_.finish(job.ticket);
}

void SharedMemoryRunner::workerLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      return;  // stop_ with nothing left: every queued collective ran before the group goes away
    }
    Job job = std::move(queue_.front());
    queue_.pop_front();
    running_ = job.work;
    if (injectWorkerFault_) {
      throwTestFault("worker");
    }
    runInTurn(job, lock);
    running_.reset();
    // The last reference to the work may be this one: let go of it outside mutex_, and not once the interpreter
    // exits (its tensors may need the GIL).
    lock.unlock();
    InterpreterExit::drop(job.work);
    lock.lock();
  }
}

void SharedMemoryRunner::abandonQueued(const std::string& why) {
  std::vector<c10::intrusive_ptr<HostWork>> failed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_.record("its worker thread failed: " + why);
    if (running_) {
      failed.push_back(std::move(running_));
    }
    for (auto& job : queue_) {
      failed.push_back(std::move(job.work));
    }
    queue_.clear();
    order_.wakeAll();
  }
  LOG(ERROR) << "torch_sdma: a shared-memory all-gather worker failed: " << why << "; " << failed.size()
             << " all-gathers fail with it and the group runs no more";
  for (auto& work : failed) {
    work->complete(std::make_exception_ptr(C10_BUILD_ERROR(
        DistBackendError, "torch_sdma: " + work->description() + " failed: the group's worker thread failed: " + why)));
  }
  InterpreterExit::drop(failed);
}

}  // namespace sdma
