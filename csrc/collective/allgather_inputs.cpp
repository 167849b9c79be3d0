#include "collective/allgather_inputs.hpp"

#include <c10/util/Exception.h>

namespace sdma {

void checkSingleTensor(const at::Tensor& t, const at::Device& device, const std::string& what) {
  if (t.device().type() != device.type() || t.is_sparse()) {
    C10_THROW_ERROR(ValueError,
                    std::string(device.is_cuda() ? "Tensors must be CUDA and dense" : "Tensors must be CPU and dense") +
                        ": " + what + " is " + (t.is_sparse() ? "sparse" : t.device().str()));
  }
  if (!t.is_contiguous(t.suggest_memory_format())) {
    C10_THROW_ERROR(ValueError, "Tensors must be contiguous: " + what + " is not (sizes " + c10::str(t.sizes()) +
                                    ", strides " + c10::str(t.strides()) + ")");
  }
  if (t.device() != device) {
    C10_THROW_ERROR(ValueError, "Expected list of tensors on the same device: " + what + " is on " + t.device().str() +
                                    ", the first on " + device.str());
  }
}

std::string entryOf(size_t i, const std::string& list) {
  return "entry " + std::to_string(i) + " of " + list;
}

namespace {

void checkSameType(const at::Tensor& output, const at::Tensor& input) {
  if (output.dtype() != input.dtype()) {
    C10_THROW_ERROR(TypeError, "output tensor must have the same type as input tensor");
  }
}

char* bytesOf(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

size_t nbytes(const at::Tensor& t) {
  return static_cast<size_t>(t.numel()) * t.element_size();
}

// What both NCCL and gloo gather natively (complex tensors reach a backend as real views already).
bool innerGathersNatively(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

bool anyDtypeGatheredAsBytes(const std::vector<at::Tensor>& inputs) {
  for (const auto& t : inputs) {
    if (!innerGathersNatively(t.scalar_type()) || t.scalar_type() != inputs.front().scalar_type()) {
      // Mixed dtypes too: gloo's coalesced all-gathers flatten their inputs into one tensor, converting them to a
      // common dtype and back, which changes the bits of some values (bf16 NaNs beside float32 came back as 0xff).
      return true;
    }
  }
  return false;
}

// The plan of a form whose every rank contributes one tensor (into tensor, list): its bytes are the stream.
PlannedAllgather planOneInput(const at::Tensor& input, const at::Device& device) {
  PlannedAllgather p;
  p.device = device;
  p.innerGathersBytes = !innerGathersNatively(input.scalar_type());
  p.plan.bytesPerRank = nbytes(input);
  p.plan.input = {{bytesOf(input), p.plan.bytesPerRank}};
  return p;
}

}  // namespace

void checkOneInput(const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(inputs.size() == 1,
              "Expecting one tensor only but got multiple. You are probably using multiple devices under one "
              "thread. The support for such usage has been deprecated.");
}

at::Tensor byteView(const at::Tensor& t) {
  return t.reshape({-1}).view(at::kByte);
}

at::Tensor InnerOperands::operator()(const at::Tensor& t) const {
  return asBytes_ ? byteView(t) : t;
}

std::vector<at::Tensor> InnerOperands::operator()(const std::vector<at::Tensor>& ts) const {
  if (!asBytes_) {
    return ts;
  }
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) {
    out.push_back(byteView(t));
  }
  return out;
}

std::vector<std::vector<at::Tensor>> InnerOperands::operator()(
    const std::vector<std::vector<at::Tensor>>& lists) const {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& l : lists) {
    out.push_back((*this)(l));
  }
  return out;
}

PlannedAllgather planAllgatherIntoTensor(const at::Tensor& output, const at::Tensor& input, int rank, int size) {
  (void)rank;
  const at::Device device = input.device();
  checkSingleTensor(input, device, "the input");
  checkSingleTensor(output, device, "the output");
  checkSameType(output, input);
  if (input.numel() * size != output.numel()) {
    C10_THROW_ERROR(ValueError, "output tensor size must be equal to world_size times input tensor size");
  }
  PlannedAllgather p = planOneInput(input, device);
  const size_t n = p.plan.bytesPerRank;
  for (int q = 0; q < size; ++q) {
    p.plan.outputByRank.push_back({{bytesOf(output) + q * n, n}});
  }
  p.plan.outputBase = bytesOf(output);
  p.outputBytes = n * size;
  p.outputs = {output};
  p.keepAlive = {input, output};
  return p;
}

PlannedAllgather planAllgatherList(const std::vector<std::vector<at::Tensor>>& outputs,
                                   const std::vector<at::Tensor>& inputs, int rank, int size) {
  (void)rank;
  TORCH_CHECK(!inputs.empty(), "torch_sdma: all_gather needs an input tensor");
  checkOneInput(inputs);
  TORCH_CHECK(outputs.size() == 1,
              "Expecting one tensor list only but got multiple. You are probably using multiple devices under one "
              "thread.");
  const at::Tensor& input = inputs[0];
  const at::Device device = input.device();
  checkSingleTensor(input, device, "the input");
  const auto& outs = outputs[0];
  TORCH_CHECK_WITH(ValueError, static_cast<int>(outs.size()) == size, "all_gather: the output list has ", outs.size(),
                   " tensors but the group has ", size, " ranks; pass one output tensor per rank");
  PlannedAllgather p = planOneInput(input, device);
  const size_t n = p.plan.bytesPerRank;
  for (const auto& out : outs) {
    checkSingleTensor(out, device, entryOf(&out - outs.data(), "the output list"));
    checkSameType(out, input);
    if (out.numel() != input.numel()) {
      // NCCL gathers uneven lists with a broadcast per rank; so does the inner backend. Gloo, the inner backend of
      // CPU tensors, takes none: say so here, in our words, rather than in gloo's about a group that is ours.
      TORCH_CHECK_WITH(ValueError, device.is_cuda(), "all_gather: output tensor ", &out - outs.data(), " has ",
                       out.numel(), " elements but the input has ", input.numel(),
                       "; on CPU tensors every output tensor must have the input's size");
      p.notForDma = "output tensors of uneven size";
    }
    p.plan.outputByRank.push_back({{bytesOf(out), n}});
  }
  p.outputBytes = n * size;
  p.outputs = outs;
  p.keepAlive = outs;
  p.keepAlive.push_back(input);
  return p;
}

PlannedAllgather planAllgatherIntoTensorCoalesced(const std::vector<at::Tensor>& outputs,
                                                  const std::vector<at::Tensor>& inputs, int rank, int size) {
  (void)rank;
  TORCH_CHECK(!inputs.empty(), "torch_sdma: allgather_into_tensor_coalesced needs at least one input tensor");
  TORCH_CHECK_WITH(ValueError, outputs.size() == inputs.size(), "allgather_into_tensor_coalesced: got ", outputs.size(),
                   " output tensors for ", inputs.size(), " input tensors");
  const at::Device device = inputs[0].device();
  PlannedAllgather p;
  p.device = device;
  p.innerGathersBytes = anyDtypeGatheredAsBytes(inputs);
  p.plan.outputByRank.resize(size);
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkSingleTensor(inputs[i], device, entryOf(i, "the input list"));
    checkSingleTensor(outputs[i], device, entryOf(i, "the output list"));
    checkSameType(outputs[i], inputs[i]);
    if (inputs[i].numel() * size != outputs[i].numel()) {
      C10_THROW_ERROR(ValueError, "output tensor size must be equal to world_size times input tensor size");
    }
    const size_t n = nbytes(inputs[i]);
    p.plan.bytesPerRank += n;
    p.plan.input.push_back({bytesOf(inputs[i]), n});
    for (int q = 0; q < size; ++q) {
      p.plan.outputByRank[q].push_back({bytesOf(outputs[i]) + q * n, n});
    }
  }
  p.outputBytes = p.plan.bytesPerRank * size;
  p.outputs = outputs;
  p.keepAlive = outputs;
  p.keepAlive.insert(p.keepAlive.end(), inputs.begin(), inputs.end());
  return p;
}

