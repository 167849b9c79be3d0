"""GPU (2 GPUs; skipped elsewhere): the copy-engine all-gather, bit-exact against NCCL on random data
with poisoned outputs (every case of the protocol suite, bf16/fp8/complex, > staging, in-place, coalesced mixed
dtypes, 100 in flight on a side stream, two groups over the same GPUs at once), stream semantics (async_op=False
orders on the caller's stream, wait() and get_future() do not block the CPU, allocator safety), the zero-kernel
check with torch.profiler, a peer that never calls, and bad input with NCCL's exact errors."""
import re
import threading
import time

import pytest
import torch
import torch.distributed as dist

from checks.allgather import AG, allgather_cases, interleaved_groups_case, stats_cases
from checks.bad_input import bad_input_cases
from checks.data import DMA_KEYS, SHARE_GPU, assert_bytes_equal, poison_, rand, raw, stats_calls
from checks.trace import exported_events
from conftest import GPU_RANKS, cuda_count
from mp_harness import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_count() < GPU_RANKS, reason=f"needs {GPU_RANKS} CUDA devices"),
]

W = GPU_RANKS
# every all-gather of these tests must take the copy-engine path, whatever threshold the backend defaults to
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None}


def cuda_protocol_body(ctx, quick=False, staging=None):
    rank, dev = ctx.rank, ctx.device
    failed = 0
    world = dist.group.WORLD
    # Ranks sharing one GPU: no NCCL reference (NCCL refuses two ranks on one GPU); every case compares with the
    # inputs rebuilt locally from every rank's seed, which is what NCCL returns.
    ref = None if SHARE_GPU else dist.new_group(backend="nccl")
    side = torch.cuda.Stream(dev)
    cases = allgather_cases(world, ref, dev, "cuda", staging_bytes=staging, big=staging is not None, quick=quick,
                            in_flight_stream=side)
    if not quick:
        cases += stats_cases(world, ref, dev, "cuda", "cuda")
        cases += bad_input_cases(world, dev, "cuda", ref=ref, compare_messages=True)
    failed += ctx.run_cases(cases, barrier_tag="world")
    if staging is None:
        subs = [(r, dist.new_group(ranks=r), None if SHARE_GPU else dist.new_group(ranks=r, backend="nccl"))
                for r in ([1], [0])]
        for ranks, sg, sr in subs:
            if rank in ranks:
                tag = "sub" + "_".join(map(str, ranks))
                failed += ctx.run_cases(allgather_cases(sg, sr, dev, tag, quick=True, big=False),
                                        barrier_size=len(ranks), barrier_tag=tag)
        ctx.barrier_store("subs")
        g1, g2 = dist.new_group(), dist.new_group()
        failed += ctx.run_cases([interleaved_groups_case(g1, ref, g2, ref, dev, "il", n=12)], barrier_tag="il")
    return failed


# The default (all_gather_into_tensor on the direct path) in full; staging for every form once more, quick.
@pytest.mark.parametrize("init,quick,direct", [("cpu:gloo,cuda:sdma", False, None), ("cuda:sdma", True, "0"),
                                               ("sdma", True, None)])
def test_cuda_allgather_matches_nccl(init, quick, direct):
    res = run_group(cuda_protocol_body, W, init, kwargs={"quick": quick}, env=dict(ENV, TORCH_SDMA_DIRECT=direct),
                    cuda=True, timeout=540, pg_timeout_s=60)
    res.check()


def test_cuda_allgather_bigger_than_staging():
    res = run_group(cuda_protocol_body, W, "cpu:gloo,cuda:sdma", kwargs={"quick": True, "staging": 1 << 20},
                    env=dict(ENV, TORCH_SDMA_STAGING_BYTES="1M", TORCH_SDMA_DIRECT="0"), cuda=True, timeout=540,
                    pg_timeout_s=60)
    res.check()


# ------------------------------------------------------------------------------------ stream semantics
def _gemm_chain(dev, iters):
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64
    for _ in range(iters):
        a = a @ b
    return a


