"""Point-to-point on CPU tensors ("sdma" groups: a shared-memory transport per pair of ranks, copies with
process_vm_readv/writev), 2 and 3 ranks: send/recv every dtype bit-exact, sync and async; a ring with
batch_isend_irecv over several rounds whose sizes vary (zero included); a two-stage pipeline; a batch with both
directions and several tensors to one peer; zero-size; p2p in flight among all-gathers and all-to-alls on the same
group; stats() and group_path(op=) on "dma:direct"; mistakes (sizes that differ, two sends that meet, a recv whose
send never comes, at the pair's first operation and later) raising on the ranks that made them within the group's
timeout, naming the peer; an op one rank refuses on its own arguments failing the peer's matching op, naming that rank;
more isends outstanding than a pair's ring holds, and a pair's first op while the peer is inside a collective, never
blocking the caller."""
import pytest
import torch
import torch.distributed as dist

from checks import p2p
from checks import p2p_faults as faults
from mp_harness import run_group

CPU = torch.device("cpu")
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
MISTAKE_TIMEOUT_S = 10.0
SLACK_S = 20.0


def p2p_body(ctx):
    torch.set_num_threads(1)
    return ctx.run_cases(p2p.all_cases(dist.group.WORLD, CPU, ctx.rank, ctx.world, "cpu"))


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_matches_local_bytes(world):
    run_group(p2p_body, world, "sdma", env=ENV, timeout=300, pg_timeout_s=30).check()


def mistakes_body(ctx):
    torch.set_num_threads(1)
    return p2p.mistake_cases(ctx, CPU, MISTAKE_TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_mistakes_raise(world):
    res = run_group(mistakes_body, world, "sdma", env=ENV, timeout=4 * (MISTAKE_TIMEOUT_S + SLACK_S) + 60,
                    pg_timeout_s=60, destroy=False, hard_exit=True, grace=4 * (MISTAKE_TIMEOUT_S + SLACK_S))
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    problems = p2p.mistake_problems(values, MISTAKE_TIMEOUT_S, SLACK_S)
    assert not problems, "\n".join(problems) + "\n" + repr(values)


def routing_body(ctx):
    """TORCH_SDMA_MIN_BYTES=64K: CPU point-to-point takes the DMA path at every size, the small send too."""
    import torch_sdma

    torch.set_num_threads(1)
    g = dist.group.WORLD
    r = ctx.rank
    for n in (256, 128 << 10):
        t = torch.full((n,), r, dtype=torch.uint8)
        if r == 0:
            dist.send(t, 1)
        elif r == 1:
            dist.recv(t, 0)
            assert bool((t == 0).all()), n
    if r in (0, 1):
        stats = torch_sdma.stats(g)
        op = "send" if r == 0 else "recv"
        assert f"delegated:{op}" not in stats, sorted(stats)
        assert int(stats[f"{op}:dma:direct"]["calls"]) == 2, sorted(stats)
        assert torch_sdma.group_path(g, device="cpu", op=op) == "dma:direct"


def test_p2p_min_bytes_leaves_cpu_p2p_on_the_dma_path():
    run_group(routing_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="64K"), timeout=120,
              pg_timeout_s=20).check()


def delegate_body(ctx):
    """TORCH_SDMA_DELEGATE=send: the send and the recv that meets it both take the inner backend."""
    import torch_sdma

    torch.set_num_threads(1)
    r = ctx.rank
    t = torch.full((4099,), r, dtype=torch.int32)
    if r == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
        assert bool((t == 0).all())
    op = "send" if r == 0 else "recv"
    stats = torch_sdma.stats()
    assert int(stats[f"delegated:{op}"]["calls"]) == 1, sorted(stats)
    assert not any(k.startswith(f"{op}:dma") for k in stats), sorted(stats)
    assert torch_sdma.group_path(device="cpu", op=op) == "inner:TORCH_SDMA_DELEGATE"


def test_p2p_delegate_knob_covers_both_sides():
    run_group(delegate_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_DELEGATE="send"), timeout=120,
              pg_timeout_s=20).check()


def sizes_across_min_bytes_body(ctx):
    """TORCH_SDMA_MIN_BYTES=64K and sizes on either side of it: both take the DMA path, whose pair check refuses the
    sizes on both ranks at once; the recv's buffer holds none of the send's bytes."""
    import time

    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        if ctx.rank == 0:
            dist.send(torch.ones(128 << 10, dtype=torch.uint8), 1)
        else:
            got = torch.zeros(256, dtype=torch.uint8)
            dist.recv(got, 0)
            assert not bool(got.any()), "bytes of the send reached a recv of another size"
    except Exception as e:  # noqa: BLE001
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    finally:
        ctx.barrier_store("sizes-across-done", timeout_s=120)
    return time.monotonic() - t0, None


def test_p2p_sizes_across_min_bytes_raise_on_both():
    res = run_group(sizes_across_min_bytes_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="64K"), timeout=180,
                    pg_timeout_s=10, destroy=False, hard_exit=True, grace=150)
    for rank, (dt, err) in enumerate(res.values()):
        assert err is not None and "131072 bytes" in err and "256 bytes" in err, f"rank {rank}: {err}"
        assert dt < 10, f"rank {rank}: {dt:.1f} s: {err}"


def peer_exits_body(ctx):
    """Rank 0 exits while rank 1 waits in a recv from it (their pair already connected): rank 1's recv raises, naming
    rank 0 as exited, long before the group's timeout; the buffer it posted holds none of another call's bytes."""
    import os
    import time

    torch.set_num_threads(1)
    t = torch.zeros(4099, dtype=torch.int32)
    if ctx.rank == 0:
        dist.send(torch.ones(4099, dtype=torch.int32), 1)
        ctx.barrier_store("first-done")
        time.sleep(1.0)
        os._exit(3)
    dist.recv(t, 0)
    assert bool((t == 1).all())
    ctx.barrier_store("first-done")
    t.zero_()
    t0 = time.monotonic()
    try:
        dist.recv(t, 0)
    except Exception as e:  # noqa: BLE001
        return time.monotonic() - t0, f"{type(e).__name__}: {e}", bool(t.any())
    return time.monotonic() - t0, None, bool(t.any())


def test_p2p_peer_exit_is_named():
    res = run_group(peer_exits_body, 2, "sdma", env=ENV, timeout=120, pg_timeout_s=60, destroy=False, hard_exit=True,
                    grace=90)
    dt, err, touched = res.values()[1]
    assert err is not None and "group rank 0" in err and "exited" in err, err
    assert dt < 30, f"{dt:.1f} s: {err}"
    assert not touched


def test_p2p_refused_batch_leaves_no_batch_open():
    res = run_group(faults.refused_batch_body, 2, "sdma", env=ENV, timeout=120, pg_timeout_s=10, destroy=False,
                    hard_exit=True, grace=60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, (errors, touched, _) in enumerate(res.values()):
        batch, lone = errors
        assert batch is not None and "DistBackendError" in batch, f"rank {rank}: {batch}"
        assert lone is not None and "refused: an earlier collective on this group failed" in lone, (rank, lone)
        assert not touched, f"rank {rank}: the lone recv after the failed batch got bytes"


@pytest.mark.parametrize("delegate", [None, "send,recv"])
def test_p2p_recv_from_any_source(delegate):
    res = run_group(faults.any_source_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_DELEGATE=delegate), timeout=120,
                    pg_timeout_s=30).check()
    refused, dt, src, _ = res.values()[1]
    if delegate is None:
        assert refused is not None and "NotImplementedError" in refused, refused
        assert "TORCH_SDMA_DELEGATE=send,recv" in refused and "src=" in refused, refused
        assert dt < 10, f"refused after {dt:.1f} s"
    else:
        assert refused is None and src == 0, (refused, src)


REFUSAL_TIMEOUT_S = 60.0
AT_ONCE_S = 20.0  # well below the group's timeout, with room for a loaded 2-core machine


@pytest.mark.parametrize("refuser_late", [False, True])
@pytest.mark.parametrize("form", ["lone", "batch", "first"])
def test_p2p_refused_op_takes_its_pair_serial(form, refuser_late):
    res = run_group(faults.refused_p2p_body, 2, "sdma", env=ENV, kwargs={"form": form, "refuser_late": refuser_late},
                    timeout=3 * REFUSAL_TIMEOUT_S, pg_timeout_s=REFUSAL_TIMEOUT_S, destroy=False, hard_exit=True,
                    grace=2 * REFUSAL_TIMEOUT_S)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    (dt0, err0, dt0_after, after0, poisoned0, _), (dt1, err1, dt1_after, after1, poisoned1, _) = res.values()
    assert err1 is not None and err1.startswith("ValueError") and "contiguous" in err1, err1
    assert err0 is not None and "group rank 1 refused its" in err0 and "on its own arguments" in err0, err0
    assert "its error: torch_sdma:" in err0 and "contiguous" in err0, err0
    assert dt0 < AT_ONCE_S, f"rank 0's op failed after {dt0:.1f} s: {err0}"
    assert after0 is not None and "refused: an earlier collective on this group failed" in after0, after0
    assert after1 is not None and "refused: an earlier collective on this group failed" in after1, after1
    assert dt0_after < AT_ONCE_S and dt1_after < AT_ONCE_S, (dt0_after, dt1_after)
    assert poisoned0 and poisoned1, "a buffer of a refused or failed op got bytes"


BACKLOG_TIMEOUT_S = 60.0


def test_p2p_isends_past_the_ring_never_block():
    res = run_group(faults.backlog_body, 2, "sdma", env=ENV, timeout=3 * BACKLOG_TIMEOUT_S,
                    pg_timeout_s=BACKLOG_TIMEOUT_S)
    res.check()
    slowest, total = res.values()[0]
    assert slowest < 5.0, f"an isend blocked its caller for {slowest:.1f} s"
    assert total < BACKLOG_TIMEOUT_S / 2, f"{total:.1f} s"


