#include "collective/exchange_inputs.hpp"

#include <c10/util/Exception.h>

#include <numeric>

#include "collective/allgather_inputs.hpp"

namespace sdma {
namespace {

char* bytesOf(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

uint64_t nbytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * t.element_size();
}

PlannedExchange emptyPlan(const at::Device& device, int size) {
  PlannedExchange p;
  p.device = device;
  p.plan.sendTo.assign(size, {});
  p.plan.recvFrom.assign(size, {});
  return p;
}

// c10d's checkSplitSizes, in its words: the splits of `t`'s dim 0 over the group.
void checkSplitSizes(const std::vector<int64_t>& splits, const at::Tensor& t, int size) {
  if (splits.empty()) {
    TORCH_CHECK(t.dim() > 0 && t.size(0) % size == 0, "Tensor's dim 0 does not divide equally across group size");
  } else {
    TORCH_CHECK(splits.size() == static_cast<size_t>(size), "Number of tensor splits not equal to group size");
    TORCH_CHECK(t.dim() > 0 && std::accumulate(splits.begin(), splits.end(), int64_t{0}) == t.size(0),
                "Split sizes doesn't match total dim 0 size");
    for (int64_t s : splits) {
      TORCH_CHECK(s >= 0, "Split sizes must be non-negative");
    }
  }
}

// Consecutive ranges of `t`'s dim 0, `splits` rows each (even splits where empty).
std::vector<ByteRange> rangesOfSplits(const std::vector<int64_t>& splits, const at::Tensor& t, int size) {
  const uint64_t rows = static_cast<uint64_t>(t.size(0));
  const uint64_t rowBytes = rows == 0 ? 0 : nbytes(t) / rows;
  std::vector<ByteRange> out(size);
  uint64_t at = 0;
  for (int q = 0; q < size; ++q) {
    const uint64_t n = (splits.empty() ? rows / size : static_cast<uint64_t>(splits[q])) * rowBytes;
    out[q] = {at, n};
    at += n;
  }
  return out;
}

// One range per tensor of `list`, consecutive in a packed region; the region's pieces go to `pieces`.
std::vector<ByteRange> packedRanges(const std::vector<at::Tensor>& list, std::vector<ByteSpan>* pieces,
                                    uint64_t* total) {
  std::vector<ByteRange> out(list.size());
  uint64_t at = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const uint64_t n = nbytes(list[i]);
    out[i] = {at, n};
    pieces->push_back({bytesOf(list[i]), n});
    at += n;
  }
  *total = at;
  return out;
}

void checkRoot(int root, int size) {
  TORCH_CHECK(root >= 0 && root < size, "Invalid rootRank ", root, " for a group of ", size, " ranks");
}

void checkList(const std::vector<at::Tensor>& list, const at::Device& device, const std::string& what) {
  for (size_t i = 0; i < list.size(); ++i) {
    checkSingleTensor(list[i], device, entryOf(i, what));
  }
}

}  // namespace

PlannedExchange planAlltoallSingle(const at::Tensor& output, const at::Tensor& input,
                                   const std::vector<int64_t>& outputSplitSizes,
                                   const std::vector<int64_t>& inputSplitSizes, int rank, int size) {
  const at::Device device = input.device();
  checkSingleTensor(input, device, "the input");
  checkSingleTensor(output, device, "the output");
  if (output.dtype() != input.dtype()) {
    C10_THROW_ERROR(TypeError, "output tensor must have the same type as input tensor");
  }
  checkSplitSizes(inputSplitSizes, input, size);
  checkSplitSizes(outputSplitSizes, output, size);
  PlannedExchange p = emptyPlan(device, size);
  p.plan.sendTo = rangesOfSplits(inputSplitSizes, input, size);
  p.plan.recvFrom = rangesOfSplits(outputSplitSizes, output, size);
  // This rank's own rows: the one pair no peer checks.
  TORCH_CHECK(p.plan.sendTo[rank].bytes == p.plan.recvFrom[rank].bytes, "torch_sdma: all_to_all_single on rank ", rank,
              " sends itself ", p.plan.sendTo[rank].bytes, " bytes but expects ", p.plan.recvFrom[rank].bytes,
              " bytes from itself");
  p.plan.input = bytesOf(input);
  p.plan.inputBytes = nbytes(input);
  p.plan.output = bytesOf(output);
  p.plan.outputBytes = nbytes(output);
  p.outputs = {output};
  p.keepAlive = {input, output};
  const bool even = inputSplitSizes.empty() && outputSplitSizes.empty();
  p.routeBytes = even ? static_cast<int64_t>(nbytes(input)) : -1;
  return p;
}

