import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # spawned ranks import the test modules and helpers by these names
    sys.path.insert(0, HERE)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least two CUDA devices (skipped elsewhere)")


def cuda_count():
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


@pytest.fixture
def shm_snapshot():
    """Names in /dev/shm now (to diff against after a run)."""

    def snap():
        try:
            return set(os.listdir("/dev/shm"))
        except FileNotFoundError:
            return set()

    return snap
