"""The group's call board (csrc/transport/call_board.hpp, docs/design.md "The call board"), in real processes: when
one rank posts another call (another collective, another route, another size, 0 bytes included), at least one rank
finds it when it posts (and refuses the call, so it completes nowhere), every other rank's watcher finds it
afterwards, all in the same words, and a rank that goes on is stopped by the refusing rank's failure mark; when all
agree, nothing ever reports another call, also while posts are reused under the watchers' reads, and whether a peer
reached a call (what the watchdog names late peers by) is answered right throughout. Ring depths from 1
(a rank waits for its peers at every call) to 16 (tests/cpp/call_board_stress.cpp)."""
import subprocess

import pytest

from cpp_build import build_cpp_test


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "call_board_stress", [])


def run(binary, *args):
    p = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout
    return p.stdout


@pytest.mark.parametrize("world,trials,calls,depth", [(2, 300, 40, 4), (2, 200, 20, 1), (3, 200, 40, 2),
                                                     (4, 100, 60, 16)])
def test_a_differing_call_is_found_when_posted_by_some_rank_and_by_every_watcher(stress_binary, world, trials,
                                                                                 calls, depth):
    run(stress_binary, world, trials, calls, depth, world * 11 + depth, 1)


@pytest.mark.parametrize("world,calls,depth", [(2, 20000, 4), (3, 4000, 1), (4, 5000, 8)])
def test_agreeing_calls_never_report_another(stress_binary, world, calls, depth):
    run(stress_binary, world, 1, calls, depth, world * 5 + depth, 0)
