"""Point-to-point failure cases on two ranks, on the device of the run (ctx.device: the CPU, or the rank's GPU).

Every tensor is made on that device. Where a body waits for an outcome on a GPU it polls: work.wait() there only
orders the current stream and does not block the caller, and a stream whose peer never comes stays held. So a body
polls work.is_completed() up to a deadline, then calls work.wait() (which raises the work's error), then polls the
current stream's query() up to a deadline and records how long it took to be released (None: still held). Bytes are
read to the CPU only once the stream is known released, and every input that comes from the host (rand(...,
device=dev), a copy that synchronizes the current stream) is made before the first op that may fail, so that a held
stream cannot block the body. On the CPU, waits are plain work.wait() and the stream is counted released at once
(0.0 s).

The bodies take their deadlines from the group's timeout (ctx.pg_timeout_s) plus `slack_s`."""
import time

import torch
import torch.distributed as dist

from checks.data import assert_bytes_equal, poison_, rand

SLACK_S = 20.0
BACKLOG_OPS = 1100  # more than a pair's ring of posts (1024)


# ---------------------------------------------------------------------------------------------------- helpers
def _error(e):
    return f"{type(e).__name__}: {e}".split("\nException raised from")[0]


def settle(works, dev, limit_s):
    """Waits for `works`: on the CPU with wait(); on a GPU by polling is_completed() until `limit_s` from now, then
    wait() on each, which raises the first error."""
    works = [w for w in works if w is not None]
    if dev.type == "cuda":
        deadline = time.monotonic() + limit_s
        for w in works:
            while not w.is_completed() and time.monotonic() < deadline:
                time.sleep(0.01)
    for w in works:
        w.wait()


def release_s(dev, limit_s):
    """Seconds until the current stream has nothing left to run (polled with query()), or None when it is still held
    `limit_s` later; 0.0 on the CPU."""
    if dev.type != "cuda":
        return 0.0
    stream = torch.cuda.current_stream(dev)
    t0 = time.monotonic()
    while not stream.query():
        if time.monotonic() - t0 > limit_s:
            return None
        time.sleep(0.01)
    return time.monotonic() - t0


def drained(dev, limit_s, what):
    """For a case that should succeed: the current stream is released within `limit_s`, else AssertionError."""
    if release_s(dev, limit_s) is None:
        raise AssertionError(f"{what}: the current stream was still held {limit_s:.0f} s later")


def on_host(t, released):
    """t on the CPU, or None when the stream that writes it was not released (reading it would block)."""
    return None if released is None else t.cpu()


def _polling_barrier(ctx, name, timeout_s):
    """A store barrier that never blocks the store's client: the pair's connect on the point-to-point worker reads
    through that same client (ctx.barrier_store's blocking wait would hold it)."""
    ctx.store.add(f"barrier/{name}", 1)
    deadline = time.monotonic() + timeout_s
    while int(ctx.store.add(f"barrier/{name}", 0)) < ctx.world:
        assert time.monotonic() < deadline, f"barrier {name} timed out"
        time.sleep(0.05)


def _connect_pair(r, dev, limit_s):
    """One send from rank 0 to rank 1, so that the pair is connected before what a test measures."""
    t = torch.full((4,), 7, dtype=torch.int32, device=dev) if r == 0 else torch.zeros(4, dtype=torch.int32, device=dev)
    settle([dist.isend(t, 1) if r == 0 else dist.irecv(t, 0)], dev, limit_s)
    drained(dev, limit_s, "connecting the pair")
    assert bool((t.cpu() == 7).all())


def _outcome(fn):
    """(seconds, error words or None) of fn()."""
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except Exception as e:  # noqa: BLE001
        err = _error(e)
    return time.monotonic() - t0, err


