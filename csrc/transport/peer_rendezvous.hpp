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
std::string agreeOnPath(c10d::Store& store, const std::string& key, int rank, int size, const std::string& myReason);

// hostname and kernel boot id: equal only for processes on one machine.
std::string hostIdentity();

// Who a member is, as the transports need to know it.
struct MemberIdentity {
  std::string host;  // hostIdentity()
  int pid = 0;
  std::string gpuBusId;  // the PCI bus id of the member's GPU; "" in a group of CPU tensors
  // The pseudo-node of the host this member was placed on (TORCH_SDMA_TEST_PSEUDO_NODES, tests only), or "".
  std::string pseudoNode;

  // Members with the same node identity form a node of the hierarchical path (collective/node_layout.hpp).
  std::string nodeIdentity() const {
    return pseudoNode.empty() ? host : host + "#" + pseudoNode;
  }
};
// Collective: every member's identity, indexed by group rank. `pseudoNode` must not contain '|'.
std::vector<MemberIdentity> exchangeIdentities(c10d::Store& store, const std::string& key, int rank, int size,
                                               const std::string& gpuBusId, const std::string& pseudoNode = "");
// The members' process ids, indexed by group rank.
std::vector<int> pidsOf(const std::vector<MemberIdentity>& members);
// "" when every member runs on this rank's host, else which one does not.
std::string memberOnAnotherHost(const std::vector<MemberIdentity>& members, int rank);
// The members on this rank's host whose process has exited, as "group rank 3 (pid 1234), ..."; "" when none. A
// member on another host cannot be checked from here.
std::string exitedMembersOnThisHost(const std::vector<MemberIdentity>& members, int rank);

// A copy, in this process, of descriptor `fd` of process `pid` (pidfd_getfd; needs ptrace rights over it, which a
// process of the same user normally has). -1 with *error set when that is refused.
int duplicateDescriptorOf(int pid, int fd, std::string* error);

// True if `pid` is alive (not a zombie) and visible from this process (same pid namespace).
bool processAlive(int pid);

}  // namespace sdma
