#include "backend/delegated_watch.hpp"

#include <ATen/core/ivalue.h>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "collective/collective_info.hpp"
#include "work/interpreter_exit.hpp"

namespace sdma {
namespace {

// How often the watcher reads the board while calls are watched, and how long it keeps polling after the last one
// before it sleeps until woken (a wake-up costs the caller a syscall; a steady stream of calls then pays none).
constexpr auto kPoll = std::chrono::milliseconds(2);
constexpr auto kIdleBeforeSleep = std::chrono::seconds(1);

}  // namespace

DelegatedWork::DelegatedWork(c10::intrusive_ptr<c10d::Work> inner, bool blocksCpu, const CallBoard& board, uint64_t seq,
                             const CallPost& post, int groupSize)
    : Work(-1, inner->retrieveOpType()),
      inner_(std::move(inner)),
      blocksCpu_(blocksCpu),
      board_(board),
      seq_(seq),
      post_(post),
      groupSize_(groupSize) {}

std::exception_ptr DelegatedWork::boardSaysDiffering() const {
  const CallBoard::Differing d = board_.differing(seq_, post_);
  if (!d) {
    return nullptr;
  }
  const CollectiveInfo info{c10d::OpType::UNKNOWN,
                            callOpName(post_.op),
                            seq_,
                            board_.groupName(),
                            board_.groupRankOf(board_.member()),
                            groupSize_,
                            std::chrono::milliseconds(0)};
  return std::make_exception_ptr(C10_BUILD_ERROR(
      DistBackendError, "torch_sdma: " + info.describe() + " failed: " + board_.describe(seq_, post_, d)));
}

std::exception_ptr DelegatedWork::failure() const {
  std::lock_guard<std::mutex> lock(m_);
  return failure_;
}

bool DelegatedWork::isCompleted() {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (failure_ || innerDone_) {
      return true;
    }
  }
  return inner_->isCompleted();
}

bool DelegatedWork::isSuccess() const {
  return !failure() && inner_->isSuccess();
}

std::exception_ptr DelegatedWork::exception() const {
  if (auto e = failure()) {
    return e;
  }
  return inner_->exception();
}

void DelegatedWork::innerFinished() {
  {
    std::lock_guard<std::mutex> lock(m_);
    innerDone_ = true;
  }
  released_.notify_all();
}

bool DelegatedWork::wait(std::chrono::milliseconds timeout) {
  // Once every peer went past the call, no failure can come from the board: the inner wait alone.
  if (blocksCpu_ && timeout == kNoTimeout && !board_.settled(seq_)) {
    // Released by whichever comes first: the inner collective's end, or the watcher's failure.
    std::unique_lock<std::mutex> lock(m_);
    if (!armed_ && !failure_) {
      armed_ = true;
      lock.unlock();
      c10::intrusive_ptr<c10::ivalue::Future> inner;
      try {
        inner = inner_->getFuture();
      } catch (const std::exception&) {
      }
      if (inner) {
        {
          std::lock_guard<std::mutex> guard(m_);
          innerFuture_ = inner;
        }
        auto self = c10::intrusive_ptr<DelegatedWork>::reclaim_copy(this);
        inner->addCallback([self](c10::ivalue::Future&) { self->innerFinished(); }, /*uses_future=*/false);
      } else {
        innerFinished();  // no future to tell: the inner wait below blocks as it would have
      }
      lock.lock();
    }
    released_.wait(lock, [this] { return failure_ || innerDone_; });
    if (!failure_ && innerFuture_ && !innerFuture_->hasError()) {
      // The inner future is done (the inner work marks itself done a moment later): its result is the call's, and
      // waiting for the inner work too would put this thread to sleep a second time. An error goes the way below.
      return true;
    }
  }
  if (auto e = failure()) {
    std::rethrow_exception(e);
  }
  try {
    inner_->wait(timeout);
  } catch (...) {
    if (auto e = failure()) {
      std::rethrow_exception(e);  // the inner backend's words for what the board already named
    }
    if (auto e = boardSaysDiffering()) {
      fail(e);
      std::rethrow_exception(e);
    }
    throw;
  }
  if (auto e = failure()) {
    std::rethrow_exception(e);
  }
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() {
  if (!blocksCpu_) {
    // NCCL's future is completed when the call is enqueued and orders the consumer's streams: it stays the one.
    return inner_->getFuture();
  }
  std::unique_lock<std::mutex> lock(m_);
  if (!future_) {
    auto inner = inner_->getFuture();
    future_ = c10::make_intrusive<c10::ivalue::Future>(inner->elementType());
    if (failure_) {
      future_->setError(failure_);
      return future_;
    }
    lock.unlock();
    auto self = c10::intrusive_ptr<DelegatedWork>::reclaim_copy(this);
    inner->addCallback([self](c10::ivalue::Future& f) {
      std::lock_guard<std::mutex> guard(self->m_);
      if (self->future_->completed()) {
        return;  // failed by the watcher first
      }
      if (f.hasError()) {
        self->future_->setError(f.exception_ptr());
      } else {
        self->future_->markCompleted(f.value());
      }
    });
    lock.lock();
  }
  return future_;
}

void DelegatedWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(m_);
    if (failure_) {
      return;
    }
    failure_ = error;
    if (future_ && !future_->completed()) {
      future_->setError(error);
    }
  }
  released_.notify_all();
}

