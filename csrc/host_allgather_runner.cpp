#include "host_allgather_runner.hpp"

#include <c10/util/Exception.h>

namespace sdma {

HostAllgatherRunner::HostAllgatherRunner(std::unique_ptr<HostShmTransport> transport)
    : transport_(std::move(transport)) {
  worker_ = std::thread([this] { workerLoop(); });
}

HostAllgatherRunner::~HostAllgatherRunner() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
}

c10::intrusive_ptr<WorkSDMA> HostAllgatherRunner::run(const AllgatherPlan& plan, const CollectiveInfo& info,
                                                      std::vector<at::Tensor> outputs,
                                                      std::vector<at::Tensor> keepAlive) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(brokenReason_.empty(), "torch_sdma: ", info.describe(),
                " refused: an earlier collective on this group failed: ", brokenReason_);
  }
  ArrivalMailbox* mailbox = transport_->mailbox();
  if (mailbox && plan.outputBase && plan.bytesPerRank > 0) {
    const uint64_t serial = ++directSerial_;
    const auto seen = mailbox->arrive(serial, {reinterpret_cast<uint64_t>(plan.input.front().ptr),
                                               reinterpret_cast<uint64_t>(plan.outputBase), plan.bytesPerRank},
                                      info.timeout);
    std::vector<PeerBuffers> peers(seen.size());
    for (size_t q = 0; q < seen.size(); ++q) {
      if (seen[q]) {
        peers[q] = {true, seen[q]->input, seen[q]->output};
      }
    }
    scheduleDirectAllgather(*transport_, plan, static_cast<uint32_t>(serial), peers);
  } else {
    scheduleAllgather(*transport_, plan, serial_);
  }
  auto work = c10::make_intrusive<WorkSDMA>(info, std::move(outputs), std::move(keepAlive));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back({transport_->takeRecorded(), work});
  }
  wake_.notify_one();
  return work;
}

void HostAllgatherRunner::workerLoop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) {
      return;  // stop_ with nothing left: every queued collective ran before the group goes away
    }
    Job job = std::move(queue_.front());
    queue_.pop_front();
    const std::string broken = brokenReason_;
    lock.unlock();
    std::exception_ptr error;
    if (!broken.empty()) {
      error = std::make_exception_ptr(C10_BUILD_ERROR(
          DistBackendError, "torch_sdma: " + job.work->description() +
                                " not run: an earlier collective on this group failed: " + broken));
    } else {
      try {
        transport_->execute(job.ops, job.work->deadline(), job.work->description());
      } catch (const std::exception& e) {
        error = std::current_exception();
        lock.lock();
        brokenReason_ = e.what();
        lock.unlock();
      }
    }
    job.work->complete(error);
    lock.lock();
  }
}

}  // namespace sdma
