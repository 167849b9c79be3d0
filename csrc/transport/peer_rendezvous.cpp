#include "transport/peer_rendezvous.hpp"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include "collective/rank_list.hpp"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

namespace sdma {

std::vector<std::string> exchangeWithGroup(c10d::Store& store, const std::string& key, int rank, int size,
                                           const std::string& mine) {
  store.set(key + "/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> all(size);
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < size; ++r) {
    if (r == rank) {
      all[r] = mine;
      continue;
    }
    std::vector<uint8_t> v;
    try {
      v = store.get(key + "/" + std::to_string(r));
    } catch (const c10::DistStoreError&) {
      // The store's own message names one key; say which members never came, as a timeout inside a collective does.
      std::vector<int> missing;
      for (int q = 0; q < size; ++q) {
        if (q != rank && !store.check({key + "/" + std::to_string(q)})) {
          missing.push_back(q);
        }
      }
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
      C10_THROW_ERROR(DistBackendError, "torch_sdma: " + key + " timed out after " + std::to_string(waited) +
                                            " ms waiting for group ranks " +
                                            rankList(missing.empty() ? std::vector<int>{r} : missing) +
                                            ", which never reached it");
    }
    all[r].assign(v.begin(), v.end());
  }
  return all;
}

std::string agreeOnPath(c10d::Store& store, const std::string& key, int rank, int size, const std::string& myReason) {
  auto reasons = exchangeWithGroup(store, key, rank, size, myReason);
  for (int r = 0; r < size; ++r) {
    if (!reasons[r].empty()) {
      return reasons[r] + " (on group rank " + std::to_string(r) + ")";
    }
  }
  return "";
}

std::string hostIdentity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return std::string(host) + "/" + boot;
}

std::vector<MemberIdentity> exchangeIdentities(c10d::Store& store, const std::string& key, int rank, int size,
                                               const std::string& gpuBusId, const std::string& pseudoNode) {
  TORCH_CHECK(pseudoNode.find('|') == std::string::npos, "torch_sdma: pseudo-node name '", pseudoNode,
              "' contains '|'");
  // host|pid|pseudo-node|bus: the host identity holds no '|', and the bus id comes last, so it may be empty.
  const std::string mine = hostIdentity() + "|" + std::to_string(getpid()) + "|" + pseudoNode + "|" + gpuBusId;
  std::vector<MemberIdentity> members;
  for (const std::string& encoded : exchangeWithGroup(store, key, rank, size, mine)) {
    const size_t a = encoded.find('|');
    const size_t b = a == std::string::npos ? a : encoded.find('|', a + 1);
    const size_t c = b == std::string::npos ? b : encoded.find('|', b + 1);
    TORCH_CHECK(c != std::string::npos, "torch_sdma: a group member published '", encoded, "' under ", key,
                ": not a torch_sdma member identity");
    MemberIdentity m;
    m.host = encoded.substr(0, a);
    m.pid = std::stoi(encoded.substr(a + 1, b - a - 1));
    m.pseudoNode = encoded.substr(b + 1, c - b - 1);
    m.gpuBusId = encoded.substr(c + 1);
    members.push_back(std::move(m));
  }
  return members;
}

std::vector<int> pidsOf(const std::vector<MemberIdentity>& members) {
  std::vector<int> pids;
  pids.reserve(members.size());
  for (const auto& m : members) {
    pids.push_back(m.pid);
  }
  return pids;
}

std::string memberOnAnotherHost(const std::vector<MemberIdentity>& members, int rank) {
  for (size_t q = 0; q < members.size(); ++q) {
    if (members[q].host != members[rank].host) {
      return "group rank " + std::to_string(q) + " is on another host";
    }
  }
  return "";
}

std::string exitedMembersOnThisHost(const std::vector<MemberIdentity>& members, int rank) {
  std::string exited;
  for (size_t q = 0; q < members.size(); ++q) {
    if (static_cast<int>(q) != rank && members[q].host == members[rank].host && !processAlive(members[q].pid)) {
      exited += (exited.empty() ? "" : ", ") + std::string("group rank ") + std::to_string(q) + " (pid " +
                std::to_string(members[q].pid) + ")";
    }
  }
  return exited;
}

int duplicateDescriptorOf(int pid, int fd, std::string* error) {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    *error = std::string("pidfd_open failed: ") + strerror(errno);
    return -1;
  }
  const int copy = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int err = errno;
  close(pidfd);
  if (copy < 0) {
    *error = std::string("pidfd_getfd failed: ") + strerror(err);
  }
  return copy;
#else
  (void)pid;
  (void)fd;
  *error = "this kernel's headers have no pidfd_getfd";
  return -1;
#endif
}

bool processAlive(int pid) {
  if (pid <= 0 || (kill(pid, 0) != 0 && errno != EPERM)) {
    return false;
  }
  // A killed process stays a zombie until its parent reaps it, and kill() still finds a zombie; its sockets are
  // already closed, so an inner backend reports it gone before kill() does.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) {
    return true;  // no procfs here: trust kill()
  }
  const size_t end = line.rfind(')');  // the command name may hold spaces and parentheses
  return end == std::string::npos || end + 2 >= line.size() || (line[end + 2] != 'Z' && line[end + 2] != 'X');
}

}  // namespace sdma
