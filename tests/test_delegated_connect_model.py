"""How a CUDA call that torch_sdma hands to NCCL meets its peers (tests/cpp/delegated_connect_simulation.cpp): NCCL
connects an exchange's direction with a peer at its first use, and a kind of collective's channels with every peer at
its first call, inside the call, on the caller's CPU, where no watcher sees a rank held. Each rank's caller, watcher and
GPU in random interleavings, 2-4 ranks, up to 8 calls (collectives of two kinds, exchanges of random patterns), one
rank refusing a call or making another. The design (an exchange with a direction no earlier one used, and a collective
of a kind NCCL has not run, first wait for every peer's post; the watcher of delegated collectives fails the rest)
holds no caller in the connect or on the board, leaves no stream held, completes every call without a fault and fails
every rank's group with one, also where an aborted communicator raises at its next call instead of connecting. Each
wrong variant is caught: no wait (the two-GPU fault soak's finding: a peer refused the group's first
all_to_all_single, and rank 0 stayed in NCCL's connect), a wait on the group's first call only, a wait on the peers the
call moves bytes with only, no watcher, exchanges only (two GPUs: rank 0's first all_reduce met rank 1's all-gather on
the copy engines, and rank 0 stayed in NCCL's communicator creation)."""

import re

import pytest

from cpp_build import build_cpp_test, caught_kinds, run_model


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "delegated_connect_simulation", [])


@pytest.mark.parametrize("aborted", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_design_holds_no_rank_in_the_connect(simulation, seed, aborted):
    p = run_model(simulation, seed, 10000, *(["--aborted-skips-connect"] if aborted else []))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 10000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_without_the_wait_a_refusal_holds_its_peers_in_the_connect(simulation, seed):
    p = run_model(simulation, seed, 2000, "--no-await", "--every-case")
    total, counts = caught_kinds(p, 2000)
    assert total >= 400 and counts == {"hang in NCCL's connect": total}, counts
    # The soak's case among them: two ranks, the group's first exchange refused by one.
    found = re.search(r"\(2 ranks, \d calls, rank \d refuses call 0 \(exchange\)\): hang in NCCL.s connect", p.stderr)
    assert found, p.stderr[:2000]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_wait_at_the_first_call_only_misses_later_first_uses(simulation, seed):
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--await-first-call-only"), 2000)
    assert total >= 200 and counts == {"hang in NCCL's connect": total}, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_wait_on_the_pair_peers_only_is_held_by_a_peer_that_failed_on_a_third(simulation, seed):
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--await-pair-peers-only"), 2000)
    assert total >= 50 and counts.get("hang in NCCL's connect", 0) >= total // 2, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_without_the_watcher_a_fault_leaves_streams_held(simulation, seed):
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--no-watcher"), 2000)
    assert total >= 150 and set(counts) <= {"held stream", "fault not named"} and counts.get("held stream"), counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_collectives_that_never_wait_hold_a_peer_in_the_connect(simulation, seed):
    p = run_model(simulation, seed, 2000, "--exchanges-only", "--every-case")
    total, counts = caught_kinds(p, 2000)
    assert total >= 200 and counts == {"hang in NCCL's connect": total}, counts
    # The two-GPU case among them: the group's first call, a collective on rank 0, the copy engines on rank 1.
    found = re.search(r"\(2 ranks, \d calls, another call on rank 1 at call 0 \(collective \d vs copy engines\)\): "
                      r"hang in NCCL.s connect", p.stderr)
    assert found, p.stderr[:2000]