# ------------------------------------------------------------------------------------------------------ bodies
def refused_batch_body(ctx, slack_s=SLACK_S):
    """A batch_isend_irecv whose two sides pass different sizes fails; then a lone isend/irecv pair: every call raises
    (the failed batch failed the group, so the lone calls are refused), none kills its rank with a signal, and nothing
    of either arrives. Returns ([batch error, lone error], lone buffer touched (None: unread), [stream release s])."""
    torch.set_num_threads(1)
    dev, peer = ctx.device, 1 - ctx.rank
    limit = ctx.pg_timeout_s + slack_s
    n = 100 if ctx.rank == 0 else 200
    errors, released = [], []
    got = torch.zeros(n, dtype=torch.uint8, device=dev)
    try:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(n, dtype=torch.uint8, device=dev), peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        settle(works, dev, limit)
        errors.append(None)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    released.append(release_s(dev, limit))
    lone = torch.zeros(64, dtype=torch.uint8, device=dev)
    try:
        w = dist.isend(torch.ones(64, dtype=torch.uint8, device=dev), 1) if ctx.rank == 0 else dist.irecv(lone, 0)
        settle([w], dev, limit)
        errors.append(None)
    except Exception as e:  # noqa: BLE001
        errors.append(f"{type(e).__name__}: {e}")
    released.append(release_s(dev, limit))
    host = on_host(lone, released[-1])
    ctx.barrier_store("refused-batch-done", timeout_s=60 + 2 * limit)
    return errors, None if host is None else bool(host.any()), released


def any_source_body(ctx, slack_s=SLACK_S):
    """Rank 1 receives without a source while rank 0 sends: the recv either gets the bytes and names its source
    (gloo) or is refused at once with its buffer unwritten (the DMA path, NCCL), and then the send meets the recv from
    0 that follows. Returns (refusal, seconds to it, source, TORCH_SDMA_DELEGATE)."""
    import os

    torch.set_num_threads(1)
    dev, n = ctx.device, 4099
    limit = ctx.pg_timeout_s + slack_s
    sent = (torch.arange(n, dtype=torch.int32) * 7 + 3).to(dev)
    if ctx.rank == 0:
        dist.send(sent, 1)
        drained(dev, limit, "the send")
        ctx.barrier_store("any-source-done", timeout_s=2 * limit)
        return None
    got = torch.full((n,), -1, dtype=torch.int32, device=dev)
    t0 = time.monotonic()
    try:
        src = dist.recv(got)
        refused = None
    except Exception as e:  # noqa: BLE001
        src, refused = None, f"{type(e).__name__}: {e}"
    dt = time.monotonic() - t0
    if refused is not None:
        drained(dev, limit, "the refused recv")
        assert not bool((got.cpu() != -1).any()), "a refused recv wrote its buffer"
        dist.recv(got, 0)
    drained(dev, limit, "the recv")
    assert torch.equal(got.cpu(), sent.cpu())
    ctx.barrier_store("any-source-done", timeout_s=2 * limit)
    return refused, dt, src, os.environ.get("TORCH_SDMA_DELEGATE")


def refused_p2p_body(ctx, form, refuser_late, slack_s=SLACK_S):
    """Rank 1 refuses an op with rank 0 on its own arguments (a non-contiguous tensor; in a batch, its second op; with
    form "first", the pair's first op, so that the refusal connects the pair on the worker), catches the error and
    goes on with a valid send; rank 0 made the op that meets the refused one, outputs poisoned, before or after the
    refusal. Rank 0's op fails at once naming rank 1 and its error, instead of meeting rank 1's
    next send, and its buffers keep their poison; rank 1's next send is refused at once.
    Returns (dt, err, dt_after, after, poisoned (None: unread), [stream release s])."""
    torch.set_num_threads(1)
    dev = ctx.device
    r, peer, n = ctx.rank, 1 - ctx.rank, 4099
    limit = ctx.pg_timeout_s + slack_s
    if form != "first":
        # The pair connected first, with bytes that arrive whole.
        warm = poison_(torch.empty(n, dtype=torch.float32, device=dev))
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, rand("warm", r, n, torch.float32, device=dev), peer),
                                        dist.P2POp(dist.irecv, warm, peer)])
        settle(works, dev, limit)
        drained(dev, limit, "warm-up")
        assert_bytes_equal(warm, rand("warm", peer, n, torch.float32), "warm-up")
    if (r == 1) == refuser_late:
        time.sleep(1.0)  # the other rank's op goes first
    got = poison_(torch.empty(n, dtype=torch.float32, device=dev))
    bad, batched = rand("bad", r, 2 * n, torch.float32, device=dev)[::2], rand("b", r, n, torch.float32, device=dev)
    next_input = rand("next", r, n, torch.float32, device=dev)
    t0 = time.monotonic()
    # Rank 0 receives into `got`; rank 1 sends (or, in a batch, receives into) a non-contiguous tensor, refused.
    tensor = got if r == 0 else bad
    try:
        if form != "batch":
            settle([(dist.irecv if r == 0 else dist.isend)(tensor, 1 - r)], dev, limit)
        else:
            settle(dist.batch_isend_irecv([dist.P2POp(dist.isend, batched, 1 - r),
                                           dist.P2POp(dist.irecv, tensor, 1 - r)]), dev, limit)
        err = None
    except Exception as e:  # noqa: BLE001
        err = _error(e)
    dt = time.monotonic() - t0
    released = [release_s(dev, limit)]
    # The refusing rank's next op, and the one rank 0 makes to meet it.
    nxt = poison_(torch.empty(n, dtype=torch.float32, device=dev))
    t1 = time.monotonic()
    try:
        if r == 0:
            settle([dist.irecv(nxt, 1)], dev, limit)
        else:
            settle([dist.isend(next_input, 0)], dev, limit)
        after = None
    except Exception as e:  # noqa: BLE001
        after = _error(e)
    dt_after = time.monotonic() - t1
    released.append(release_s(dev, limit))
    _polling_barrier(ctx, "refused-p2p-done", 2 * ctx.pg_timeout_s + 2 * slack_s)
    poisoned = None
    if released[-1] is not None:
        poisoned = bool((got.cpu().view(torch.uint8) == 0xA5).all() and (nxt.cpu().view(torch.uint8) == 0xA5).all())
    return dt, err, dt_after, after, poisoned, released


