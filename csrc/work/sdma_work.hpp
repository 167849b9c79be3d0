// What the Work handles of sdma's own collectives share: the collective they stand for and its outputs. The device
// decides the rest: HostWork (host_work.hpp, completed by a worker thread, like gloo's AsyncWork) and GpuWork
// (gpu_work.hpp, completed by an event, like WorkNCCL).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <string>
#include <vector>

#include "collective/collective_info.hpp"

namespace sdma {

class SdmaWork : public c10d::Work {
 public:
  SdmaWork(const CollectiveInfo& info, std::vector<at::Tensor> outputs)
      : Work(info.rank, info.opType), info_(info), outputs_(std::move(outputs)) {}

  bool isSuccess() const override {
    return !exception();
  }
  std::vector<at::Tensor> result() override {
    return outputs_;
  }
  uint64_t getSequencenumber() const override {
    return info_.seq;
  }
  std::string description() const {
    return info_.describe();
  }

 protected:
  const CollectiveInfo info_;
  const std::vector<at::Tensor> outputs_;
};

}  // namespace sdma
