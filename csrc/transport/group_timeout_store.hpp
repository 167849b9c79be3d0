// The group's own keys, waited for within the group's timeout, and never by a blocking read.
//
// A store passed to init_process_group keeps the timeout it was made with (often longer than the group's), and a peer
// that never comes to a rendezvous must be named as soon as the group's timeout passes, as it is at any later
// collective.
//
// Every group of a process shares one store client (new_group wraps the default store), and a TCPStore client serves
// one request at a time: a blocking get or wait holds it until the key comes. A thread connecting one group would then
// keep another thread of the process, connecting another group, from publishing the key that the first group's peers
// wait for, while on a peer the same happens the other way round: two groups whose first all-gathers come at once
// from two threads would wait for each other until the timeout. So a read here first polls check(), which answers at
// once, with short sleeps between polls, and reads only once every key is there. Every connect reads through this
// store (directly, or through a PrefixStore over it), and so do the rails' inner backends made at a first
// hierarchical all-gather.
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

  std::vector<uint8_t> get(const std::string& key) override;
  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  // ProcessGroup.set_timeout: later rendezvous wait this long.
  void setGroupTimeout(std::chrono::milliseconds timeout) {
    groupTimeout_ = timeout;
  }

 private:
  // Returns once every key is there; throws c10::DistStoreError once `timeout` passed (kNoTimeout: never).
  void awaitKeys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  std::chrono::milliseconds groupTimeout_;
};

}  // namespace sdma