def backlog_body(ctx, slack_s=SLACK_S):
    """Rank 0 makes more isends to rank 1 than the pair's ring holds, then an all-gather; rank 1 makes the all-gather
    first, then the irecvs, outputs poisoned. No isend waits for rank 1 (they return at once, the posts that do not
    fit queued on rank 0's worker), every byte arrives, and the all-gather completes. Returns (slowest isend s,
    total s)."""
    torch.set_num_threads(1)
    dev = ctx.device
    r, n = ctx.rank, 33
    limit = ctx.pg_timeout_s + slack_s
    _connect_pair(r, dev, limit)
    ag = poison_(torch.empty(2 * n, dtype=torch.float32, device=dev))
    mine = rand("ag", r, n, torch.float32, device=dev)
    inputs = [rand(f"backlog{i}", 0, n + i % 5, torch.int32, device=dev) for i in range(BACKLOG_OPS)] if r == 0 else []
    slowest = 0.0
    t0 = time.monotonic()
    if r == 0:
        works = []
        for x in inputs:
            t = time.monotonic()
            works.append(dist.isend(x, 1))
            slowest = max(slowest, time.monotonic() - t)
        dist.all_gather_into_tensor(ag, mine)
        settle(works, dev, limit)
        drained(dev, limit, "the isends")
    else:
        dist.all_gather_into_tensor(ag, mine)
        got = [poison_(torch.empty(n + i % 5, dtype=torch.int32, device=dev)) for i in range(BACKLOG_OPS)]
        works = [dist.irecv(g, 0) for g in got]
        settle(works, dev, limit)
        drained(dev, limit, "the irecvs")
        for i, g in enumerate(got):
            assert_bytes_equal(g, rand(f"backlog{i}", 0, n + i % 5, torch.int32), f"isend {i}")
    assert_bytes_equal(ag, torch.cat([rand("ag", q, n, torch.float32) for q in range(2)]), "all-gather")
    return slowest, time.monotonic() - t0


def backlog_never_met_body(ctx, slack_s=SLACK_S):
    """As above, but rank 1 never makes the irecvs: every isend still returns at once, and every wait() raises within
    the group's timeout (and some slack), the first naming rank 1. Returns (slowest isend s, seconds to the last
    error, errors, stream release s) on rank 0."""
    torch.set_num_threads(1)
    dev = ctx.device
    limit = ctx.pg_timeout_s + slack_s
    _connect_pair(ctx.rank, dev, limit)
    errors, slowest, released = [], 0.0, 0.0
    inputs = [rand(f"never{i}", 0, 16, torch.int32, device=dev) for i in range(BACKLOG_OPS)] if ctx.rank == 0 else []
    t0 = time.monotonic()
    if ctx.rank == 0:
        works = []
        for x in inputs:
            t = time.monotonic()
            works.append(dist.isend(x, 1))
            slowest = max(slowest, time.monotonic() - t)
        deadline = time.monotonic() + limit
        for w in works:
            try:
                settle([w], dev, max(0.0, deadline - time.monotonic()))
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                errors.append(_error(e))
    elapsed = time.monotonic() - t0
    if ctx.rank == 0:
        released = release_s(dev, limit)
    ctx.barrier_store("never-met-done", timeout_s=3 * ctx.pg_timeout_s + 60 + 2 * slack_s)
    return slowest, elapsed, errors, released


def first_op_beside_collective_body(ctx, slack_s=SLACK_S):
    """The pair's first op made while the peer is inside the group's first all-gather: rank 0 isends, then gathers;
    rank 1 gathers, then irecvs into a poisoned buffer. The isend returns without waiting for rank 1 to connect, the
    all-gather completes on both, and the bytes arrive whole. Returns (seconds the op took to return, total s)."""
    torch.set_num_threads(1)
    dev = ctx.device
    r, n = ctx.rank, 4099
    limit = ctx.pg_timeout_s + slack_s
    ag = poison_(torch.empty(2 * n, dtype=torch.float32, device=dev))
    mine = rand("ag", r, n, torch.float32, device=dev)
    if r == 0:
        x = rand("first", 0, n, torch.int64, device=dev)
        t0 = time.monotonic()
        w = dist.isend(x, 1)
        returned = time.monotonic() - t0
        dist.all_gather_into_tensor(ag, mine)
        settle([w], dev, limit)
        drained(dev, limit, "the isend and the all-gather")
    else:
        t0 = time.monotonic()
        dist.all_gather_into_tensor(ag, mine)
        got = poison_(torch.empty(n, dtype=torch.int64, device=dev))
        t = time.monotonic()
        w = dist.irecv(got, 0)
        returned = time.monotonic() - t
        settle([w], dev, limit)
        drained(dev, limit, "the all-gather and the irecv")
        assert_bytes_equal(got, rand("first", 0, n, torch.int64), "the pair's first op")
    assert_bytes_equal(ag, torch.cat([rand("ag", q, n, torch.float32) for q in range(2)]), "all-gather")
    return returned, time.monotonic() - t0


def opposite_subgroups_body(ctx, slack_s=SLACK_S):
    """Two groups over the same two ranks, whose pairs' first ops come in opposite orders: rank 0 isends on g1, then
    on g2; rank 1 irecvs on g2, then on g1. Neither call waits for the other rank to connect, so both complete with
    their bytes, long before the groups' timeout. Returns the seconds it took."""
    import datetime

    torch.set_num_threads(1)
    dev = ctx.device
    limit = ctx.pg_timeout_s + slack_s
    timeout = datetime.timedelta(seconds=ctx.pg_timeout_s)
    g1 = dist.new_group([0, 1], timeout=timeout)
    g2 = dist.new_group([0, 1], timeout=timeout)
    n = 1031
    t0 = time.monotonic()
    if ctx.rank == 0:
        x1, x2 = rand("g1", 0, n, torch.float64, device=dev), rand("g2", 0, n, torch.float64, device=dev)
        settle([dist.isend(x1, 1, group=g1), dist.isend(x2, 1, group=g2)], dev, limit)
        drained(dev, limit, "the isends")
    else:
        got1 = poison_(torch.empty(n, dtype=torch.float64, device=dev))
        got2 = poison_(torch.empty(n, dtype=torch.float64, device=dev))
        settle([dist.irecv(got2, 0, group=g2), dist.irecv(got1, 0, group=g1)], dev, limit)
        drained(dev, limit, "the irecvs")
        assert_bytes_equal(got1, rand("g1", 0, n, torch.float64), "group 1")
        assert_bytes_equal(got2, rand("g2", 0, n, torch.float64), "group 2")
    return time.monotonic() - t0


def batch_refused_at_issue_body(ctx, slack_s=SLACK_S):
    """Both ranks' batch_isend_irecv holds an isend that torch_sdma refuses as it is issued (a non-contiguous tensor);
    then a synchronous all_gather_into_tensor on the same group, its output poisoned: it must move the bytes or
    raise. On a GPU an error found after the call returned comes from the group's next call, a second all-gather.
    Returns (batch error, all-gather error, bytes exact (None: unread), next call's error, [stream release s])."""
    torch.set_num_threads(1)
    dev, peer = ctx.device, 1 - ctx.rank
    limit = ctx.pg_timeout_s + slack_s
    got = torch.zeros(64, dtype=torch.uint8, device=dev)
    bad = torch.full((64, 2), ctx.rank + 1, dtype=torch.uint8, device=dev)[:, 0]
    try:
        settle(dist.batch_isend_irecv([dist.P2POp(dist.isend, bad, peer), dist.P2POp(dist.irecv, got, peer)]), dev,
               limit)
        batch = None
    except Exception as e:  # noqa: BLE001
        batch = f"{type(e).__name__}: {e}"
    released = [release_s(dev, limit)]
    out = torch.full((128,), 0xA5, dtype=torch.uint8, device=dev)
    try:
        dist.all_gather_into_tensor(out, torch.full((64,), ctx.rank + 1, dtype=torch.uint8, device=dev))
        after = None
    except Exception as e:  # noqa: BLE001
        after = f"{type(e).__name__}: {e}"
    released.append(release_s(dev, limit))
    host = on_host(out, released[-1])
    expected = torch.cat([torch.full((64,), q + 1, dtype=torch.uint8) for q in range(2)])
    exact = None if host is None else bool(torch.equal(host, expected))
    later = None
    if dev.type == "cuda" and after is None and exact is False:
        try:
            w = dist.all_gather_into_tensor(torch.empty(128, dtype=torch.uint8, device=dev),
                                            torch.zeros(64, dtype=torch.uint8, device=dev), async_op=True)
            settle([w], dev, limit)
        except Exception as e:  # noqa: BLE001
            later = f"{type(e).__name__}: {e}"
        released.append(release_s(dev, limit))
    ctx.barrier_store("batch-refused-at-issue-done", timeout_s=60 + 3 * limit)
    return batch, after, exact, later, released


def sizes_differ_then_lone_body(ctx, slack_s=SLACK_S):
    """A send of 1,001 bytes met by a recv of 1,000 (uint8): both raise within the group's timeout plus slack; then a
    lone isend/irecv of 64 bytes on the same group: each raises (refused, the group failed) or moves its bytes.
    Returns {"first": (s, error), "lone": (s, error), "exact": lone bytes right (None: unread or not a recv),
    "released": [stream release s]}."""
    torch.set_num_threads(1)
    dev, r = ctx.device, ctx.rank
    limit = ctx.pg_timeout_s + slack_s
    out = {"released": [], "exact": None}
    n = 1001 if r == 0 else 1000
    buf = torch.zeros(n, dtype=torch.uint8, device=dev)
    if r == 0:
        buf.fill_(1)
    lone = rand("lone", 0, 64, torch.uint8, device=dev) if r == 0 else poison_(torch.empty(64, dtype=torch.uint8,
                                                                                            device=dev))
    out["first"] = _outcome(lambda: settle([dist.isend(buf, 1) if r == 0 else dist.irecv(buf, 0)], dev, limit))
    out["released"].append(release_s(dev, limit))
    out["lone"] = _outcome(lambda: settle([dist.isend(lone, 1) if r == 0 else dist.irecv(lone, 0)], dev, limit))
    out["released"].append(release_s(dev, limit))
    host = on_host(lone, out["released"][-1])
    if r == 1 and host is not None:
        out["exact"] = bool(torch.equal(host, rand("lone", 0, 64, torch.uint8)))
    ctx.barrier_store("sizes-then-lone-done", timeout_s=60 + 2 * limit)
    return out


def halo_body(ctx, slack_s=SLACK_S):
    """Both ranks isend to the other, then irecv from it (same size, not in a batch), outputs poisoned: each rank gets
    the right bytes or an error within the group's timeout plus slack, and its isend's input keeps its bytes. Returns
    {"send": (s, error), "recv": (s, error), "exact": bytes right, "input_intact": the isend's input unchanged (both
    None: unread), "released": stream release s}."""
    torch.set_num_threads(1)
    dev, r, peer, n = ctx.device, ctx.rank, 1 - ctx.rank, 4099
    limit = ctx.pg_timeout_s + slack_s
    x = rand("halo", r, n, torch.float32, device=dev)
    got = poison_(torch.empty(n, dtype=torch.float32, device=dev))
    out = {}
    t0 = time.monotonic()
    works = {}
    for key, issue in (("send", lambda: dist.isend(x, peer)), ("recv", lambda: dist.irecv(got, peer))):
        try:
            works[key] = issue()
        except Exception as e:  # noqa: BLE001
            out[key] = (time.monotonic() - t0, _error(e))
    for key, w in works.items():
        try:
            settle([w], dev, max(0.0, t0 + limit - time.monotonic()))
            err = None
        except Exception as e:  # noqa: BLE001
            err = _error(e)
        out[key] = (time.monotonic() - t0, err)
    out["released"] = release_s(dev, limit)
    host = on_host(got, out["released"])
    sent = on_host(x, out["released"])

    def same(t, q):
        return None if t is None else bool(torch.equal(t.view(torch.uint8), rand("halo", q, n, torch.float32).view(
            torch.uint8)))

    out["exact"], out["input_intact"] = same(host, peer), same(sent, r)
    ctx.barrier_store("halo-done", timeout_s=60 + 2 * limit)
    return out


