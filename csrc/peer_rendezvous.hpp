// One-time exchanges through the group's store, used when a transport connects. Never on the per-call path.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

namespace sdma {

// Every member publishes `mine` under `key` and gets back everyone's value, indexed by group rank.
std::vector<std::string> exchangeWithGroup(c10d::Store& store, const std::string& key, int rank, int size,
                                           const std::string& mine);

// Every member states why it cannot take a path ("" when it can); all members get the same answer: "" when all
// can, else the first member's reason, prefixed with its rank. Keeps the path choice identical on every rank.
std::string agreeOnPath(c10d::Store& store, const std::string& key, int rank, int size,
                        const std::string& myReason);

// hostname and kernel boot id: equal only for processes on one machine.
std::string hostIdentity();

// A copy, in this process, of descriptor `fd` of process `pid` (pidfd_getfd; needs ptrace rights over it, which a
// process of the same user normally has). -1 with *error set when that is refused.
int duplicateDescriptorOf(int pid, int fd, std::string* error);

// True if `pid` is alive and visible from this process (same pid namespace).
bool processAlive(int pid);

}  // namespace sdma
