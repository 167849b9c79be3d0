"""How the copy-engine point-to-point runner posts batches, against a device whose command queue is finite
(tests/cpp/p2p_posting_simulation.cpp): each rank's caller thread, each group's posting thread and each rank's GPU in
random interleavings, over random programs valid under NCCL's rules (2-4 ranks, sometimes a second group over two of
them; lone calls and batches mixing peers; isends past the ring and the lanes before an all-gather that the peer makes
before its irecvs; two groups whose first ops come in opposite orders; a first op with a peer inside a collective; a
rank that stops after a prefix). The design (the caller posts only with nothing queued, every pair connected, room in
the rings and fewer than B batches on the lanes; the posting thread connects, waits for the lanes, posts and enqueues
in call order) completes every case, with each pair's serials in call order, every recv holding its send's data, at
most B batches on a group's lanes, and no caller blocked on a full device queue, also when a rank stopped. Each wrong
variant is caught: the caller connecting and posting itself hangs, lanes without the bound B fill the device queue and
block a caller, a caller posting past the queued batches posts serials out of call order. And the two limits the model
found are pinned: a batch of more than R + B steps with one peer met by lone calls, and a pair's first use behind B
batches on the lanes that wait for it, hang until the group's timeout."""

import pytest

from cpp_build import build_cpp_test, caught_kinds, run_model


@pytest.fixture(scope="module")
def simulation(tmp_path_factory):
    return build_cpp_test(tmp_path_factory, "p2p_posting_simulation", [])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_design_completes_every_case(simulation, seed):
    p = run_model(simulation, seed, 10000)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "ok 10000", p.stdout


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_caller_that_connects_and_posts_itself_hangs(simulation, seed):
    """The caller waits on the peer to connect or for ring room while the peer waits for it in a collective or in a
    connect of the other group: about half the cases hang."""
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--caller-posts-always"), 2000)
    assert total >= 400 and counts == {"hang": total}, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_lanes_without_bound_fill_the_device_queue_under_the_caller(simulation, seed):
    """Without B the caller posts isends until the device queue is full and blocks in its next enqueue, before the
    all-gather its peer waits in: every case caught is a caller blocked on the device queue (about 3%)."""
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--unbounded-lanes"), 2000)
    assert counts.get("hang with a caller on a full device queue", 0) >= 20, counts
    assert set(counts) <= {"hang with a caller on a full device queue", "unbounded block"}, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_caller_posting_past_queued_batches_breaks_call_order(simulation, seed):
    """A postable batch posted by the caller while earlier ones wait on the posting thread takes their serials
    (about half the cases)."""
    total, counts = caught_kinds(run_model(simulation, seed, 2000, "--caller-posts-past-queue"), 2000)
    assert total >= 400 and counts.get("serial order", 0) >= total // 2, counts


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_batch_longer_than_ring_and_lanes_hangs(simulation, seed):
    """A known limit: a batch whose steps with one peer pass R + B, met by the peer's lone calls, waits for ring room
    while the peer's lanes hold B batches that wait for it."""
    p = run_model(simulation, seed, 2000, "--long-batches")
    total, counts = caught_kinds(p, 2000)
    assert total >= 100 and counts == {"hang": total}, counts
    assert "waits on ring room" in p.stderr and "waits on lanes' room" in p.stderr, p.stderr


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_first_use_behind_full_lanes_hangs(simulation, seed):
    """A known limit: a pair's first use behind B batches on the lanes (or R serials of a pair) that wait for a rank
    whose posting thread waits to connect with this one (a few cases in a thousand)."""
    p = run_model(simulation, seed, 3000, "--late-first-uses")
    total, counts = caught_kinds(p, 3000)
    assert total > 0 and counts == {"hang": total}, counts
    assert "waits on connect" in p.stderr, p.stderr
