// The group's own keys, waited for within the group's timeout. A store passed to init_process_group keeps the
// timeout it was made with (often longer than the group's), and a peer that never comes to a rendezvous must be
// named as soon as the group's timeout passes, as it is at any later collective.
#pragma once

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace sdma {

class GroupTimeoutStore : public c10d::PrefixStore {
 public:
  GroupTimeoutStore(std::string prefix, c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout)
      : PrefixStore(std::move(prefix), std::move(store)), groupTimeout_(timeout) {}

  std::vector<uint8_t> get(const std::string& key) override {
    PrefixStore::wait({key}, groupTimeout_);
    return PrefixStore::get(key);
  }
  void wait(const std::vector<std::string>& keys) override {
    PrefixStore::wait(keys, groupTimeout_);
  }
  // ProcessGroup.set_timeout: later rendezvous wait this long.
  void setGroupTimeout(std::chrono::milliseconds timeout) {
    groupTimeout_ = timeout;
  }

 private:
  std::chrono::milliseconds groupTimeout_;
};

}  // namespace sdma