def _calibrate_chain(dev, target_s=0.4):
    _gemm_chain(dev, 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _gemm_chain(dev, 20)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 20
    iters = max(20, int(target_s / max(per, 1e-6)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _gemm_chain(dev, iters)
    torch.cuda.synchronize()
    return iters, time.perf_counter() - t0


def _trace_kinds(prof):
    kinds = {}
    names = {}
    for e in exported_events(prof):
        cat = str(e.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kinds[cat] = kinds.get(cat, 0) + 1
            names.setdefault(cat, set()).add(e.get("name", "")[:80])
    return kinds, {k: sorted(v)[:10] for k, v in names.items()}


def cuda_stream_body(ctx):
    import torch_sdma

    rank, dev = ctx.rank, ctx.device
    g = dist.group.WORLD
    ref = None if SHARE_GPU else dist.new_group(backend="nccl")
    ag = AG(g, ref, dev, "st")
    out_info = {}
    cases = []

    def get_future_does_not_block_cpu():
        # The body's first case, before any case made torch's stream pool: making it waits for the work queued on the
        # GPU, so a get_future() that took a pool stream held the CPU behind the spin below.
        n = 1 << 20
        name = "gfnb"
        x = ag.x(name, (n,), torch.float32)
        exp = ag.local_expected(name, (n,), torch.float32)
        out = poison_(torch.empty(W * n, device=dev), exp)
        dist.all_gather_into_tensor(torch.empty_like(out), x, group=g)  # connected first
        torch.cuda.synchronize()
        ctx.barrier_store(name)
        torch.cuda._sleep(1_000_000_000)  # about half a second on the caller's stream
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
        t0 = time.perf_counter()
        fut = w.get_future()
        t_future = time.perf_counter() - t0
        assert t_future < 0.1, f"get_future() held the CPU {t_future:.3f} s behind the caller's stream"
        fut.wait()
        torch.cuda.synchronize()
        assert_bytes_equal(out, exp, "after the future's wait()")

    cases.append(("get_future_does_not_block_cpu", get_future_does_not_block_cpu))

    def ordering(stream_kind, form):
        def fn():
            s = torch.cuda.current_stream(dev) if stream_kind == "current" else torch.cuda.Stream(dev)
            n = 1 << 20
            name = f"ord{stream_kind}{form}"
            src = ag.x(name, (n,), torch.float32)
            exp = ag.local_expected(name, (n,), torch.float32)
            torch.cuda.synchronize()
            ctx.barrier_store(name)
            with torch.cuda.stream(s):
                out = poison_(torch.empty(W * n, device=dev), exp)
                x = out.narrow(0, rank * n, n) if form == "inplace" else torch.empty(n, device=dev)
                x.fill_(-1.0)
                torch.cuda._sleep(200_000_000)  # the stream is busy: an unordered copy would read -1s
                x.copy_(src)
                if form == "list":
                    outs = list(out.chunk(W))
                    dist.all_gather(outs, x, group=g)
                else:
                    dist.all_gather_into_tensor(out, x, group=g)  # async_op=False: ordered on `s`
                y = out.clone()  # consumed right away on `s`, no synchronization in between
                out.fill_(0.0)
            torch.cuda.synchronize()
            assert_bytes_equal(y, exp, f"async_op=False on the {stream_kind} stream ({form})")

        return fn

    for sk in ("current", "side"):
        for form in ("into_tensor", "inplace", "list"):
            cases.append((f"ordering_async_op_false[{sk},{form}]", ordering(sk, form)))

    def wait_does_not_block_cpu():
        iters, t_chain = _calibrate_chain(dev)
        n = 8 << 20
        name = "wnb"
        x = ag.x(name, (n,), torch.bfloat16)
        exp = ag.local_expected(name, (n,), torch.bfloat16)
        out = poison_(torch.empty(W * n, dtype=torch.bfloat16, device=dev), exp)
        # Once at this size first: a group's first all-gather of a larger chunk connects larger staging with its
        # peers (once, as NCCL's first collective creates its communicator), which is not what this case times.
        dist.all_gather_into_tensor(torch.empty_like(out), x, group=g)
        torch.cuda.synchronize()
        ctx.barrier_store("wnb")
        _gemm_chain(dev, iters)  # the current stream is busy for about t_chain
        t0 = time.perf_counter()
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
        t_call = time.perf_counter() - t0
        t1 = time.perf_counter()
        w.wait()
        t_wait = time.perf_counter() - t1
        t2 = time.perf_counter()
        done_early = w.is_completed()
        t_poll = time.perf_counter() - t2
        torch.cuda.synchronize()
        out_info["wait"] = dict(t_chain=t_chain, t_call=t_call, t_wait=t_wait, t_poll=t_poll, done_early=done_early)
        assert t_call < t_chain / 4, f"enqueue blocked the CPU: {t_call:.3f}s, GEMM chain {t_chain:.3f}s"
        assert t_wait < t_chain / 4, f"wait() blocked the CPU: {t_wait:.3f}s, GEMM chain {t_chain:.3f}s"
        assert t_poll < 0.05, f"is_completed() took {t_poll:.3f}s"
        assert w.is_completed(), "is_completed() is False after the stream finished"
        assert_bytes_equal(out, exp, "after wait + synchronize")

    cases.append(("wait_does_not_block_cpu", wait_does_not_block_cpu))

    def future():
        n = 10007
        x = ag.x("fut", (n,), torch.float32)
        exp = ag.local_expected("fut", (n,), torch.float32)
        out = poison_(torch.empty(W * n, device=dev), exp)
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
        fut = w.get_future()
        v = fut.wait()
        assert isinstance(v, list) and len(v) >= 1 and all(isinstance(t, torch.Tensor) for t in v), v
        assert v[0].data_ptr() == out.data_ptr(), "the future's value is not [output tensor]"
        assert_bytes_equal(out, exp, "output after future.wait()")
        # as NCCL's: same structure (NCCL's future is only there where NCCL can run: not on a shared GPU)
        if ref is not None:
            ref_out = torch.empty(W * n, device=dev)
            rv = dist.all_gather_into_tensor(ref_out, x, group=ref, async_op=True).get_future().wait()
            assert len(rv) == len(v), (len(rv), len(v))
        # a DDP-comm-hook style chain
        out2 = poison_(torch.empty(W * n, device=dev), exp)
        w2 = dist.all_gather_into_tensor(out2, x, group=g, async_op=True)
        # clone(), not arithmetic: x * 1 turns NaN payloads of the random bytes into the canonical NaN
        chained = w2.get_future().then(lambda f: f.value()[0].clone())
        r = chained.wait()
        assert_bytes_equal(r, exp, "then() on the future")
        # list form
        outs = [poison_(torch.empty(n, device=dev)) for _ in range(W)]
        vl = dist.all_gather(outs, x, group=g, async_op=True).get_future().wait()
        assert isinstance(vl, list) and len(vl) >= 1, vl
        assert_bytes_equal(torch.cat([raw(t) for t in outs]), exp, "list form after future.wait()")

    cases.append(("get_future", future))

    def allocator_safety(async_op, drop):
        def fn():
            n = 4 << 20
            name = f"alloc{async_op}{drop}"
            x = ag.x(name, (n,), torch.float32)
            exp = ag.local_expected(name, (n,), torch.float32)
            out = poison_(torch.empty(W * n, device=dev), exp)
            torch.cuda.synchronize()
            ctx.barrier_store(name)
            if rank == 1:
                time.sleep(0.3)  # the peer is late: rank 0's copies are still pending when it drops its tensors
            torch.cuda._sleep(50_000_000)
            w = dist.all_gather_into_tensor(out, x, group=g, async_op=async_op)
            if drop == "input":
                del x
                junk = [torch.full((n,), 7.0, device=dev) for _ in range(6)]
            else:
                del out
                junk = [torch.full((W * n,), 7.0, device=dev) for _ in range(6)]
            if w is not None:
                w.wait()
            torch.cuda.synchronize()
            for j, t in enumerate(junk):
                assert bool((t == 7.0).all()), f"a tensor allocated after the call was overwritten (junk {j})"
            if drop == "input":
                assert_bytes_equal(out, exp, "kept output after the input was dropped and its memory reused")

        return fn

    for a in (True, False):
        for d in ("input", "output"):
            cases.append((f"allocator_safety[async={a},drop={d}]", allocator_safety(a, d)))

    def output_memory_returns_at_once(async_op):
        # FSDP2's CPU runs layers ahead of the GPU: an output the caller dropped must go back to the caching
        # allocator when it is dropped, as NCCL's does, not when the GPU gets to the copies.
        def fn():
            n = 16 << 20
            x = rand("mem", rank, (n,), torch.bfloat16, dev)
            left = {}
            for label, grp in (("nccl", ref), ("sdma", g)) if ref is not None else (("sdma", g),):
                torch.cuda.synchronize()
                ctx.barrier_store(f"mem{async_op}{label}")
                before = torch.cuda.memory_allocated(dev)
                torch.cuda._sleep(100_000_000)  # the copies are still queued when the tensors are dropped
                out = torch.empty(W * n, dtype=torch.bfloat16, device=dev)
                w = dist.all_gather_into_tensor(out, x, group=grp, async_op=async_op)
                if w is not None:
                    w.wait()
                del w, out
                left[label] = torch.cuda.memory_allocated(dev) - before
                torch.cuda.synchronize()
            # NCCL's figure can be negative (something unrelated was freed meanwhile): sdma must leave nothing.
            # Without NCCL (ranks sharing one GPU), nothing is the bound.
            bound = max(left["nccl"], 0) if "nccl" in left else 0
            assert left["sdma"] <= bound, f"bytes still allocated after the output was dropped: {left}"

        return fn

    for a in (False, True):
        cases.append((f"output_memory_returns_at_once[async={a}]", output_memory_returns_at_once(a)))

    g1, g2 = dist.new_group(), dist.new_group()

    def two_groups_two_streams():
        s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
        items = []
        for k in range(16):
            for gi, (grp, s) in enumerate(((g1, s1), (g2, s2))):
                shape = (5000 + 1000 * k,)
                dt = (torch.float32, torch.bfloat16, torch.uint8)[k % 3]
                name = f"tg{gi}.{k}"
                x = ag.x(name, shape, dt)
                e = ag.local_expected(name, shape, dt)
                o = poison_(torch.empty(W * shape[0], dtype=dt, device=dev), e)
                items.append((grp, s, x, e, o))
        torch.cuda.synchronize()
        works = []
        for grp, s, x, e, o in items:
            with torch.cuda.stream(s):
                works.append((s, dist.all_gather_into_tensor(o, x, group=grp, async_op=True)))
        for s, w in works:
            with torch.cuda.stream(s):
                w.wait()
        torch.cuda.synchronize()
        for k, (grp, s, x, e, o) in enumerate(items):
            assert_bytes_equal(o, e, f"two groups on two streams #{k}")

    cases.append(("two_groups_same_gpus_concurrently", two_groups_two_streams))

    def zero_kernels():
        from torch.profiler import ProfilerActivity, profile

        n = 8 << 20
        res = {}
        # NCCL's run (the profiler's sanity check) only where NCCL can run: not with two ranks on one GPU
        for label, grp in (("nccl", ref), ("sdma", g)) if ref is not None else (("sdma", g),):
            x = rand("zk", rank, (n,), torch.bfloat16, dev)
            outs = [torch.empty(W * n, dtype=torch.bfloat16, device=dev) for _ in range(5)]
            ins_inplace = [o.narrow(0, rank * n, n) for o in outs]
            lists = [list(torch.empty(W * n, dtype=torch.bfloat16, device=dev).chunk(W)) for _ in range(2)]
            for _ in range(3):  # warm-up
                dist.all_gather_into_tensor(outs[0], x, group=grp)
            torch.cuda.synchronize()
            ctx.barrier_store(f"zk{label}")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for o in outs:
                    dist.all_gather_into_tensor(o, x, group=grp)
                torch.cuda.synchronize()
            res[label] = _trace_kinds(prof)
            # the other forms, in steady state too
            for o, i in zip(outs, ins_inplace):
                i.copy_(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for o, i in zip(outs[:2], ins_inplace[:2]):
                    dist.all_gather_into_tensor(o, i, group=grp)
                for lst in lists:
                    dist.all_gather(lst, x, group=grp)
                w = dist.all_gather_into_tensor(outs[2], x, group=grp, async_op=True)
                w.wait()
                torch.cuda.synchronize()
            res[label + "_other_forms"] = _trace_kinds(prof)
        out_info["profile"] = {k: (v[0], v[1]) for k, v in res.items()}
        if "nccl" in res:
            nk, _ = res["nccl"]
            assert nk.get("kernel", 0) > 0, f"profiler sanity: NCCL all-gathers showed no kernel: {res['nccl']}"
        sk, snames = res["sdma"]
        assert sk.get("kernel", 0) == 0, f"sdma all-gathers ran CUDA kernels: {sk} {snames.get('kernel')}"
        assert sk.get("gpu_memcpy", 0) > 0, f"profiler saw no copies for sdma: {res['sdma']}"
        ok, onames = res["sdma_other_forms"]
        assert ok.get("kernel", 0) == 0, \
            f"in-place/list/async sdma all-gathers ran kernels: {ok} {onames.get('kernel')}"

    cases.append(("zero_kernels_profiler", zero_kernels))

    def stats_dma():
        assert torch_sdma.group_path(g, device="cuda") == "dma", torch_sdma.group_path(g, device="cuda")
        s = torch_sdma.stats(g)
        assert stats_calls(s, lambda k: k in DMA_KEYS)[0] > 0, s
        assert not any(k.startswith("inner:") for k in s), s

    cases.append(("stats_show_dma", stats_dma))
    n_failed = ctx.run_cases(cases)
    return {"failed": n_failed, "info": out_info}


def test_cuda_stream_semantics_and_zero_kernels():
    res = run_group(cuda_stream_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=540, pg_timeout_s=60)
    res.check()
    print(res.ranks[0].value["info"])


# ------------------------------------------------------------------------------------------- failure
PG_TIMEOUT_S = 10.0
SLACK_S = 20.0


def cuda_never_calls_body(ctx, async_op):
    rank, dev = ctx.rank, ctx.device
    n = 1 << 20
    x = torch.randn(n, device=dev)
    out = torch.empty(W * n, device=dev)
    dist.all_gather_into_tensor(out, x)  # warm-up: everything mapped
    torch.cuda.synchronize()
    ctx.barrier_store("warm")
    if rank == 1:
        deadline = time.monotonic() + PG_TIMEOUT_S + SLACK_S + 30
        while time.monotonic() < deadline and not ctx.store.check(["pub/done"]):
            time.sleep(0.1)
        return {"victim": True}
    t0 = time.monotonic()
    deadline = t0 + PG_TIMEOUT_S + SLACK_S
    err, where = None, None
    w = None
    try:
        w = dist.all_gather_into_tensor(out, x, async_op=async_op)
        if w is not None:
            w.wait()
    except Exception as e:  # noqa: BLE001
        err, where = e, "call/wait"
    # poll the work; then a synchronize (in a thread, so that a stream hung forever shows as such)
    while err is None and w is not None and time.monotonic() < deadline:
        try:
            if w.is_completed():
                # wait() re-raises the work's error, as NCCL's does. (Work.exception() is no use here: torch 2.11's
                # binding cannot convert the std::exception_ptr it returns.)
                w.wait()
                break
        except Exception as e:  # noqa: BLE001
            err, where = e, "is_completed/wait"
            break
        time.sleep(0.05)
    sync = {}

    def do_sync():
        try:
            torch.cuda.synchronize()
            sync["ok"] = True
        except Exception as e:  # noqa: BLE001
            sync["error"] = e

    th = threading.Thread(target=do_sync, daemon=True)
    th.start()
    th.join(max(1.0, deadline - time.monotonic()))
    stream_released = not th.is_alive()
    if err is None and "error" in sync:
        err, where = sync["error"], "torch.cuda.synchronize()"
    if err is None and stream_released:
        try:  # the error may be reported by the next collective of the group
            dist.all_gather_into_tensor(out, x, async_op=False)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            err, where = e, "next all-gather"
    elapsed = time.monotonic() - t0
    ctx.publish("done", 1)
    return {"error": None if err is None else f"{type(err).__name__}: {err}", "where": where,
            "elapsed": elapsed, "stream_released": stream_released}


def run_peer_never_calls(async_op, env):
    """Rank 1 never calls: rank 0's all-gather fails within the timeout naming it, and its stream runs on."""
    res = run_group(cuda_never_calls_body, W, "cpu:gloo,cuda:sdma", kwargs={"async_op": async_op}, env=env, cuda=True,
                    timeout=PG_TIMEOUT_S + SLACK_S + 120, pg_timeout_s=PG_TIMEOUT_S, destroy=False, hard_exit=True,
                    grace=PG_TIMEOUT_S + SLACK_S + 60)
    r0 = res.ranks[0]
    assert r0.status == "ok" and r0.exitcode == 0, res.describe(expect_dead=(1,))
    v = r0.value
    assert v["stream_released"], f"rank 0's stream is still blocked {v['elapsed']:.1f}s later: {v}"
    assert v["error"] is not None, f"no error although rank 1 never called: {v}"
    assert re.search(r"(peer|rank)[^\n]{0,60}\b1\b", v["error"], re.I), f"error does not name peer 1: {v}"
    assert v["elapsed"] <= PG_TIMEOUT_S + SLACK_S, v
    return v


@pytest.mark.parametrize("async_op", [True, False])
def test_cuda_peer_never_calls(async_op):
    run_peer_never_calls(async_op, ENV)
