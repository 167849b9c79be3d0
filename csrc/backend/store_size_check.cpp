#include "backend/store_size_check.hpp"

#include <c10/util/Exception.h>

#include <string>

#include "transport/peer_rendezvous.hpp"

namespace sdma {

void compareSizesThroughStore(c10d::Store& store, const CollectiveInfo& info, size_t bytesPerRank,
                              c10::ScalarType dtype) {
  const std::string mine = std::to_string(bytesPerRank) + " bytes of " + c10::toString(dtype);
  const auto all = exchangeWithGroup(store, "sizes/" + std::to_string(info.seq), info.rank, info.size, mine);
  bool differ = false;
  std::string sizes;
  for (int q = 0; q < info.size; ++q) {
    differ = differ || all[q] != mine;
    sizes += (sizes.empty() ? "" : ", ") + std::string("group rank ") + std::to_string(q) + " " + all[q];
  }
  TORCH_CHECK_WITH(DistBackendError, !differ, "torch_sdma: ", info.describe(),
                   " failed: the ranks passed inputs of different sizes or dtypes (bytes per rank: ", sizes,
                   "); every rank must pass an input of the same size and dtype, and nothing was copied");
}

}  // namespace sdma
