// Checks the arguments of every all-gather form the way ProcessGroupNCCL does (same exception types, same
// words), before anything is enqueued, and reduces the form to an AllgatherPlan over raw bytes.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "collective/allgather_plan.hpp"

namespace sdma {

struct PlannedAllgather {
  AllgatherPlan plan;
  at::Device device = at::kCPU;  // where the tensors are, which decides the transport and the inner backend
  size_t outputBytes = 0;
  std::vector<at::Tensor> outputs;    // what Work::result() and the future return
  std::vector<at::Tensor> keepAlive;  // every tensor the copies touch
  std::string notForDma;              // non-empty: valid input the DMA path does not take (e.g. uneven list)
  // The inner backends gather only some dtypes (NCCL and gloo refuse int16, the unsigned types above uint8, and
  // gloo float8); an all-gather only moves bytes, so on the inner path the others travel as byte views.
  bool innerGathersBytes = false;
  // NCCL has no all_gather_coalesced (the list-of-lists form): on GPUs that form takes the DMA path at every size,
  // since TORCH_SDMA_MIN_BYTES is a choice of the faster path, not of whether a call works.
  bool innerLacksForm = false;
};

// The tensors an inner all-gather receives: the caller's own, or byte views of them (planned.innerGathersBytes).
class InnerOperands {
 public:
  explicit InnerOperands(bool asBytes) : asBytes_(asBytes) {}
  at::Tensor operator()(const at::Tensor& t) const;
  std::vector<at::Tensor> operator()(const std::vector<at::Tensor>& ts) const;
  std::vector<std::vector<at::Tensor>> operator()(const std::vector<std::vector<at::Tensor>>& lists) const;

 private:
  bool asBytes_;
};

// ProcessGroupNCCL's words for one tensor operand that is not dense, contiguous and on `device`, followed by which
// operand it is (`what`: "the input", "entry 3 of the output list"): a call passes several, often of one shape.
void checkSingleTensor(const at::Tensor& t, const at::Device& device, const std::string& what);
// "entry <i> of <list>": `list` as checkSingleTensor's `what` names it ("the output list").
std::string entryOf(size_t i, const std::string& list);
// ProcessGroupNCCL's words when a call passes more than one input tensor.
void checkOneInput(const std::vector<at::Tensor>& inputs);
// A contiguous tensor's bytes, as a flat uint8 view of the same memory.
at::Tensor byteView(const at::Tensor& t);

PlannedAllgather planAllgatherIntoTensor(const at::Tensor& output, const at::Tensor& input, int rank, int size);
PlannedAllgather planAllgatherList(const std::vector<std::vector<at::Tensor>>& outputs,
                                   const std::vector<at::Tensor>& inputs, int rank, int size);
PlannedAllgather planAllgatherIntoTensorCoalesced(const std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs, int rank, int size);
PlannedAllgather planAllgatherCoalesced(const std::vector<std::vector<at::Tensor>>& outputLists,
                                        const std::vector<at::Tensor>& inputs, int rank, int size);

}  // namespace sdma
