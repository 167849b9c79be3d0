#include "runner/host_rail_allgather.hpp"

#include <c10/util/Exception.h>

#include <cstring>
#include <thread>

#include "transport/idle_backoff.hpp"

namespace sdma {

HostRailAllgather::HostRailAllgather(HostShmTransport& transport, HierarchicalSetup setup, size_t segmentBytes)
    : transport_(transport),
      segmentBytes_(segmentBytes),
      buffer_(new char[static_cast<size_t>(transport.geometry().slots) * segmentBytes]),
      setup_(std::move(setup)) {
  setup_.checkDescribes(transport.rank(), transport.geometry().worldSize);
}

void HostRailAllgather::gather(int slot, Lane /*after: the worker runs everything in order*/,
                               const std::vector<ByteSpan>& mine, size_t bytes) {
  transport_.recordTask(
      [this, slot, mine, bytes](std::chrono::steady_clock::time_point deadline, const std::string& description) {
        gatherNow(slot, mine, bytes, deadline, description);
      });
}

void HostRailAllgather::gatherNow(int slot, const std::vector<ByteSpan>& mine, size_t bytes,
                                  std::chrono::steady_clock::time_point deadline, const std::string& description) {
  const auto n = static_cast<int64_t>(bytes);
  at::Tensor input;
  if (mine.size() == 1) {
    input = at::from_blob(mine.front().ptr, {n}, at::kByte);
  } else {  // a chunk that spans several tensors of a coalesced form
    input = at::empty({n}, at::kByte);
    char* at = static_cast<char*>(input.data_ptr());
    for (const ByteSpan& piece : mine) {
      memcpy(at, piece.ptr, piece.bytes);
      at += piece.bytes;
    }
  }
  at::Tensor output = at::from_blob(gathered(slot), {n * railSize()}, at::kByte);
  const auto start = std::chrono::steady_clock::now();
  c10d::AllgatherOptions opts;
  opts.timeout =
      std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(deadline - start));
  auto failed = [&](const std::string& why) {
    // The inner backend may see a rank's sockets close a moment before its process shows as exited.
    std::string exited = exitedMembersOnThisHost(setup_.members, setup_.groupRank);
    for (int i = 0; i < 20 && exited.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      exited = exitedMembersOnThisHost(setup_.members, setup_.groupRank);
    }
    TORCH_CHECK_WITH(DistBackendError, false, "torch_sdma: ", description,
                     " failed in the all-gather between nodes on ", setup_.railName(), ": ",
                     exited.empty() ? "" : exited + " exited; ", why);
  };
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = setup_.rail->_allgather_base(output, input, opts);
  } catch (const std::exception& e) {
    failed(e.what());
  }
  // Polled, not waited on: a member on this host that exited (a rank of another pseudo-node, whose gather never
  // comes) is named at once instead of at the deadline.
  auto nextLivenessCheck = start + std::chrono::milliseconds(10);
  while (!work->isCompleted()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= nextLivenessCheck) {
      nextLivenessCheck = now + std::chrono::milliseconds(10);
      if (!exitedMembersOnThisHost(setup_.members, setup_.groupRank).empty()) {
        failed("a rail member's part may never come");
      }
      if (now >= deadline) {
        failed("timed out after " +
               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - start).count()) + " ms");
      }
    }
    idleBackoff(now - start);
  }
  try {
    work->wait();  // rethrows the inner backend's error
  } catch (const std::exception& e) {
    failed(e.what());
  }
}

}  // namespace sdma
