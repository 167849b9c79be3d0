"""The all-gather schedules of csrc/collective/ against a fake transport (tests/cpp/schedule_simulation.cpp): W ranks'
recorded operations run in random interleavings that honour only the flags, as independent GPU streams would. Every
form (into tensor, in place, list, coalesced), 1 to 5 ranks, 2 or 4 slots, tiny segments and chunks so that messages
span many chunks, several collectives per group, serials wrapping past 2^32, and the direct schedule with every way
the mailbox settles a pair (each pushing its own bytes, or one late, in the order the ranks posted) and both things a
late pair may do (the later rank moving both directions, or the earlier one landing its bytes chunk by chunk in the
later one's landing area, whose flags start anywhere, near the wrap too), and the captured
schedule recorded once and replayed three times with new inputs (every flag back at 0 after each replay), and the
hierarchical schedule over 1-4 fake nodes of 1-4 ranks in any order of ranks to nodes, with a fake inner all-gather
per rail, its gathers on a lane of their own, beside push and drain on one lane (one GPU stream), or everything of a
rank in one queue (the host runner's worker): each rank's output must hold every rank's bytes, and no interleaving
may deadlock. It also pins the calls a one-chunk all-gather makes (its per-call CPU cost)."""
import subprocess

import pytest

from cpp_build import build_cpp_test

SOURCES = ["csrc/collective/staging_allgather.cpp", "csrc/collective/direct_allgather.cpp",
           "csrc/collective/captured_allgather.cpp", "csrc/collective/byte_spans.cpp",
           "csrc/collective/hierarchical_allgather.cpp", "csrc/collective/node_layout.cpp"]


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "schedule_simulation", SOURCES)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_schedules_deliver_every_byte_in_any_interleaving(simulation, seed):
    p = subprocess.run([str(simulation), str(seed), "3000"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 3000", p.stdout
