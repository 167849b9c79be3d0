import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # spawned ranks import the test modules and helpers by these names
    sys.path.insert(0, HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least two CUDA devices (skipped elsewhere)")


def cuda_count():
    """Visible CUDA devices. SDMA_TEST_SHARE_GPU=1 counts one GPU as two, so that the two-rank GPU tests run with two
    processes on it (for correctness only: NCCL refuses two ranks on one GPU, so there the expected bytes are rebuilt
    from every rank's seed, and the cases about NCCL itself skip; checks/data.py's SHARE_GPU)."""
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0
    return max(n, 2) if n and os.environ.get("SDMA_TEST_SHARE_GPU") == "1" else n


@pytest.fixture
def shm_snapshot():
    """Names in /dev/shm now (to diff against after a run)."""

    def snap():
        try:
            return set(os.listdir("/dev/shm"))
        except FileNotFoundError:
            return set()

    return snap
