// Python bindings: torch_sdma._C.ProcessGroupSDMA, a subclass of torch's c10d Backend type.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "backend/process_group_sdma.hpp"
#include "runner/collective_runner.hpp"
#include "runner/kept_for_life.hpp"
#include "work/interpreter_exit.hpp"

namespace py = pybind11;

namespace {

bool interpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Holds a c10::intrusive_ptr like torch's own Backend bindings do, but drops it with the GIL released: the last
// reference may run a backend destructor that joins threads which themselves need the GIL.
template <typename T>
class GilFreeIntrusiveHolder {
 public:
  GilFreeIntrusiveHolder() = default;
  explicit GilFreeIntrusiveHolder(T* p) : ptr_(c10::intrusive_ptr<T>::unsafe_reclaim_from_nonowning(p)) {}
  explicit GilFreeIntrusiveHolder(c10::intrusive_ptr<T> p) : ptr_(std::move(p)) {}
  GilFreeIntrusiveHolder(const GilFreeIntrusiveHolder&) = default;
  ~GilFreeIntrusiveHolder() {
    // Not while the interpreter shuts down: re-taking the GIL then ends the thread by a forced unwind, which
    // this (noexcept) destructor turns into std::terminate.
    if (ptr_ && PyGILState_Check() && !interpreterFinalizing()) {
      py::gil_scoped_release release;
      ptr_.reset();
    }
  }
  T& operator*() const noexcept {
    return *ptr_;
  }
  T* operator->() const noexcept {
    return ptr_.get();
  }
  T* get() const noexcept {
    return ptr_.get();
  }

 private:
  c10::intrusive_ptr<T> ptr_;
};

// The inner backends arrive as torch's own Python objects; their reference count lives in the object.
c10::intrusive_ptr<c10d::Backend> adopt(c10d::Backend* backend) {
  return backend ? c10::intrusive_ptr<c10d::Backend>::unsafe_reclaim_from_nonowning(backend) : nullptr;
}

c10::DeviceType deviceType(const std::string& device) {
  return device == "cuda" ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}

// A Python callable(store, rank, size, device, timeout, name) -> Backend as the factory of rail backends. The group
// that holds it may be destroyed on a thread without the GIL (GilFreeIntrusiveHolder), so the callable is let go of
// under the GIL, and not at all once the interpreter is finalizing.
sdma::InnerBackendFactory railBackendFactory(py::object make) {
  if (make.is_none()) {
    return nullptr;
  }
  std::shared_ptr<py::object> held(new py::object(std::move(make)), [](py::object* p) {
    sdma::InterpreterExit::DropScope scope;
    if (!scope.open() || interpreterFinalizing()) {
      p->release();  // leaked: taking the GIL now would end this thread
      delete p;
      return;
    }
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, c10::DeviceType device,
                std::chrono::milliseconds timeout, const std::string& name) {
    py::gil_scoped_acquire gil;
    py::object backend = (*held)(store, rank, size, device == c10::DeviceType::CUDA ? "cuda" : "cpu", timeout, name);
    return adopt(backend.cast<c10d::Backend*>());
  };
}

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, GilFreeIntrusiveHolder<T>, true)

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_sdma: an all-gather over DMA engines as a torch.distributed backend";
  py::object backendBase = py::module::import("torch._C._distributed_c10d").attr("Backend");

  py::class_<sdma::ProcessGroupSDMA, GilFreeIntrusiveHolder<sdma::ProcessGroupSDMA>> processGroup(
      m, "ProcessGroupSDMA", backendBase, py::dynamic_attr());

  py::class_<sdma::SdmaOptions>(processGroup, "Options",
                                "The group's knobs (docs/api.md). torch_sdma builds one from the TORCH_SDMA_* "
                                "environment for every group; one passed as pg_options is used as it is.")
      .def(py::init<>())
      .def_readwrite("disable", &sdma::SdmaOptions::disable)
      .def_readwrite("staging_bytes_cuda", &sdma::SdmaOptions::stagingBytesCuda)
      .def_readwrite("staging_bytes_cpu", &sdma::SdmaOptions::stagingBytesCpu)
      .def_readwrite("min_bytes_cuda", &sdma::SdmaOptions::minBytesCuda)
      .def_readwrite("min_bytes_cpu", &sdma::SdmaOptions::minBytesCpu)
      .def_readwrite("min_bytes_cuda_across_nodes", &sdma::SdmaOptions::minBytesCudaAcrossNodes)
      .def_readwrite("slots", &sdma::SdmaOptions::slots)
      .def_readwrite("chunk_bytes", &sdma::SdmaOptions::chunkBytes)
      .def_readwrite("direct_peer_wait_us", &sdma::SdmaOptions::directPeerWaitUs)
      .def_readwrite("peer_lanes", &sdma::SdmaOptions::peerLanes)
      .def_readwrite("direct_cuda", &sdma::SdmaOptions::directCuda)
      .def_readwrite("direct_cpu", &sdma::SdmaOptions::directCpu)
      .def_readwrite("direct_cuda_from_allocator", &sdma::SdmaOptions::directCudaFromAllocator)
      .def_readwrite("delegate", &sdma::SdmaOptions::delegate)
      .def_readwrite("log", &sdma::SdmaOptions::log)
      .def_readwrite("test_pseudo_node", &sdma::SdmaOptions::testPseudoNode)
      .def_readwrite("_timeout", &sdma::SdmaOptions::timeout)
      .def_readwrite("group_name", &sdma::SdmaOptions::groupName)
      .def_readwrite("global_ranks", &sdma::SdmaOptions::globalRanks);