PlannedAllgather planAllgatherCoalesced(const std::vector<std::vector<at::Tensor>>& outputLists,
                                        const std::vector<at::Tensor>& inputs, int rank, int size) {
  (void)rank;
  TORCH_CHECK_WITH(ValueError, !inputs.empty(), "allgather_coalesced: requires a non-empty input tensor list");
  TORCH_CHECK_WITH(ValueError, static_cast<int>(outputLists.size()) == size, "allgather_coalesced: the output has ",
                   outputLists.size(), " lists but the group has ", size, " ranks; pass one output list per rank");
  const at::Device device = inputs[0].device();
  PlannedAllgather p;
  p.device = device;
  p.innerGathersBytes = anyDtypeGatheredAsBytes(inputs);
  p.innerLacksForm = device.is_cuda();
  p.plan.outputByRank.resize(size);
  for (const auto& in : inputs) {
    checkSingleTensor(in, device, entryOf(&in - inputs.data(), "the input list"));
    p.plan.input.push_back({bytesOf(in), nbytes(in)});
    p.plan.bytesPerRank += nbytes(in);
    p.keepAlive.push_back(in);
  }
  for (int q = 0; q < size; ++q) {
    const auto& outs = outputLists[q];
    TORCH_CHECK_WITH(ValueError, outs.size() == inputs.size(), "allgather_coalesced: output list ", q, " has ",
                     outs.size(), " tensors but there are ", inputs.size(), " input tensors");
    for (size_t i = 0; i < outs.size(); ++i) {
      checkSingleTensor(outs[i], device, entryOf(i, "output list " + std::to_string(q)));
      checkSameType(outs[i], inputs[i]);
      if (outs[i].numel() != inputs[i].numel()) {
        C10_THROW_ERROR(ValueError, "output tensor size must be equal to world_size times input tensor size");
      }
      p.plan.outputByRank[q].push_back({bytesOf(outs[i]), nbytes(inputs[i])});
      p.outputs.push_back(outs[i]);
      p.keepAlive.push_back(outs[i]);
    }
  }
  p.outputBytes = p.plan.bytesPerRank * size;
  return p;
}

}  // namespace sdma
