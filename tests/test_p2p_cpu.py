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
    """TORCH_SDMA_MIN_BYTES=64K: a small send takes the inner backend on both sides, a large one the DMA path."""
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
        assert int(stats[f"delegated:{op}"]["calls"]) == 1, sorted(stats)
        assert int(stats[f"{op}:dma:direct"]["calls"]) == 1, sorted(stats)
        assert torch_sdma.group_path(g, device="cpu", op=op) == "dma:direct"


def test_p2p_min_bytes_routes_alike():
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


def routes_differ_body(ctx):
    """TORCH_SDMA_MIN_BYTES=64K and sizes on either side of it: the send takes the DMA path, the recv gloo; both raise
    within the group's timeout, and the recv's buffer holds none of the send's bytes."""
    import time

    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        if ctx.rank == 0:
            dist.send(torch.ones(128 << 10, dtype=torch.uint8), 1)
        else:
            got = torch.zeros(256, dtype=torch.uint8)
            dist.recv(got, 0)
            assert not bool(got.any()), "bytes of the send reached a recv that took another route"
    except Exception as e:  # noqa: BLE001
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    finally:
        ctx.barrier_store("routes-differ-done", timeout_s=120)
    return time.monotonic() - t0, None


def test_p2p_routes_that_differ_raise_on_both():
    res = run_group(routes_differ_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="64K"), timeout=180,
                    pg_timeout_s=10, destroy=False, hard_exit=True, grace=150)
    for rank, (dt, err) in enumerate(res.values()):
        assert err is not None, f"rank {rank}: no error"
        assert dt < 10 + SLACK_S, f"rank {rank}: {dt:.1f} s: {err}"


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


def refused_batch_body(ctx):
    """A batch_isend_irecv whose two sides pass different sizes fails; then a lone isend/irecv pair: every call raises
    (the failed batch failed the group, so the lone calls are refused), none kills its rank with a signal, and nothing
    of either arrives."""
    torch.set_num_threads(1)
    peer = 1 - ctx.rank
    n = 100 if ctx.rank == 0 else 200
    errors = []
    got = torch.zeros(n, dtype=torch.uint8)
    try:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(n, dtype=torch.uint8), peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        for w in works:
            w.wait()
        errors.append(None)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    lone = torch.zeros(64, dtype=torch.uint8)
    try:
        w = dist.isend(torch.ones(64, dtype=torch.uint8), 1) if ctx.rank == 0 else dist.irecv(lone, 0)
        w.wait()
        errors.append(None)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    ctx.barrier_store("refused-batch-done", timeout_s=60)
    return errors, bool(lone.any())


