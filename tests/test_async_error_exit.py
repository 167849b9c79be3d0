"""The exit of TORCH_SDMA_ASYNC_ERROR_HANDLING (csrc/runner/async_error_exit.hpp), in a process of its own: by
default one line on stderr naming the failure and the calls in flight, then status 75 with no signal, no atexit
handler and no destructor run; `0` keeps the process; only 0 turns it off."""
import os
import subprocess

import pytest

from cpp_build import build_cpp_test

VAR = "TORCH_SDMA_ASYNC_ERROR_HANDLING"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "async_error_exit_probe", ["csrc/runner/async_error_exit.cpp"])


def run(probe, value):
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if value is not None:
        env[VAR] = value
    return subprocess.run([str(probe)], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", [None, "1", " 1 ", ""])
def test_the_default_names_the_failure_then_exits_75(probe, value):
    p = run(probe, value)
    assert p.returncode == 75, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == "on\n"
    assert p.stderr.count("\n") == 1 and p.stderr.endswith("\n"), p.stderr
    assert p.stderr.startswith("torch_sdma: all_to_all_single (sequence number 2 on group '0', rank 0 of 2) timed out "
                               "after 5 ms. Calls in flight on it: all_to_all_single (sequence number 2); broadcast "
                               "(sequence number 3). The process exits with status 75"), p.stderr
    assert "atexit" not in p.stderr and "destructor" not in p.stderr, p.stderr


def test_0_keeps_the_process(probe):
    p = run(probe, "0")
    assert p.returncode == 0 and p.stdout == "off\n", (p.returncode, p.stdout, p.stderr)
