"""Builds torch_sdma._C against the installed torch.

With a CUDA build of torch and a CUDA toolkit, or a ROCm build of torch and ROCm, the copy-engine transport is
compiled in (TORCH_SDMA_CUDA); otherwise only the shared-memory transport. TORCH_SDMA_BUILD_CUDA=0/1 forces the
choice. The module never links libcuda: driver entry points are resolved at run time, so it imports without a
driver. On ROCm torch hipifies the sources and the HIP layer replaces the CUDA one (docs/amd.md).
"""
import os
import sys

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
    "runner": [
        "shared_memory_runner.cpp",
        "host_rail_allgather.cpp",
        "kept_for_life.cpp",
        "host_p2p_runner.cpp",
        "async_error_exit.cpp",
    ],
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


# The ninja that compiled a build directory must compile it again: ninja's build logs differ between versions (1.11
# writes v5, 1.13 v7), and one that finds another's log starts over and recompiles every object. `pip install .`
# finds the system's ninja, a `make` that installed PyPI's ninja into an activated venv finds that one, so each
# would undo the other's objects. The first ninja found is remembered under build/ and put first on PATH (alone,
# through a link: no compiler moves with it) for every later build from this checkout.
NINJA_RECORD = os.path.join(ROOT, "build", "ninja-path")
NINJA_SHIM = os.path.join(ROOT, "build", "ninja-bin")


def _pin_ninja():
    import shutil

    def runnable(path):
        return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)

    try:
        with open(NINJA_RECORD) as f:
            chosen = f.read().strip()
    except OSError:
        chosen = ""
    if not runnable(chosen):
        path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                               if os.path.abspath(p) != NINJA_SHIM)
        # Else the interpreter's own (pip install ninja into a venv that is not activated).
        beside = os.path.join(os.path.dirname(sys.executable), "ninja")
        chosen = shutil.which("ninja", path=path) or (beside if runnable(beside) else "")
        if not chosen:
            return None  # torch falls back to its serial build and says so
        os.makedirs(os.path.dirname(NINJA_RECORD), exist_ok=True)
        with open(NINJA_RECORD, "w") as f:
            f.write(chosen + "\n")
    os.makedirs(NINJA_SHIM, exist_ok=True)
    link = os.path.join(NINJA_SHIM, "ninja")
    if not (os.path.islink(link) and os.readlink(link) == chosen):
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(chosen, link)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != NINJA_SHIM:
        os.environ["PATH"] = NINJA_SHIM + os.pathsep + os.environ.get("PATH", "")
    return chosen


# CPU seconds one source takes to compile (torch's headers dominate), from builds on x86 servers; only for the one
# line below, which tells a waiting user what is happening before pip's silence.
SECONDS_PER_FILE = 10


def _stale_objects(ninja, build_temp, total):
    """How many objects ninja will compile: what it would run now in the build file of the last build (headers
    included, through its deps log), or all of them where none was built."""
    import subprocess

    if not ninja or not os.path.exists(os.path.join(build_temp, "build.ninja")):
        return total
    try:
        out = subprocess.run([ninja, "-n", "-C", build_temp], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return total
    return min(total, sum(1 for line in out.splitlines() if line.startswith("[")))


def _say(line):
    """To the terminal where there is one: pip hides a build's output unless -v, and this line is for the person
    waiting at it. Else to stderr (make build shows it from its log)."""
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
            return
    except OSError:
        pass
    print(line, file=sys.stderr, flush=True)


class BuildExtension(cpp_extension.BuildExtension):
    def build_extensions(self):
        if self.use_ninja:
            total = sum(len(e.sources) for e in self.extensions)
            stale = _stale_objects(NINJA, self.build_temp, total)
            jobs = int(os.environ.get("MAX_JOBS") or 0) or (os.cpu_count() or 1) + 2
            cores = min(jobs, os.cpu_count() or 1)
            minutes = max(1, round(stale * SECONDS_PER_FILE / cores / 60))
            what = "the CUDA transport included" if want_cuda() else "no CUDA code: CPU ranks only"
            if stale:  # nothing when nothing compiles: the tests build wheels from up-to-date objects
                _say(f"torch_sdma: compiling {stale} of {total} C++ files ({what}) with {jobs} jobs: about "
                     f"{minutes} min on {cores} idle core{'s' if cores > 1 else ''}, more on a busy machine")
        super().build_extensions()


NINJA = _pin_ninja()

# pip builds in the checkout, and setuptools writes the package's metadata (torch_sdma.egg-info) beside setup.py by
# default. There, on a PYTHONPATH that holds the checkout (make test), it reads as an installed torch_sdma with an
# entry point, and a later pip install of the wheel into an environment that sees it does nothing. So the metadata
# goes under build/ with the compiler's files, where nothing looks for installed packages.
EGG_BASE = os.path.join(ROOT, "build")
os.makedirs(EGG_BASE, exist_ok=True)

# Name, version, packages and the entry point are in pyproject.toml.
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # Objects compiled against one torch are no use to another (other headers, other flags): each torch gets a folder
    # of its own, so that a build for a second interpreter with another torch neither recompiles nor overwrites the
    # first's.
    options={"egg_info": {"egg_base": os.path.relpath(EGG_BASE)},
             "build": {"build_temp": os.path.join("build", f"temp-torch{torch.__version__}")}},
)
