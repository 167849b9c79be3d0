#include "backend/settings_agreement.hpp"

#include <c10/util/Exception.h>

#include <sstream>
#include <utility>
#include <vector>

#include "transport/peer_rendezvous.hpp"

namespace sdma {
namespace {

// name=value lines as (name, value) pairs, in order.
std::vector<std::pair<std::string, std::string>> parseSettings(const std::string& encoded) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream lines(encoded);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t eq = line.find('=');
    out.emplace_back(line.substr(0, eq), eq == std::string::npos ? "" : line.substr(eq + 1));
  }
  return out;
}

}  // namespace

std::string settingsThatMustAgree(const SdmaOptions& o) {
  std::ostringstream s;
  // Disabled on one rank only: that rank sends all-gathers to the inner backend while its peers wait in shared
  // memory or on copy engines. The byte thresholds likewise pick the path per call.
  s << "TORCH_SDMA_DISABLE=" << (o.disable ? 1 : 0) << "\n";
  s << "TORCH_SDMA_MIN_BYTES (CUDA)=" << o.minBytesCuda << "\n";
  s << "TORCH_SDMA_MIN_BYTES (CPU)=" << o.minBytesCpu << "\n";
  s << "TORCH_SDMA_MIN_BYTES_ACROSS_NODES=" << o.minBytesCudaAcrossNodes << "\n";
  // The staging geometry: each rank computes where its chunk lands in a peer's staging from these alone.
  s << "TORCH_SDMA_STAGING_BYTES (CUDA)=" << o.stagingBytesCuda << "\n";
  s << "TORCH_SDMA_STAGING_BYTES (CPU)=" << o.stagingBytesCpu << "\n";
  s << "TORCH_SDMA_SLOTS=" << o.slots << "\n";
  s << "TORCH_SDMA_CHUNK_BYTES=" << o.chunkBytes << "\n";
  // The direct path and staging exchange different things per call.
  // What the user set: a rank whose allocator turned the direct path off took the default, and the group then
  // agrees on staging when it connects (one member that cannot map its peers' memory keeps them all off it).
  s << "TORCH_SDMA_DIRECT (CUDA)=" << (o.directCuda || o.directCudaFromAllocator ? 1 : 0) << "\n";
  s << "TORCH_SDMA_DIRECT (CPU)=" << (o.directCpu ? 1 : 0) << "\n";
  // The exchanges it names go to the inner backend on this rank only.
  s << "TORCH_SDMA_DELEGATE=" << o.delegate << "\n";
  return s.str();
}

void agreeOnSettings(c10d::Store& store, int rank, int size, const SdmaOptions& options) {
  const auto all = exchangeWithGroup(store, "settings", rank, size, settingsThatMustAgree(options));
  std::vector<std::vector<std::pair<std::string, std::string>>> parsed;
  parsed.reserve(all.size());
  for (const auto& encoded : all) {
    parsed.push_back(parseSettings(encoded));
  }
  std::string differences;
  for (size_t i = 0; i < parsed[rank].size(); ++i) {
    const std::string& name = parsed[rank][i].first;
    bool differs = false;
    for (const auto& member : parsed) {
      differs = differs || i >= member.size() || member[i] != parsed[rank][i];
    }
    if (!differs) {
      continue;
    }
    std::string values;
    for (size_t r = 0; r < parsed.size(); ++r) {
      values += (values.empty() ? "" : ", ") + std::string("group rank ") + std::to_string(r) + " has " +
                (i < parsed[r].size() ? parsed[r][i].second : "(unknown)");
    }
    differences += (differences.empty() ? "" : "; ") + name + ": " + values;
  }
  TORCH_CHECK_VALUE(differences.empty(), "torch_sdma: group '", options.groupName,
                    "' was not created: its members' settings differ, and every member must use the same ones (set "
                    "the variable alike in every process, or pass one ProcessGroupSDMA.Options): ",
                    differences);
}

}  // namespace sdma
