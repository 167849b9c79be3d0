"""Builds torch_sdma._C against the installed torch.

With a CUDA build of torch and a CUDA toolkit, or a ROCm build of torch and ROCm, the copy-engine transport is
compiled in (TORCH_SDMA_CUDA); otherwise only the shared-memory transport. TORCH_SDMA_BUILD_CUDA=0/1 forces the
choice. The module never links libcuda: driver entry points are resolved at run time, so it imports without a
driver. On ROCm torch hipifies the sources and the HIP layer replaces the CUDA one (docs/amd.md).
"""
import os

# torch looks for the toolkit next to the first nvcc on PATH; a wrapper script in /usr/local/bin then points it at
# /usr/local, which has no CUDA headers. Prefer the conventional install when the caller did not choose.
if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/include/cuda_runtime.h"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"


def _prefer_a_compiler_that_finds_libstdcxx():
    """The GPU image sets CXX to a wrapper script (/opt/gcc/bin/g++) around a relocated g++ whose driver cannot
    find its own libstdc++.so (-print-file-name answers with the bare name). The extension it linked segfaulted
    in std::ostringstream on that machine, i.e. in every formatted error message (the all_gather list-length
    check) and in the watchdog's timeout report; /usr/bin/g++ (the same GCC 13.3) built one that raised the right
    errors. So where CXX cannot find libstdc++.so and the system compiler can, build with the system compiler.
    TORCH_SDMA_KEEP_CXX=1 keeps CXX as it is."""
    import shutil
    import subprocess

    cxx = os.environ.get("CXX") or shutil.which("c++") or ""
    system = ("/usr/bin/c++", "/usr/bin/cc")
    if os.environ.get("TORCH_SDMA_KEEP_CXX") == "1" or not cxx or not all(os.path.exists(p) for p in system):
        return
    if os.path.realpath(cxx) == os.path.realpath(system[0]):
        return

    def finds_libstdcxx(compiler):
        try:
            out = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return os.path.isabs(out) and os.path.exists(out)

    if finds_libstdcxx(cxx) is False and finds_libstdcxx(system[0]):
        print(f"torch_sdma: {cxx} cannot find its libstdc++.so; building with {system[0]} instead", flush=True)
        os.environ["CXX"], os.environ["CC"] = system


_prefer_a_compiler_that_finds_libstdcxx()

try:
    import torch
except ImportError:
    # pip's default isolated build environment has no torch, and must not get one: the extension has to match the
    # user's torch exactly. One line, so that it stands out in pip's error output.
    raise SystemExit("torch_sdma builds against the torch you run, which this build cannot import; with torch "
                     "installed, run: pip install --no-build-isolation "
                     + os.path.dirname(os.path.abspath(__file__))) from None
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
# One list per layer (csrc/README.md); the vendor layer and the copy-engine runner only where the GPU code is built.
SOURCES = {
    "backend": ["process_group_sdma.cpp", "bindings.cpp", "self_exchange.cpp", "settings_agreement.cpp",
                "delegated_watch.cpp", "exchange_collectives.cpp", "p2p_collectives.cpp"],
    "collective": [
        "allgather_inputs.cpp",
        "byte_spans.cpp",
        "staging_allgather.cpp",
        "direct_allgather.cpp",
        "captured_allgather.cpp",
        "captured_exchange.cpp",
        "node_layout.cpp",
        "hierarchical_allgather.cpp",
        "exchange_inputs.cpp",
        "direct_exchange.cpp",
        "relayed_broadcast.cpp",
        "p2p_batch.cpp",
        "direct_p2p_batch.cpp",
    ],
    "transport": ["peer_rendezvous.cpp", "group_timeout_store.cpp", "host_shared_memory.cpp", "host_shm_transport.cpp"],
    "runner": ["shared_memory_runner.cpp", "host_rail_allgather.cpp", "kept_for_life.cpp", "host_p2p_runner.cpp"],
    "work": ["host_work.cpp", "self_p2p_work.cpp", "interpreter_exit.cpp"],
}
GPU_SOURCES = {
    "backend": ["comm_buffer_pool.cpp"],
    "transport": [
        "copy_engine_transport.cpp",
        "peer_segments.cpp",
        "shareable_allocations.cpp",
        "freed_allocations.cpp",
    ],
    "runner": [
        "copy_engine_runner.cpp",
        "copy_engine_direct.cpp",
        "copy_engine_captured_exchange.cpp",
        "gpu_rail_allgather.cpp",
        "graph_held_transports.cpp",
        "copy_engine_p2p_runner.cpp",
        "captured_lanes.cpp",
        "captured_p2p_pairs.cpp",
    ],
    "work": ["gpu_work.cpp", "gpu_completion.cpp"],
}
CPU_ONLY_SOURCES = {"runner": ["copy_engine_runner_absent.cpp"]}


def vendor_sources():
    """The layer that names the GPU vendor's runtime: HIP on a ROCm build of torch, CUDA otherwise. Never both,
    and never the CUDA file on ROCm: hipify would write its translation of gpu_api_cuda.cpp under the name
    gpu_api_hip.cpp, over the hand-written HIP layer beside it."""
    return {"gpu": ["gpu_api_hip.cpp" if torch.version.hip is not None else "gpu_api_cuda.cpp"]}


def source_paths(*layers):
    return [os.path.join("csrc", folder, f) for layer in layers for folder, files in layer.items() for f in files]


def want_cuda():
    forced = os.environ.get("TORCH_SDMA_BUILD_CUDA")
    if forced is not None:
        return forced == "1"
    if torch.version.hip is not None:
        return cpp_extension.ROCM_HOME is not None  # without it CUDAExtension does not hipify
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    cuda = want_cuda()
    sources = source_paths(SOURCES, *((GPU_SOURCES, vendor_sources()) if cuda else (CPU_ONLY_SOURCES,)))
    cxx = ["-O2", "-Wall", "-Wno-unused-function"]  # the C++ standard is the one torch asks for
    macros = [("TORCH_SDMA_CUDA", None)] if cuda else []
    kwargs = dict(
        name="torch_sdma._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": ["-O2"]} if cuda else {"cxx": cxx},
        libraries=["rt"],
    )
    return cpp_extension.CUDAExtension(**kwargs) if cuda else cpp_extension.CppExtension(**kwargs)


# pip builds in the checkout, and setuptools writes the package's metadata (torch_sdma.egg-info) beside setup.py by
# default. There, on a PYTHONPATH that holds the checkout (make test), it reads as an installed torch_sdma with an
# entry point, and a later pip install of the wheel into an environment that sees it does nothing. So the metadata
# goes under build/ with the compiler's files, where nothing looks for installed packages.
EGG_BASE = os.path.join(ROOT, "build")
os.makedirs(EGG_BASE, exist_ok=True)

# Name, version, packages and the entry point are in pyproject.toml.
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    options={"egg_info": {"egg_base": os.path.relpath(EGG_BASE)}},
)
