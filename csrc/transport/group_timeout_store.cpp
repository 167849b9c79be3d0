#include "transport/group_timeout_store.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <thread>

namespace sdma {
namespace {

// Polls start quick (a peer usually publishes within microseconds to milliseconds of us) and back off, so that a
// long wait for a late peer costs the store's server little.
constexpr auto kFirstPoll = std::chrono::microseconds(50);
constexpr auto kLongestPoll = std::chrono::milliseconds(20);

}  // namespace

std::vector<uint8_t> GroupTimeoutStore::get(const std::string& key) {
  awaitKeys({key}, groupTimeout_);
  return PrefixStore::get(key);
}

std::vector<std::vector<uint8_t>> GroupTimeoutStore::multiGet(const std::vector<std::string>& keys) {
  awaitKeys(keys, groupTimeout_);
  return PrefixStore::multiGet(keys);
}

void GroupTimeoutStore::wait(const std::vector<std::string>& keys) {
  awaitKeys(keys, groupTimeout_);
}

void GroupTimeoutStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  awaitKeys(keys, timeout);
}

void GroupTimeoutStore::awaitKeys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  std::chrono::microseconds pause = kFirstPoll;
  while (!PrefixStore::check(keys)) {
    const auto waited = std::chrono::steady_clock::now() - start;
    if (timeout != kNoTimeout && waited >= timeout) {
      std::string names;
      for (const auto& k : keys) {
        names += (names.empty() ? "" : ", ") + k;
      }
      // The store's own error type and words, as its blocking wait would have thrown them.
      C10_THROW_ERROR(DistStoreError, "wait timeout after " + std::to_string(timeout.count()) + "ms, keys: " + names);
    }
    auto sleep = pause;
    if (timeout != kNoTimeout) {
      sleep = std::min(sleep, std::chrono::duration_cast<std::chrono::microseconds>(timeout - waited) +
                                  std::chrono::microseconds(1));
    }
    std::this_thread::sleep_for(sleep);
    pause = std::min<std::chrono::microseconds>(pause * 2, kLongestPoll);
  }
}

}  // namespace sdma
