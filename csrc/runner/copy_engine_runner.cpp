#include "runner/copy_engine_runner.hpp"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Logging.h>

#include <sstream>

#include "collective/staging_allgather.hpp"
#include "transport/peer_rendezvous.hpp"
#include "work/gpu_work.hpp"

namespace sdma {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(5);
// Before a collective has been pending this long, peers are not checked for liveness (it costs syscalls).
constexpr auto kLivenessCheckAfter = std::chrono::milliseconds(1000);

std::string rankList(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    os << (i ? ", " : "") << ranks[i];
  }
  os << "]";
  return os.str();
}

}  // namespace

std::string copyEnginePathProblem(c10d::Store& store, int rank, int size) {
  return CopyEngineTransport::checkGroupReachable(store, "ce/create", rank, size, c10::cuda::current_device());
}

std::unique_ptr<AllgatherRunner> connectCopyEngineRunner(c10d::Store& store, int rank, int size, int device,
                                                         const StagingGeometry& geometry, std::string* whyNot) {
  c10::cuda::CUDAGuard guard(device);
  auto transport = CopyEngineTransport::connect(store, rank, size, device, geometry, whyNot);
  if (!transport) {
    return nullptr;
  }
  return std::make_unique<CopyEngineRunner>(std::move(transport), device);
}

CopyEngineRunner::CopyEngineRunner(std::unique_ptr<CopyEngineTransport> transport, int device)
    : transport_(std::move(transport)), device_(device) {
  c10::cuda::CUDAGuard guard(device_);
  pushStream_ = gpu::createStream();
  drainStream_ = gpu::createStream();
  callerReady_ = gpu::createEvent();
  pushDone_ = gpu::createEvent();
  watchdog_ = std::thread([this] { watchdogLoop(); });
}

CopyEngineRunner::~CopyEngineRunner() {
  drainOnShutdown();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  watchdog_.join();
  c10::cuda::CUDAGuard guard(device_);
  gpu::destroyEvent(callerReady_);
  gpu::destroyEvent(pushDone_);
  gpu::destroyStream(pushStream_);
  gpu::destroyStream(drainStream_);
}

std::string CopyEngineRunner::refusal(const PlannedAllgather& planned) {
  if (gpu::streamCapturing(c10::cuda::getCurrentCUDAStream(planned.device.index()).stream())) {
    return "CUDA graph capture";
  }
  if (planned.device.index() != device_) {
    return "tensor on another GPU than the group's first all-gather";
  }
  return "";
}

c10::intrusive_ptr<c10d::Work> CopyEngineRunner::run(PlannedAllgather& planned, bool asyncOp,
                                                     const CollectiveInfo& info) {
  const AllgatherPlan& plan = planned.plan;
  // Held through the enqueue: once the watchdog has declared the group broken, nothing more is enqueued, so the
  // serial it releases the streams up to is the last one any stream waits for.
  std::unique_lock<std::mutex> lock(mutex_);
  failure_.refuse(info);
  c10::cuda::CUDAGuard guard(device_);
  gpu::Stream caller = c10::cuda::getCurrentCUDAStream(device_).stream();
  const bool pipelined = chunkCount(plan, transport_->geometry()) > 1;

  // One chunk needs no second lane: everything on one stream, the fewest calls. Several chunks: pushes run on
  // their own stream so that the next chunk's push overlaps this chunk's drain.
  gpu::Stream drain = asyncOp ? drainStream_ : caller;
  gpu::Stream push = pipelined ? pushStream_ : drain;
  if (drain != caller || push != caller) {
    gpu::recordEvent(callerReady_, caller);
    if (drain != caller) {
      gpu::streamWaitEvent(drain, callerReady_);
    }
    if (push != caller && push != drain) {
      gpu::streamWaitEvent(push, callerReady_);
    }
  }
  transport_->bindLanes(push, drain);
  const uint32_t first = serial_ + 1;
  scheduleStagingAllgather(*transport_, plan, serial_);
  transport_->flush();
  if (push != drain) {
    gpu::recordEvent(pushDone_, push);
    gpu::streamWaitEvent(drain, pushDone_);
  }
  gpu::Event end = endEvents_->take();
  gpu::recordEvent(end, drain);

  auto completion = std::make_shared<GpuCompletion>(
      end, endEvents_,
      // A synchronous call ran on the caller's stream, which orders the allocator for us; an async one may
      // outlive the caller's references, so it keeps the tensors until the copies are done.
      asyncOp ? std::move(planned.keepAlive) : std::vector<at::Tensor>{});
  auto work = c10::make_intrusive<GpuWork>(info, planned.device, std::move(planned.outputs), completion);
  // The watchdog sleeps without a deadline only while nothing is in flight; otherwise it polls on its own, and a
  // wake-up per call would cost the caller a futex syscall.
  const bool watchdogAsleep = inFlight_.empty();
  inFlight_.push_back({std::move(completion), info, first, serial_, std::chrono::steady_clock::now()});
  lock.unlock();
  if (watchdogAsleep) {
    wake_.notify_one();
  }
  return work;
}