PlannedExchange planAlltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs, int rank,
                             int size) {
  TORCH_CHECK(!inputs.empty() && !outputs.empty(), "torch_sdma: all_to_all needs input and output tensors");
  const at::Device device = inputs.front().device();
  TORCH_CHECK(inputs.size() == static_cast<size_t>(size) && outputs.size() == static_cast<size_t>(size),
              "Number of tensor splits not equal to group size");
  checkList(inputs, device, "the input list");
  checkList(outputs, device, "the output list");
  PlannedExchange p = emptyPlan(device, size);
  p.plan.sendTo = packedRanges(inputs, &p.plan.inputPieces, &p.plan.inputBytes);
  p.plan.recvFrom = packedRanges(outputs, &p.plan.outputPieces, &p.plan.outputBytes);
  TORCH_CHECK(p.plan.sendTo[rank].bytes == p.plan.recvFrom[rank].bytes, "torch_sdma: all_to_all on rank ", rank,
              " sends itself ", p.plan.sendTo[rank].bytes, " bytes but expects ", p.plan.recvFrom[rank].bytes,
              " bytes from itself");
  p.outputs = outputs;
  p.keepAlive = inputs;
  p.keepAlive.insert(p.keepAlive.end(), outputs.begin(), outputs.end());
  return p;
}

PlannedExchange planBroadcast(const std::vector<at::Tensor>& tensors, int root, int rank, int size) {
  checkOneInput(tensors);
  const at::Tensor& t = tensors.front();
  checkSingleTensor(t, t.device(), "the tensor");
  checkRoot(root, size);
  PlannedExchange p = emptyPlan(t.device(), size);
  const uint64_t n = nbytes(t);
  if (rank == root) {
    for (int q = 0; q < size; ++q) {
      if (q != root) {
        p.plan.sendTo[q] = {0, n};
      }
    }
    p.plan.input = bytesOf(t);
    p.plan.inputBytes = n;
  } else {
    p.plan.recvFrom[root] = {0, n};
    p.plan.output = bytesOf(t);
    p.plan.outputBytes = n;
  }
  p.outputs = {t};
  p.keepAlive = {t};
  p.routeBytes = static_cast<int64_t>(n);
  p.agreedBytes = n;
  p.root = root;
  p.broadcast = true;
  return p;
}

PlannedExchange planGather(const std::vector<std::vector<at::Tensor>>& outputs, const std::vector<at::Tensor>& inputs,
                           int root, int rank, int size) {
  checkOneInput(inputs);
  const at::Tensor& input = inputs.front();
  const at::Device device = input.device();
  checkSingleTensor(input, device, "the input");
  checkRoot(root, size);
  PlannedExchange p = emptyPlan(device, size);
  const uint64_t n = nbytes(input);
  p.plan.sendTo[root] = {0, n};
  p.plan.input = bytesOf(input);
  p.plan.inputBytes = n;
  p.keepAlive = {input};
  if (rank == root) {
    TORCH_CHECK(outputs.size() == 1, "gather: requires a single-element output list");
    const auto& list = outputs.front();
    TORCH_CHECK(list.size() == static_cast<size_t>(size), "gather: Incorrect output list size ", list.size(),
                ". Output list size should be ", size, ", same as size of the process group.");
    checkList(list, device, "the output list");
    for (const auto& t : list) {
      TORCH_CHECK(t.numel() == input.numel() && t.dtype() == input.dtype(),
                  "gather: every output tensor must have the input's size and dtype");
    }
    p.plan.recvFrom = packedRanges(list, &p.plan.outputPieces, &p.plan.outputBytes);
    p.outputs = list;
    p.keepAlive.insert(p.keepAlive.end(), list.begin(), list.end());
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs.front().empty()),
                "gather: requires empty output on non-root");
  }
  p.routeBytes = static_cast<int64_t>(n) * size;
  p.agreedBytes = n;
  p.root = root;
  p.gather = true;
  return p;
}

PlannedExchange planScatter(const std::vector<at::Tensor>& outputs, const std::vector<std::vector<at::Tensor>>& inputs,
                            int root, int rank, int size) {
  checkOneInput(outputs);
  const at::Tensor& output = outputs.front();
  const at::Device device = output.device();
  checkSingleTensor(output, device, "the output");
  checkRoot(root, size);
  PlannedExchange p = emptyPlan(device, size);
  const uint64_t n = nbytes(output);
  p.plan.recvFrom[root] = {0, n};
  p.plan.output = bytesOf(output);
  p.plan.outputBytes = n;
  p.outputs = {output};
  p.keepAlive = {output};
  if (rank == root) {
    TORCH_CHECK(inputs.size() == 1, "scatter: requires a single-element input list");
    const auto& list = inputs.front();
    TORCH_CHECK(list.size() == static_cast<size_t>(size), "scatter: Incorrect input list size ", list.size(),
                ". Input list size should be ", size, ", same as size of the process group.");
    checkList(list, device, "the input list");
    for (const auto& t : list) {
      TORCH_CHECK(t.numel() == output.numel() && t.dtype() == output.dtype(),
                  "scatter: every input tensor must have the output's size and dtype");
    }
    p.plan.sendTo = packedRanges(list, &p.plan.inputPieces, &p.plan.inputBytes);
    p.keepAlive.insert(p.keepAlive.end(), list.begin(), list.end());
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs.front().empty()),
                "scatter: requires empty input on non-root");
  }
  p.routeBytes = static_cast<int64_t>(n) * size;
  p.agreedBytes = n;
  p.root = root;
  return p;
}

}  // namespace sdma