def mixed_devices_batch_body(ctx, slack_s=SLACK_S):
    """On a group of "sdma" for both devices, both ranks make a batch_isend_irecv of a CPU isend and a CUDA irecv,
    which raises on the rank that made it (caught); then rank 0 isends a CUDA tensor that rank 1 irecvs: each op moves
    its bytes or raises within the group's timeout plus slack. Returns {"batch": error, "lone": (s, error),
    "exact": rank 1's bytes right (None: unread or rank 0), "released": [stream release s]}."""
    torch.set_num_threads(1)
    dev, r, peer, n = ctx.device, ctx.rank, 1 - ctx.rank, 1031
    limit = ctx.pg_timeout_s + slack_s
    out = {"released": [], "exact": None}
    cpu_x = rand("mixed", r, n, torch.int32)
    cuda_got = poison_(torch.empty(n, dtype=torch.int32, device=dev))
    lone = rand("mixed-lone", 0, n, torch.int32, device=dev) if r == 0 else \
        poison_(torch.empty(n, dtype=torch.int32, device=dev))
    try:
        settle(dist.batch_isend_irecv([dist.P2POp(dist.isend, cpu_x, peer), dist.P2POp(dist.irecv, cuda_got, peer)]),
               dev, limit)
        out["batch"] = None
    except Exception as e:  # noqa: BLE001
        out["batch"] = _error(e)
    out["released"].append(release_s(dev, limit))
    out["lone"] = _outcome(lambda: settle([dist.isend(lone, 1) if r == 0 else dist.irecv(lone, 0)], dev, limit))
    out["released"].append(release_s(dev, limit))
    host = on_host(lone, out["released"][-1])
    if r == 1 and host is not None:
        out["exact"] = bool(torch.equal(host, rand("mixed-lone", 0, n, torch.int32)))
    ctx.barrier_store("mixed-devices-done", timeout_s=60 + 2 * limit)
    return out


def in_place_all_to_all_body(ctx, slack_s=SLACK_S):
    """all_to_all_single with one tensor as input and output (even splits sync and async, uneven splits): per form,
    (name, error or None, seconds, stream release s, bytes right: each rank holds what its peers' inputs held before
    the call, rebuilt from their seeds; None: unread)."""
    torch.set_num_threads(1)
    dev, W, r, n = ctx.device, ctx.world, ctx.rank, 1031
    limit = ctx.pg_timeout_s + slack_s
    results = []

    def sends(src, dst):  # elements src sends dst: symmetric, so each rank's input and output sizes agree
        return (src + dst + 1) * 7

    forms = []
    for async_op in (False, True):
        name = f"inplace:even:{async_op}"
        want = torch.cat([rand(name, q, W * n, torch.float32)[r * n:(r + 1) * n] for q in range(W)])
        forms.append((name, rand(name, r, W * n, torch.float32, device=dev), {}, async_op, want))
    splits = [sends(r, p) for p in range(W)]
    want = []
    for q in range(W):
        start = sum(sends(q, p) for p in range(r))
        theirs = rand("inplace:uneven", q, sum(sends(q, p) for p in range(W)), torch.int32)
        want.append(theirs[start:start + sends(q, r)])
    forms.append(("inplace:uneven", rand("inplace:uneven", r, sum(splits), torch.int32, device=dev),
                  {"output_split_sizes": splits, "input_split_sizes": splits}, False, torch.cat(want)))
    for name, x, kw, async_op, want in forms:
        def call(x=x, kw=kw, async_op=async_op):
            w = dist.all_to_all_single(x, x, async_op=async_op, **kw)
            settle([w] if async_op else [], dev, limit)

        dt, err = _outcome(call)
        released = release_s(dev, limit)
        host = on_host(x, released)
        exact = None if host is None else bool(torch.equal(host.view(torch.uint8), want.view(torch.uint8)))
        results.append((name, err, dt, released, exact))
    ctx.barrier_store("in-place-done", timeout_s=60 + 4 * limit)
    return results