DelegatedWatch::DelegatedWatch(const CallBoard& board, OnDiffering onDiffering)
    : board_(board), onDiffering_(std::move(onDiffering)) {
  thread_ = GuardedThread([this] { loop(); },
                          [](const std::string& why) {
                            LOG(ERROR) << "torch_sdma: the watcher of delegated collectives failed: " << why
                                       << "; a collective that differs across ranks is then found by the inner "
                                          "backend's timeout only";
                          });
}

DelegatedWatch::~DelegatedWatch() {
  stop();
}

void DelegatedWatch::stop() {
  thread_.stopAndJoin(mutex_, wake_, stop_);
  std::lock_guard<std::mutex> lock(mutex_);
  calls_.clear();
}

void DelegatedWatch::watch(Call call) {
  std::unique_lock<std::mutex> lock(mutex_);
  calls_.push_back(std::move(call));
  const bool asleep = asleep_;
  lock.unlock();
  if (asleep) {
    wake_.notify_one();
  }
}

void DelegatedWatch::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto lastCall = std::chrono::steady_clock::now();
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    if (calls_.empty()) {
      if (now - lastCall > kIdleBeforeSleep) {
        asleep_ = true;
        wake_.wait(lock, [this] { return stop_ || !calls_.empty(); });
        asleep_ = false;
        lastCall = std::chrono::steady_clock::now();
      } else {
        wake_.wait_for(lock, kPoll);
      }
      continue;
    }
    lastCall = now;
    // Let go of outside the lock, and kept once the interpreter exits: a call's Work may hold the last reference to
    // tensors whose Python objects Python dropped, and freeing them takes the GIL (interpreter_exit.hpp).
    std::vector<Call> finished;
    std::vector<std::pair<Call, std::string>> differing;
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (board_.settled(it->seq)) {
        finished.push_back(std::move(*it));
        it = calls_.erase(it);
      } else if (const CallBoard::Differing d = board_.differing(it->seq, it->post)) {
        differing.emplace_back(std::move(*it), board_.describe(it->seq, it->post, d));
        it = calls_.erase(it);
      } else if (now > it->deadline) {
        finished.push_back(std::move(*it));
        it = calls_.erase(it);
      } else {
        ++it;
      }
    }
    const bool anyDiffering = !differing.empty();
    if (anyDiffering || !finished.empty()) {
      lock.unlock();
      for (const auto& [call, words] : differing) {
        onDiffering_(call, words);
      }
      InterpreterExit::drop(differing);
      InterpreterExit::drop(finished);
      lock.lock();
      if (anyDiffering) {
        continue;
      }
    }
    wake_.wait_for(lock, kPoll);
  }
}

}  // namespace sdma