def test_p2p_refused_batch_leaves_no_batch_open():
    res = run_group(refused_batch_body, 2, "sdma", env=ENV, timeout=120, pg_timeout_s=10, destroy=False,
                    hard_exit=True, grace=60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, (errors, touched) in enumerate(res.values()):
        batch, lone = errors
        assert batch is not None and "DistBackendError" in batch, f"rank {rank}: {batch}"
        assert lone is not None and "refused: an earlier collective on this group failed" in lone, (rank, lone)
        assert not touched, f"rank {rank}: the lone recv after the failed batch got bytes"


def any_source_body(ctx):
    """Rank 1 receives without a source while rank 0 sends: on the DMA path the recv is refused at once, naming the
    knob that hands both to the inner backend, and the send still meets the recv from 0 that follows; with
    TORCH_SDMA_DELEGATE=send,recv the recv from any source gets the bytes and names its source."""
    import os
    import time

    torch.set_num_threads(1)
    n = 4099
    sent = torch.arange(n, dtype=torch.int32) * 7 + 3
    if ctx.rank == 0:
        dist.send(sent, 1)
        return None
    got = torch.full((n,), -1, dtype=torch.int32)
    t0 = time.monotonic()
    try:
        src = dist.recv(got)
        refused = None
    except Exception as e:  # noqa: BLE001
        src, refused = None, f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    if refused is not None:
        assert not bool((got != -1).any()), "a refused recv wrote its buffer"
        dist.recv(got, 0)
    assert torch.equal(got, sent)
    return refused, dt, src, os.environ.get("TORCH_SDMA_DELEGATE")


@pytest.mark.parametrize("delegate", [None, "send,recv"])
def test_p2p_recv_from_any_source(delegate):
    res = run_group(any_source_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_DELEGATE=delegate), timeout=120,
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


def _error(e):
    return f"{type(e).__name__}: {e}".split("\nException raised from")[0]


def _polling_barrier(ctx, name, timeout_s):
    """A store barrier that never blocks the store's client: the pair's connect on the point-to-point worker reads
    through that same client (ctx.barrier_store's blocking wait would hold it)."""
    import time

    ctx.store.add(f"barrier/{name}", 1)
    deadline = time.monotonic() + timeout_s
    while int(ctx.store.add(f"barrier/{name}", 0)) < ctx.world:
        assert time.monotonic() < deadline, f"barrier {name} timed out"
        time.sleep(0.05)


def refused_p2p_body(ctx, form, refuser_late):
    """Rank 1 refuses an op with rank 0 on its own arguments (a non-contiguous tensor; in a batch, its second op; with
    form "first", the pair's first op, so that the refusal connects the pair on the worker), catches the error and
    goes on with a valid send; rank 0 made the op that meets the refused one, outputs poisoned, before or after the
    refusal. Rank 0's op fails at once naming rank 1 and its error, instead of meeting rank 1's
    next send, and its buffers keep their poison; rank 1's next send is refused at once."""
    import time

    from checks.data import assert_bytes_equal, poison_, rand

    torch.set_num_threads(1)
    r, peer, n = ctx.rank, 1 - ctx.rank, 4099
    if form != "first":
        # The pair connected first, with bytes that arrive whole.
        warm = poison_(torch.empty(n, dtype=torch.float32))
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, rand("warm", r, n, torch.float32), peer),
                                        dist.P2POp(dist.irecv, warm, peer)])
        for w in works:
            w.wait()
        assert_bytes_equal(warm, rand("warm", peer, n, torch.float32), "warm-up")
    if (r == 1) == refuser_late:
        time.sleep(1.0)  # the other rank's op goes first
    got = poison_(torch.empty(n, dtype=torch.float32))
    t0 = time.monotonic()
    # Rank 0 receives into `got`; rank 1 sends (or, in a batch, receives into) a non-contiguous tensor, refused.
    tensor = got if r == 0 else rand("bad", r, 2 * n, torch.float32)[::2]
    try:
        if form != "batch":
            (dist.irecv if r == 0 else dist.isend)(tensor, 1 - r).wait()
        else:
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, rand("b", r, n, torch.float32), 1 - r),
                                             dist.P2POp(dist.irecv, tensor, 1 - r)]):
                w.wait()
        err = None
    except Exception as e:  # noqa: BLE001
        err = _error(e)
    dt = time.monotonic() - t0
    # The refusing rank's next op, and the one rank 0 makes to meet it.
    nxt = poison_(torch.empty(n, dtype=torch.float32))
    t1 = time.monotonic()
    try:
        if r == 0:
            dist.irecv(nxt, 1).wait()
        else:
            dist.isend(rand("next", r, n, torch.float32), 0).wait()
        after = None
    except Exception as e:  # noqa: BLE001
        after = _error(e)
    dt_after = time.monotonic() - t1
    _polling_barrier(ctx, "refused-p2p-done", 2 * REFUSAL_TIMEOUT_S)
    poisoned = bool((got.view(torch.uint8) == 0xA5).all() and (nxt.view(torch.uint8) == 0xA5).all())
    return dt, err, dt_after, after, poisoned


