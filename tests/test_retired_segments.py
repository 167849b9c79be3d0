"""How a rank's frees reach the peers that mapped its memory (csrc/transport/freed_allocations.hpp,
retired_segments.hpp), in real processes: the process-wide log of freed allocations read while threads note frees,
and the retired-segment rings read by every peer while their owners retire ids in bursts that lap slow readers.
Every id arrives in order and once, and a lost one is always reported (the peer then drops all it can)."""
import subprocess

import pytest

from cpp_build import build_cpp_test


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "retired_segments_stress", ["csrc/transport/freed_allocations.cpp"])


@pytest.mark.parametrize("world,retirements", [(2, 200000), (3, 50000), (4, 20000)])
def test_retirements_arrive_in_order_or_are_reported_lost(stress_binary, world, retirements):
    p = subprocess.run([str(stress_binary), str(world), str(retirements), str(world * 11)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout
