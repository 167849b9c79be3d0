"""Staging's size check on GPUs (csrc/transport/call_size_board.hpp, docs/design.md "Sizes agree"), in real processes:
when one rank passes another size, at least one rank finds it at enqueue (and refuses the call, so it completes
nowhere) and every other rank's watchdog finds it afterwards; when all agree, nothing ever reports another size, also
while posts are reused under the watchdog's reads. Ring depths from 1 (a rank waits for its peers at every call) to
16 (tests/cpp/call_size_board_stress.cpp)."""
import subprocess

import pytest

from cpp_build import build_cpp_test


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "call_size_board_stress", [])


def run(binary, *args):
    p = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout
    return p.stdout


@pytest.mark.parametrize("world,trials,calls,depth", [(2, 300, 40, 4), (2, 200, 20, 1), (3, 200, 40, 2),
                                                     (4, 100, 60, 16)])
def test_a_mismatch_is_found_at_enqueue_by_some_rank_and_by_every_watchdog(stress_binary, world, trials, calls, depth):
    run(stress_binary, world, trials, calls, depth, world * 11 + depth, 1)


@pytest.mark.parametrize("world,calls,depth", [(2, 20000, 4), (3, 10000, 1), (4, 5000, 8)])
def test_agreeing_sizes_never_report_another(stress_binary, world, calls, depth):
    run(stress_binary, world, 1, calls, depth, world * 5 + depth, 0)