@pytest.mark.parametrize("refuser_late", [False, True])
@pytest.mark.parametrize("form", ["lone", "batch", "first"])
def test_p2p_refused_op_takes_its_pair_serial(form, refuser_late):
    res = run_group(refused_p2p_body, 2, "sdma", env=ENV, kwargs={"form": form, "refuser_late": refuser_late},
                    timeout=3 * REFUSAL_TIMEOUT_S, pg_timeout_s=REFUSAL_TIMEOUT_S, destroy=False, hard_exit=True,
                    grace=2 * REFUSAL_TIMEOUT_S)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    (dt0, err0, dt0_after, after0, poisoned0), (dt1, err1, dt1_after, after1, poisoned1) = res.values()
    assert err1 is not None and err1.startswith("ValueError") and "contiguous" in err1, err1
    assert err0 is not None and "group rank 1 refused its" in err0 and "on its own arguments" in err0, err0
    assert "its error: torch_sdma:" in err0 and "contiguous" in err0, err0
    assert dt0 < AT_ONCE_S, f"rank 0's op failed after {dt0:.1f} s: {err0}"
    assert after0 is not None and "refused: an earlier collective on this group failed" in after0, after0
    assert after1 is not None and "refused: an earlier collective on this group failed" in after1, after1
    assert dt0_after < AT_ONCE_S and dt1_after < AT_ONCE_S, (dt0_after, dt1_after)
    assert poisoned0 and poisoned1, "a buffer of a refused or failed op got bytes"


def _connect_pair(r):
    """One send from rank 0 to rank 1, so that the pair is connected before what a test measures."""
    t = torch.full((4,), 7, dtype=torch.int32) if r == 0 else torch.zeros(4, dtype=torch.int32)
    dist.send(t, 1) if r == 0 else dist.recv(t, 0)
    assert bool((t == 7).all())


BACKLOG_OPS = 1100  # more than a pair's ring of posts (1024)
BACKLOG_TIMEOUT_S = 60.0


def backlog_body(ctx):
    """Rank 0 makes more isends to rank 1 than the pair's ring holds, then an all-gather; rank 1 makes the all-gather
    first, then the irecvs, outputs poisoned. No isend waits for rank 1 (they return at once, the posts that do not
    fit queued on rank 0's worker), every byte arrives, and the all-gather completes."""
    import time

    from checks.data import assert_bytes_equal, poison_, rand

    torch.set_num_threads(1)
    r, n = ctx.rank, 33
    _connect_pair(r)
    ag = poison_(torch.empty(2 * n, dtype=torch.float32))
    slowest = 0.0
    t0 = time.monotonic()
    if r == 0:
        works = []
        for i in range(BACKLOG_OPS):
            t = time.monotonic()
            works.append(dist.isend(rand(f"backlog{i}", 0, n + i % 5, torch.int32), 1))
            slowest = max(slowest, time.monotonic() - t)
        dist.all_gather_into_tensor(ag, rand("ag", r, n, torch.float32))
        for w in works:
            w.wait()
    else:
        dist.all_gather_into_tensor(ag, rand("ag", r, n, torch.float32))
        got = [poison_(torch.empty(n + i % 5, dtype=torch.int32)) for i in range(BACKLOG_OPS)]
        works = [dist.irecv(g, 0) for g in got]
        for w in works:
            w.wait()
        for i, g in enumerate(got):
            assert_bytes_equal(g, rand(f"backlog{i}", 0, n + i % 5, torch.int32), f"isend {i}")
    assert_bytes_equal(ag, torch.cat([rand("ag", q, n, torch.float32) for q in range(2)]), "all-gather")
    return slowest, time.monotonic() - t0


def test_p2p_isends_past_the_ring_never_block():
    res = run_group(backlog_body, 2, "sdma", env=ENV, timeout=3 * BACKLOG_TIMEOUT_S, pg_timeout_s=BACKLOG_TIMEOUT_S)
    res.check()
    slowest, total = res.values()[0]
    assert slowest < 5.0, f"an isend blocked its caller for {slowest:.1f} s"
    assert total < BACKLOG_TIMEOUT_S / 2, f"{total:.1f} s"


def backlog_never_met_body(ctx):
    """As above, but rank 1 never makes the irecvs: every isend still returns at once, and every wait() raises within
    the group's timeout (and some slack), the first naming rank 1."""
    import time

    from checks.data import rand

    torch.set_num_threads(1)
    _connect_pair(ctx.rank)
    errors, slowest = [], 0.0
    t0 = time.monotonic()
    if ctx.rank == 0:
        works = []
        for i in range(BACKLOG_OPS):
            t = time.monotonic()
            works.append(dist.isend(rand(f"never{i}", 0, 16, torch.int32), 1))
            slowest = max(slowest, time.monotonic() - t)
        for w in works:
            try:
                w.wait()
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                errors.append(_error(e))
    elapsed = time.monotonic() - t0
    ctx.barrier_store("never-met-done", timeout_s=3 * MISTAKE_TIMEOUT_S + 60)
    return slowest, elapsed, errors


def test_p2p_backlog_whose_peer_never_comes_fails_in_wait():
    res = run_group(backlog_never_met_body, 2, "sdma", env=ENV, timeout=4 * MISTAKE_TIMEOUT_S + 120,
                    pg_timeout_s=MISTAKE_TIMEOUT_S, destroy=False, hard_exit=True, grace=3 * MISTAKE_TIMEOUT_S + 60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    slowest, elapsed, errors = res.values()[0]
    assert slowest < 5.0, f"an isend blocked its caller for {slowest:.1f} s"
    assert len(errors) == BACKLOG_OPS and all(e is not None and "DistBackendError" in e for e in errors), errors[:3]
    assert "timed out" in errors[0] and "group ranks [1]" in errors[0], errors[0]
    assert "an earlier operation on this group failed" in errors[-1], errors[-1]
    assert elapsed < MISTAKE_TIMEOUT_S + SLACK_S, f"{elapsed:.1f} s"


CONNECT_TIMEOUT_S = 60.0


def first_op_beside_collective_body(ctx):
    """The pair's first op made while the peer is inside the group's first all-gather: rank 0 isends, then gathers;
    rank 1 gathers, then irecvs into a poisoned buffer. The isend returns without waiting for rank 1 to connect, the
    all-gather completes on both, and the bytes arrive whole."""
    import time

    from checks.data import assert_bytes_equal, poison_, rand

    torch.set_num_threads(1)
    r, n = ctx.rank, 4099
    ag = poison_(torch.empty(2 * n, dtype=torch.float32))
    t0 = time.monotonic()
    if r == 0:
        w = dist.isend(rand("first", 0, n, torch.int64), 1)
        returned = time.monotonic() - t0
        dist.all_gather_into_tensor(ag, rand("ag", r, n, torch.float32))
        w.wait()
    else:
        dist.all_gather_into_tensor(ag, rand("ag", r, n, torch.float32))
        got = poison_(torch.empty(n, dtype=torch.int64))
        t = time.monotonic()
        w = dist.irecv(got, 0)
        returned = time.monotonic() - t
        w.wait()
        assert_bytes_equal(got, rand("first", 0, n, torch.int64), "the pair's first op")
    assert_bytes_equal(ag, torch.cat([rand("ag", q, n, torch.float32) for q in range(2)]), "all-gather")
    return returned, time.monotonic() - t0


def test_p2p_first_op_does_not_wait_for_the_peer_to_connect():
    res = run_group(first_op_beside_collective_body, 2, "sdma", env=ENV, timeout=3 * CONNECT_TIMEOUT_S,
                    pg_timeout_s=CONNECT_TIMEOUT_S)
    res.check()
    for rank, (returned, total) in enumerate(res.values()):
        assert returned < 5.0, f"rank {rank}: the pair's first op blocked its caller for {returned:.1f} s"
        assert total < CONNECT_TIMEOUT_S / 2, f"rank {rank}: {total:.1f} s"


def opposite_subgroups_body(ctx):
    """Two groups over the same two ranks, whose pairs' first ops come in opposite orders: rank 0 isends on g1, then
    on g2; rank 1 irecvs on g2, then on g1. Neither call waits for the other rank to connect, so both complete with
    their bytes, long before the groups' timeout."""
    import datetime
    import time

    from checks.data import assert_bytes_equal, poison_, rand

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
    g1 = dist.new_group([0, 1], timeout=timeout)
    g2 = dist.new_group([0, 1], timeout=timeout)
    n = 1031
    t0 = time.monotonic()
    if ctx.rank == 0:
        works = [dist.isend(rand("g1", 0, n, torch.float64), 1, group=g1),
                 dist.isend(rand("g2", 0, n, torch.float64), 1, group=g2)]
        for w in works:
            w.wait()
    else:
        got1 = poison_(torch.empty(n, dtype=torch.float64))
        got2 = poison_(torch.empty(n, dtype=torch.float64))
        works = [dist.irecv(got2, 0, group=g2), dist.irecv(got1, 0, group=g1)]
        for w in works:
            w.wait()
        assert_bytes_equal(got1, rand("g1", 0, n, torch.float64), "group 1")
        assert_bytes_equal(got2, rand("g2", 0, n, torch.float64), "group 2")
    return time.monotonic() - t0


def test_p2p_first_ops_of_two_groups_in_opposite_orders():
    res = run_group(opposite_subgroups_body, 2, "sdma", env=ENV, timeout=3 * CONNECT_TIMEOUT_S,
                    pg_timeout_s=CONNECT_TIMEOUT_S)
    res.check()
    for rank, elapsed in enumerate(res.values()):
        assert elapsed < CONNECT_TIMEOUT_S / 2, f"rank {rank}: {elapsed:.1f} s"


def batch_refused_at_issue_body(ctx):
    """Both ranks' batch_isend_irecv holds an isend that torch_sdma refuses as it is issued (a non-contiguous tensor);
    then a synchronous all_gather_into_tensor on the same group, its output poisoned: it must move the bytes or
    raise."""
    torch.set_num_threads(1)
    peer = 1 - ctx.rank
    got = torch.zeros(64, dtype=torch.uint8)
    bad = torch.full((64, 2), ctx.rank + 1, dtype=torch.uint8)[:, 0]
    try:
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, bad, peer), dist.P2POp(dist.irecv, got, peer)]):
            w.wait()
        batch = None
    except Exception as e:  # noqa: BLE001
        batch = f"{type(e).__name__}: {e}"
    out = torch.full((128,), 0xA5, dtype=torch.uint8)
    try:
        dist.all_gather_into_tensor(out, torch.full((64,), ctx.rank + 1, dtype=torch.uint8))
        after = None
    except Exception as e:  # noqa: BLE001
        after = f"{type(e).__name__}: {e}"
    ctx.barrier_store("batch-refused-at-issue-done", timeout_s=60)
    expected = torch.cat([torch.full((64,), q + 1, dtype=torch.uint8) for q in range(2)])
    return batch, after, bool(torch.equal(out, expected))


