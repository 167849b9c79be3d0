"""The arrival mailbox of the direct all-gather design (csrc/transport/arrival_mailbox.hpp,
docs/design.md), in real processes: for every pair of ranks and every collective both settle the same
sharing (each pushes its own bytes, or exactly one moves both directions), with and without waiting for late
peers, and every post used is the one its owner made for that serial; ring depths from 1 (a rank waits for its
peers at every collective) to 8. And the late-peer wait: a peer that missed the short wait is waited for up to the
long one at the next collective, once (tests/cpp/arrival_mailbox_late_peer.cpp)."""
import subprocess

import pytest

from cpp_build import build_cpp_test


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "arrival_mailbox_stress", [])


@pytest.mark.parametrize("world,collectives,depth", [(2, 20000, 4), (2, 5000, 1), (3, 10000, 2), (4, 5000, 8)])
def test_pairs_settle_alike(stress_binary, world, collectives, depth):
    p = subprocess.run([str(stress_binary), str(world), str(collectives), str(depth), str(world * 7 + depth)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout


def test_a_late_peer_is_waited_for_once(tmp_path_factory):
    binary = build_cpp_test(tmp_path_factory, "arrival_mailbox_late_peer", [])
    p = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout
