"""`import torch_sdma` asks CUDA for 32 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS) before CUDA starts, never
overrides the user's value, and says so when the value in effect is below 32 (see torch_sdma/_hw_queues.py)."""
import os
import subprocess
import sys
import tempfile

import pytest

from torch_sdma import _hw_queues


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_hw_queues, "decision", None)


def test_sets_32_when_unset_and_cuda_not_started(fresh):
    env = {}
    assert _hw_queues.request_before_cuda_starts(env, cuda_started=False) == "set"
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert _hw_queues.hint(env) == ""


def test_keeps_the_users_value(fresh):
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert _hw_queues.request_before_cuda_starts(env, cuda_started=False) == "user"
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 gives 1 hardware queues" in _hw_queues.hint(env)


def test_too_late_once_cuda_started(fresh):
    env = {}
    assert _hw_queues.request_before_cuda_starts(env, cuda_started=True) == "late"
    assert env == {}
    assert _hw_queues.queues_in_effect(env) == 8
    hint = _hw_queues.hint(env)
    assert "CUDA had started before torch_sdma was loaded" in hint
    assert "Export CUDA_DEVICE_MAX_CONNECTIONS=32 where the job is launched" in hint


def test_decides_once(fresh):
    env = {}
    _hw_queues.request_before_cuda_starts(env, cuda_started=False)
    assert _hw_queues.request_before_cuda_starts(env, cuda_started=False) == "set"  # not "user" on reload


@pytest.mark.parametrize("preset,expected", [(None, "32 set"), ("4", "4 user")])
def test_import_in_a_fresh_process(preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if preset is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = preset
    code = ("import os, torch_sdma\nfrom torch_sdma import _hw_queues\n"
            "print(os.environ['CUDA_DEVICE_MAX_CONNECTIONS'], _hw_queues.decision)")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == expected
