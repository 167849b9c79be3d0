#include "transport/host_shared_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <sstream>

#include "transport/peer_rendezvous.hpp"

namespace sdma {

std::string randomSegmentName() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    TORCH_CHECK(n > 0 || errno == EINTR, "torch_sdma: getrandom failed: ", strerror(errno));
    if (n > 0) {
      got += static_cast<size_t>(n);
    }
  }
  std::ostringstream os;
  os << "/torch_sdma.";
  for (unsigned char b : bytes) {
    static const char* hex = "0123456789abcdef";
    os << hex[b >> 4] << hex[b & 15];
  }
  return os.str();
}

// Maps `name`, creating it (exclusively, 0600, with its memory reserved so a full /dev/shm fails here rather
// than with SIGBUS later) when `create`. Returns null with *error set on failure.
char* mapSegment(const std::string& name, size_t bytes, bool create, std::string* error) {
  const int fd =
      create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, S_IRUSR | S_IWUSR) : shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    *error = std::string("shm_open(") + name + ") failed: " + strerror(errno);
    return nullptr;
  }
  if (create) {
    const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      *error = std::string("reserving ") + std::to_string(bytes) + " bytes of shared memory failed: " + strerror(rc);
      close(fd);
      shm_unlink(name.c_str());
      return nullptr;
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int mmapErrno = errno;
  close(fd);  // the mapping keeps the memory; no descriptor outlives this call
  if (p == MAP_FAILED) {
    *error = std::string("mmap of shared memory failed: ") + strerror(mmapErrno);
    if (create) {
      shm_unlink(name.c_str());
    }
    return nullptr;
  }
  return static_cast<char*>(p);
}

char* mapGroupRegion(c10d::Store& store, const std::string& key, int rank, int size, size_t bytes,
                     std::string* whyNot) {
  std::string name, error;
  char* base = nullptr;
  if (rank == 0) {
    name = randomSegmentName();
    base = mapSegment(name, bytes, /*create=*/true, &error);
  }
  const auto names = exchangeWithGroup(store, key + "/name", rank, size, error.empty() ? name : "");
  if (rank != 0 && !names[0].empty()) {
    base = mapSegment(names[0], bytes, /*create=*/false, &error);
  } else if (rank != 0) {
    error = "group rank 0 could not create it";
  }
  *whyNot = agreeOnPath(store, key + "/mapped", rank, size, error);
  // Mapped by all (or given up on): the name goes, so nothing outlives the group even if a member dies now.
  if (!names[0].empty()) {
    shm_unlink(names[0].c_str());
  }
  if (!whyNot->empty()) {
    unmapSegment(base, bytes);
    return nullptr;
  }
  return base;
}

void unmapSegment(char* base, size_t bytes) {
  if (base) {
    munmap(base, bytes);
  }
}

}  // namespace sdma
