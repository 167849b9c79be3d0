import functools
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # spawned ranks import the test modules and helpers by these names
    sys.path.insert(0, HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least two CUDA devices (skipped elsewhere)")


# The ranks of the GPU tests that take a rank count (SDMA_TEST_GPU_RANKS, 2 by default): 4 or 8 on a node of as many
# GPUs, or with SDMA_TEST_SHARE_GPU=1 as many processes on one GPU.
GPU_RANKS = int(os.environ.get("SDMA_TEST_GPU_RANKS", "2"))


def cuda_count():
    """Visible CUDA devices. SDMA_TEST_SHARE_GPU=1 counts one GPU as GPU_RANKS, so that the GPU tests run with that many
    processes on it (for correctness only: NCCL refuses two ranks on one GPU, so there the expected bytes are rebuilt
    from every rank's seed, and the cases about NCCL itself skip; checks/data.py's SHARE_GPU)."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0
    return max(n, GPU_RANKS) if n and os.environ.get("SDMA_TEST_SHARE_GPU") == "1" else n


@pytest.fixture
def shm_snapshot():
    """Names in /dev/shm now (to diff against after a run)."""

    def snap():
        try:
            return set(os.listdir("/dev/shm"))
        except FileNotFoundError:
            return set()

    return snap



REPO = os.path.dirname(HERE)


def pip_env(**extra):
    """The environment for the tests' pip commands: without PYTHONPATH, which holds the checkout under make test.
    pip would otherwise count whatever metadata an earlier install left there as torch_sdma installed, and skip
    the install a test asks for."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@functools.lru_cache(maxsize=None)
def sdma_wheel():
    """A wheel of this checkout, built once per pytest process (the tests that install it share it):
    `pip wheel --no-build-isolation --no-deps` with the interpreter running the tests, so against its torch. pip
    builds in the checkout; setup.py keeps setuptools' metadata under build/, so that the checkout, on the other
    tests' PYTHONPATH, never reads as an installed distribution with an entry point."""
    import atexit
    import glob
    import shutil
    import subprocess
    import tempfile

    out = tempfile.mkdtemp(prefix="torch_sdma_wheel_")
    atexit.register(shutil.rmtree, out, True)  # the wheel outlives no test run
    egg_info = os.path.join(REPO, "torch_sdma.egg-info")
    had_egg_info = os.path.exists(egg_info)  # an older install's leftover: the tests' pip commands ignore it
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                        "-w", out, REPO], capture_output=True, text=True, timeout=1200,
                       env=pip_env(MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))))
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    assert had_egg_info or not os.path.exists(egg_info), "the wheel's build left torch_sdma.egg-info in the checkout"
    wheels = glob.glob(os.path.join(out, "torch_sdma-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]