  processGroup
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, sdma::SdmaOptions options,
                       c10d::Backend* innerCpu, c10d::Backend* innerCuda, std::string cudaUnavailable,
                       py::object railBackends) {
             return GilFreeIntrusiveHolder<sdma::ProcessGroupSDMA>(c10::make_intrusive<sdma::ProcessGroupSDMA>(
                 store, rank, size, std::move(options), adopt(innerCpu), adopt(innerCuda), std::move(cudaUnavailable),
                 railBackendFactory(std::move(railBackends))));
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("inner_cpu"),
           py::arg("inner_cuda"), py::arg("cuda_unavailable") = "", py::arg("rail_backends") = py::none())
      .def_property_readonly("_sdma_options", &sdma::ProcessGroupSDMA::options)
      .def("_sdma_stats",
           [](const sdma::ProcessGroupSDMA& self) {
             py::dict out;
             for (const auto& [path, v] : self.stats()) {
               py::dict entry;
               entry["calls"] = v.first;
               entry["bytes"] = v.second;
               if (path == sdma::CollectivePath::dma(sdma::CollectivePath::kDirect).key()) {
                 const auto pairs = self.directPairs();
                 entry["pairs_each_pushing_own"] = pairs.eachPushingOwn;
                 entry["pairs_one_moving_both"] = pairs.oneMovingBoth;
               }
               out[py::str(path)] = entry;
             }
             return out;
           })
      .def("_sdma_reset_stats", &sdma::ProcessGroupSDMA::resetStats)
      .def_property_readonly("_sdma_destroyed", &sdma::ProcessGroupSDMA::destroyed)
      .def_property_readonly("_sdma_group_name",
                             [](const sdma::ProcessGroupSDMA& self) { return self.options().groupName; })
      .def("_sdma_path", [](const sdma::ProcessGroupSDMA& self,
                            const std::string& device) { return self.pathFor(deviceType(device)).key(); })
      .def("_sdma_op_path", [](const sdma::ProcessGroupSDMA& self, const std::string& device,
                               const std::string& op) { return self.opPath(deviceType(device), op); })
      // (kind, reason): kind "dma", "inner", or "" when the group does not serve that device.
      .def("_sdma_creation_verdict",
           [](const sdma::ProcessGroupSDMA& self, const std::string& device) {
             const sdma::CollectivePath path = self.creationVerdict(deviceType(device));
             const char* kind = path.isDma() ? "dma" : path.isInner() ? "inner" : "";
             return py::make_tuple(kind, path.reason);
           })
      .def("_sdma_staging_bytes", &sdma::ProcessGroupSDMA::stagingBytesInUse)
      .def("_sdma_peer_mapped_bytes", &sdma::ProcessGroupSDMA::peerMappedBytes)
      .def("_sdma_node_layout", &sdma::ProcessGroupSDMA::nodeLayoutDescription)
      .def("_sdma_collective_min_bytes",
           [](const sdma::ProcessGroupSDMA& self, const std::string& device) {
             return self.collectiveMinBytes(device == "cuda");
           })
      // torch <= 2.13's split_group (and so DeviceMesh) deep-copies `parent_backend.options` as the child's options,
      // as ProcessGroupNCCL binds it. These are the inner NCCL's (gloo's on a CPU-only group): a split then
      // carries the caller's NCCL settings on to the child's inner NCCL.
      .def_property_readonly("options", &sdma::ProcessGroupSDMA::getBackendOptions);

  m.def("_caching_allocator_uses_expandable_segments", &sdma::cachingAllocatorUsesExpandableSegments);
  m.def("_kept_after_failures", [] {
    const sdma::KeptForLife kept = sdma::keptForLife();
    return std::map<std::string, uint64_t>{{"bytes", kept.bytes}, {"items", kept.items}};
  });
  // Registered with atexit by `import torch_sdma`: from here on no thread of ours lets go of a tensor or runs a
  // callback. Without the GIL, so that a thread that is letting go of one while this waits can take it.
  m.def("_interpreter_exiting", &sdma::InterpreterExit::close, py::call_guard<py::gil_scoped_release>());
}