void CopyEngineRunner::watchdogLoop() {
  c10::cuda::CUDAGuard guard(device_);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    if (inFlight_.empty()) {
      wake_.wait(lock, [this] { return stop_ || !inFlight_.empty(); });
      continue;
    }
    InFlight oldest = inFlight_.front();
    lock.unlock();
    const bool done = oldest.completion->pollDone();
    std::string failure;
    if (!done) {
      const auto now = std::chrono::steady_clock::now();
      if (now > oldest.deadline()) {
        failure = "timed out";
      } else if (now - oldest.enqueuedAt > kLivenessCheckAfter) {
        const auto& pids = transport_->peerPids();
        for (size_t q = 0; q < pids.size(); ++q) {
          if (static_cast<int>(q) != transport_->rank() && !processAlive(pids[q])) {
            failure = "failed: group rank " + std::to_string(q) + " (pid " + std::to_string(pids[q]) + ") exited";
            break;
          }
        }
      }
    }
    if (done) {
      lock.lock();
      inFlight_.pop_front();
      continue;
    }
    if (!failure.empty()) {
      failInFlight(oldest, failure);
      lock.lock();
      continue;
    }
    lock.lock();
    wake_.wait_for(lock, kPollInterval);
  }
}

void CopyEngineRunner::failInFlight(const InFlight& stuck, const std::string& cause) {
  const auto ready = transport_->readReadyFlags();
  const int slots = transport_->geometry().slots;
  std::vector<int> neverArrived, stalled;
  if (stuck.lastSerial != stuck.firstSerial - 1) {
    for (int q = 0; q < transport_->geometry().worldSize; ++q) {
      if (q == transport_->rank()) {
        continue;
      }
      const uint32_t firstFlag = ready[q * slots + (stuck.firstSerial & (slots - 1))];
      const uint32_t lastFlag = ready[q * slots + (stuck.lastSerial & (slots - 1))];
      if (!flagReached(firstFlag, stuck.firstSerial)) {
        neverArrived.push_back(q);
      } else if (!flagReached(lastFlag, stuck.lastSerial)) {
        stalled.push_back(q);
      }
    }
  }
  std::ostringstream why;
  why << stuck.info.describe() << " " << cause << " after "
      << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - stuck.enqueuedAt)
             .count()
      << " ms; peers that never reached it: " << rankList(neverArrived)
      << "; peers that stalled inside it: " << rankList(stalled)
      << ". Its GPU streams were released; this group cannot run further all-gathers.";
  const std::string reason = why.str();
  LOG(ERROR) << "torch_sdma: " << reason;

  // First refuse new collectives, then let every stream stuck on a flag run out, then wait for the copies to
  // stop touching user memory before the works (and the tensors they keep) are let go.
  std::deque<InFlight> failed;
  uint32_t lastEnqueued = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_.record(reason);
    failed.swap(inFlight_);
    lastEnqueued = serial_;
  }
  transport_->releaseWaiters(lastEnqueued);
  const auto exc = std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torch_sdma: " + reason));
  for (auto& f : failed) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!f.completion->pollDone() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(kPollInterval);
    }
    f.completion->fail(exc);
  }
}

void CopyEngineRunner::drainOnShutdown() {
  // Staging memory is freed after this: no copy may still target it, nor be stuck waiting on a gone peer.
  while (true) {
    InFlight oldest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (inFlight_.empty()) {
        return;
      }
      oldest = inFlight_.front();
    }
    if (std::chrono::steady_clock::now() > oldest.deadline()) {
      failInFlight(oldest, "was still pending when the group was destroyed");
      return;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
}

}  // namespace sdma