# torch's _coalescing_manager, which batch_isend_irecv enters on a backend that supports coalescing (sdma does), has
# no finally: an op that raised as it was issued would leave the group's coalescing state open, and c10d would then
# record the group's all_gather_into_tensor (all_reduce, reduce_scatter_tensor) for a coalesced call that never comes:
# the call returns None at once, nothing moved. So inside a block an op's error is raised at the block's end, after
# torch closed its state (ProcessGroupSDMA::failP2pBatch). The fault soak met it as wrong bytes (soak_faults.py --calls
# 200 --timeout 2 --seed 102, episode 6: a send delegated to gloo raised inside a batch once the peer's gloo had closed
# its connection; that depends on timing, this does not).
def test_p2p_batch_refused_at_issue_leaves_the_group_working():
    res = run_group(batch_refused_at_issue_body, 2, "sdma", env=ENV, timeout=120, pg_timeout_s=10, destroy=False,
                    hard_exit=True, grace=60)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    for rank, (batch, after, exact) in enumerate(res.values()):
        assert batch is not None and "contiguous" in batch, f"rank {rank}: {batch}"
        assert after is not None or exact, f"rank {rank}: the all-gather after the batch returned without its bytes"


def inner_sizes_differ_body(ctx):
    """A send of 64 bytes met by a recv of 32, both below TORCH_SDMA_MIN_BYTES (the inner backend's): both raise."""
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
# tcp/pair.cc): the exception ends the receiving process by SIGABRT (std::terminate) instead of reaching the call.
@pytest.mark.xfail(strict=True, reason="a point-to-point size mismatch below TORCH_SDMA_MIN_BYTES goes to gloo, which "
                   "aborts the receiving process (SIGABRT) instead of raising")
def test_p2p_inner_sizes_differ_raise_on_both():
    res = run_group(inner_sizes_differ_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="1M"), timeout=120,
                    pg_timeout_s=10, destroy=False, hard_exit=True, grace=5)
    assert all(r.exitcode is not None and r.exitcode >= 0 for r in res.ranks), res.describe()
    for rank, err in enumerate(res.values()):
        assert err is not None, f"rank {rank}: no error"
