// Makes an inner backend over some members of a group: the rails of the hierarchical path (docs/multinode.md) need
// one each, gloo for CPU tensors and NCCL for CUDA tensors. The Python registration supplies it (torch's backends are
// built there, like the group's own inner backends); a group calls it at its first hierarchical all-gather, every
// member at once, with a store of the rail's own.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>

namespace sdma {

using InnerBackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, c10::DeviceType device,
    std::chrono::milliseconds timeout, const std::string& name)>;

}  // namespace sdma
