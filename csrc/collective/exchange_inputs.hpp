// Checks the arguments of the exchange collectives (all-to-all, broadcast, gather, scatter) in ProcessGroupNCCL's
// words, before anything is enqueued, and reduces each to an ExchangePlan over raw bytes. What only shows across
// ranks (splits, roots, sizes) is checked where the ranks meet: the call board and the arrival mailbox.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "collective/exchange_plan.hpp"

namespace sdma {

struct PlannedExchange {
  ExchangePlan plan;
  at::Device device = at::kCPU;
  std::vector<at::Tensor> outputs;    // what Work::result() and the future return
  std::vector<at::Tensor> keepAlive;  // every tensor the copies touch
  // What every rank passes alike, so that the route is the same on every rank (docs/design.md, "Exchange"): the bytes
  // TORCH_SDMA_MIN_BYTES is compared with, or -1 where no size is the same on every rank (uneven all-to-all), which
  // then takes the DMA route at every size; and the bytes the call board compares (0: none).
  int64_t routeBytes = -1;
  uint64_t agreedBytes = 0;
  int root = -1;           // group rank: broadcast's src, gather's dst, scatter's src
  bool broadcast = false;  // the copy-engine runner may relay it through the ranks (relayed_broadcast.hpp)
  bool gather = false;     // the copy-engine runner's root pulls into its list (ExchangePlan::pullingRoot)
  std::string notForDma;   // non-empty: valid input the DMA path does not take
};

PlannedExchange planAlltoallSingle(const at::Tensor& output, const at::Tensor& input,
                                   const std::vector<int64_t>& outputSplitSizes,
                                   const std::vector<int64_t>& inputSplitSizes, int rank, int size);
PlannedExchange planAlltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int rank,
                             int size);
PlannedExchange planBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank, int size);
PlannedExchange planGather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
                           int root, int rank, int size);
PlannedExchange planScatter(const std::vector<at::Tensor>& outputs, const std::vector<std::vector<at::Tensor>>& inputs,
                            int root, int rank, int size);

}  // namespace sdma