def test_p2p_backlog_whose_peer_never_comes_fails_in_wait():
    res = run_group(faults.backlog_never_met_body, 2, "sdma", env=ENV, timeout=4 * MISTAKE_TIMEOUT_S + 120,
                    pg_timeout_s=MISTAKE_TIMEOUT_S, destroy=False, hard_exit=True, grace=3 * MISTAKE_TIMEOUT_S + 60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    slowest, elapsed, errors, _ = res.values()[0]
    assert slowest < 5.0, f"an isend blocked its caller for {slowest:.1f} s"
    assert len(errors) == faults.BACKLOG_OPS, len(errors)
    assert all(e is not None and "DistBackendError" in e for e in errors), errors[:3]
    assert "timed out" in errors[0] and "group ranks [1]" in errors[0], errors[0]
    assert "an earlier operation on this group failed" in errors[-1], errors[-1]
    assert elapsed < MISTAKE_TIMEOUT_S + SLACK_S, f"{elapsed:.1f} s"


CONNECT_TIMEOUT_S = 60.0


def test_p2p_first_op_does_not_wait_for_the_peer_to_connect():
    res = run_group(faults.first_op_beside_collective_body, 2, "sdma", env=ENV, timeout=3 * CONNECT_TIMEOUT_S,
                    pg_timeout_s=CONNECT_TIMEOUT_S)
    res.check()
    for rank, (returned, total) in enumerate(res.values()):
        assert returned < 5.0, f"rank {rank}: the pair's first op blocked its caller for {returned:.1f} s"
        assert total < CONNECT_TIMEOUT_S / 2, f"rank {rank}: {total:.1f} s"


def test_p2p_first_ops_of_two_groups_in_opposite_orders():
    res = run_group(faults.opposite_subgroups_body, 2, "sdma", env=ENV, timeout=3 * CONNECT_TIMEOUT_S,
                    pg_timeout_s=CONNECT_TIMEOUT_S)
    res.check()
    for rank, elapsed in enumerate(res.values()):
        assert elapsed < CONNECT_TIMEOUT_S / 2, f"rank {rank}: {elapsed:.1f} s"


# torch's _coalescing_manager, which batch_isend_irecv enters on a backend that supports coalescing (sdma does), has
# no finally: an op that raised as it was issued would leave the group's coalescing state open, and c10d would then
# record the group's all_gather_into_tensor (all_reduce, reduce_scatter_tensor) for a coalesced call that never comes:
# the call returns None at once, nothing moved. So inside a block an op's error is raised at the block's end, after
# torch closed its state (ProcessGroupSDMA::failP2pBatch). The fault soak met it as wrong bytes (soak_faults.py --calls
# 200 --timeout 2 --seed 102, episode 6: a send delegated to gloo raised inside a batch once the peer's gloo had closed
# its connection; that depends on timing, this does not).
def test_p2p_batch_refused_at_issue_leaves_the_group_working():
    res = run_group(faults.batch_refused_at_issue_body, 2, "sdma", env=ENV, timeout=120, pg_timeout_s=10, destroy=False,
                    hard_exit=True, grace=60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, (batch, after, exact, _, _) in enumerate(res.values()):
        assert batch is not None and "contiguous" in batch, f"rank {rank}: {batch}"
        assert after is not None or exact, f"rank {rank}: the all-gather after the batch returned without its bytes"


def inner_sizes_differ_body(ctx):
    """A send of 64 bytes met by a recv of 32, both below TORCH_SDMA_MIN_BYTES: both raise, naming both sizes."""
    torch.set_num_threads(1)
    try:
        if ctx.rank == 0:
            dist.send(torch.ones(64, dtype=torch.uint8), 1)
        else:
            dist.recv(torch.zeros(32, dtype=torch.uint8), 0)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    ctx.barrier_store("inner-sizes-done", timeout_s=60)
    return err


# gloo, the inner backend of CPU tensors, checks a received message's size in its I/O thread (GLOO_ENFORCE in
# tcp/pair.cc): the exception would end the receiving process by SIGABRT (std::terminate) instead of reaching the
# call. So CPU point-to-point stays on the DMA path below TORCH_SDMA_MIN_BYTES too, where the pair compares sizes.
def test_p2p_sizes_differ_below_min_bytes_raise_on_both():
    res = run_group(inner_sizes_differ_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="1M"), timeout=120,
                    pg_timeout_s=10, destroy=False, hard_exit=True, grace=5)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, err in enumerate(res.values()):
        assert err is not None and "64 bytes" in err and "32 bytes" in err, f"rank {rank}: {err}"


def test_p2p_sizes_differ_then_lone_call():
    """A send of 1,001 bytes met by a recv of 1,000: both raise within the group's timeout plus slack; the lone
    isend/irecv that follows on the same group is refused on both ranks, or moves its bytes on both."""
    res = run_group(faults.sizes_differ_then_lone_body, 2, "sdma", env=ENV,
                    timeout=4 * (MISTAKE_TIMEOUT_S + SLACK_S) + 60,
                    pg_timeout_s=MISTAKE_TIMEOUT_S, destroy=False, hard_exit=True,
                    grace=2 * (MISTAKE_TIMEOUT_S + SLACK_S))
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    for rank, v in enumerate(values):
        dt, err = v["first"]
        assert err is not None, f"rank {rank}: sizes that differ raised nothing: {values}"
        assert dt < MISTAKE_TIMEOUT_S + SLACK_S, f"rank {rank}: the error took {dt:.1f} s: {err}"
    lone = [v["lone"][1] for v in values]
    if any(e is not None for e in lone):
        assert all(e is not None and "refused" in e for e in lone), f"the lone calls after the failure: {values}"
    else:
        assert values[1]["exact"], f"the lone recv after the failure got wrong bytes, no error: {values}"


def test_p2p_halo_isend_then_irecv_on_both():
    """Both ranks isend to the other, then irecv from it (not in a batch): each rank gets the right bytes, or an error
    within the group's timeout plus slack; the isend's input keeps its bytes; no rank dies."""
    res = run_group(faults.halo_body, 2, "sdma", env=ENV, timeout=4 * (MISTAKE_TIMEOUT_S + SLACK_S) + 60,
                    pg_timeout_s=MISTAKE_TIMEOUT_S, destroy=False, hard_exit=True,
                    grace=2 * (MISTAKE_TIMEOUT_S + SLACK_S))
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, v in enumerate(res.values()):
        assert v["input_intact"], f"rank {rank}: the isend's input changed: {v}"
        errors = [e for _, e in (v["send"], v["recv"]) if e is not None]
        if errors:
            slowest = max(dt for dt, _ in (v["send"], v["recv"]))
            assert slowest < MISTAKE_TIMEOUT_S + SLACK_S, f"rank {rank}: {slowest:.1f} s: {v}"
        else:
            assert v["exact"], f"rank {rank}: wrong bytes and no error: {v}"
