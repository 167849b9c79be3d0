"""GPU (2 GPUs, or one with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): the exchange collectives on the copy engines.
The cases of test_exchange_cpu.py on CUDA tensors (every op, root, dtype, sync and async among all-gathers, local bad
input, stats and group_path(op=...) on "dma:direct", mistakes across ranks); stream semantics (a synchronous call
orders after the caller's stream and before what follows on it, on the current and on a side stream; an async call
issued on a side stream and waited on the current one); no CUDA kernel for any of them in a torch.profiler trace
(copies only); a short randomized soak (soak_exchange.py) over the current and side streams and two groups. Expected
bytes are always rebuilt locally from every rank's seed (NCCL is never the reference: it refuses two ranks on one
GPU)."""
import pytest
import torch
import torch.distributed as dist
from soak_exchange import SoakOptions, run_soak, summary_line

from checks.exchange import (
    EX,
    OPS,
    bad_input_cases,
    check,
    exchange_cases,
    mistake_problems,
    mistakes_summary,
    run_mistakes,
    settle,
    stats_cases,
)
from checks.trace import exported_events
from conftest import GPU_RANKS, cuda_count
from mp_harness import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_count() < GPU_RANKS, reason=f"needs {GPU_RANKS} CUDA devices"),
]

W = GPU_RANKS
# every exchange of these tests must take the copy-engine path, whatever threshold the backend defaults to
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
MISTAKE_TIMEOUT_S = 10.0
SLACK_S = 20.0


def cuda_exchange_body(ctx, quick):
    dev = ctx.device
    cases = exchange_cases(dist.group.WORLD, dev, "cuda", quick=quick)
    if not quick:
        cases += bad_input_cases(dist.group.WORLD, dev, "cuda") + stats_cases(dev, "cuda", "cuda")
    return ctx.run_cases(cases)


@pytest.mark.parametrize("init,quick", [("cpu:gloo,cuda:sdma", False), ("sdma", True)])
def test_cuda_exchange_matches_local_bytes(init, quick):
    run_group(cuda_exchange_body, W, init, kwargs={"quick": quick}, env=ENV, cuda=True, timeout=540,
              pg_timeout_s=60).check()


# ------------------------------------------------------------------------------------ stream semantics
MIX = ("all_to_all_single", "all_to_all_single_even", "all_to_all", "broadcast", "gather", "scatter")


def cuda_stream_body(ctx):
    dev = ctx.device
    ex = EX(dist.group.WORLD, dev, "streams")
    cases = []

    def ordering(op, stream_kind):
        """Inputs written on the stream only after a spin, the call synchronous, its outputs read on the stream right
        after it and overwritten: the bytes read are the call's only if the call ran after the inputs and before the
        reads, in the stream's order."""

        def fn():
            s = torch.cuda.current_stream(dev) if stream_kind == "current" else torch.cuda.Stream(dev)
            torch.cuda.synchronize(dev)
            ctx.barrier_store(f"ord{op}{stream_kind}")
            with torch.cuda.stream(s):
                ex.late_inputs_cycles = 100_000_000
                try:
                    it = ex.any_op(op, f"ord{op}{stream_kind}", torch.float32, 1, n=1 << 18)
                finally:
                    ex.late_inputs_cycles = 0
                kept = []
                for what, t, e in it.checks:
                    kept.append((what, t.clone(), e))
                    if t.numel():
                        t.reshape(-1).view(torch.uint8).fill_(0x5A)
                it.checks = kept
            torch.cuda.synchronize(dev)
            check(it)

        return fn

    def async_on_side_waited_on_current(op):
        def fn():
            s = torch.cuda.Stream(dev)
            torch.cuda.synchronize(dev)
            with torch.cuda.stream(s):
                ex.late_inputs_cycles = 50_000_000
                try:
                    items = [ex.any_op(op, f"side{op}{k}", torch.bfloat16, k, async_op=True, n=1 << 16)
                             for k in range(3)]
                finally:
                    ex.late_inputs_cycles = 0
            for it in items:  # on the current stream
                it.work.wait()
                it.checks = [(what, t.clone(), e) for what, t, e in it.checks]
                it.work = None
            torch.cuda.synchronize(dev)
            bad = settle(items)
            assert not bad, "\n".join(bad[:6])

        return fn

    for op in MIX:
        for sk in ("current", "side"):
            cases.append((f"ordering_async_op_false[{op},{sk}]", ordering(op, sk)))
        cases.append((f"async_on_side_waited_on_current[{op}]", async_on_side_waited_on_current(op)))
    return ctx.run_cases(cases)


def test_cuda_exchange_stream_semantics():
    run_group(cuda_stream_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=540, pg_timeout_s=60).check()


# ------------------------------------------------------------------------------------ no kernels
def _trace_kinds(prof):
    kinds, names = {}, {}
    for e in exported_events(prof):
        cat = str(e.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kinds[cat] = kinds.get(cat, 0) + 1
            names.setdefault(cat, set()).add(e.get("name", "")[:80])
    return kinds, {k: sorted(v)[:10] for k, v in names.items()}


PROFILED = ("all_to_all_single", "all_to_all_single_even", "all_to_all", "broadcast", "gather", "scatter")


def cuda_zero_kernels_body(ctx):
    from torch.profiler import ProfilerActivity, profile

    dev = ctx.device
    ex = EX(dist.group.WORLD, dev, "prof")
    info = {}

    def fn():
        # warm-up: every op connected and its memory known, as in steady state
        for k in range(2):
            check([ex.any_op(op, f"warm{op}{k}", torch.bfloat16, k, n=1 << 20) for op in PROFILED])
        # the tensors are made before the profile, which holds the calls alone
        ex.deferred = []
        items = [ex.any_op(op, f"p{op}{k}", torch.bfloat16, k, async_op=k == 1, n=1 << 20)
                 for k in range(2) for op in PROFILED]
        torch.cuda.synchronize(dev)
        ctx.barrier_store("profile")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ex.run_deferred()
            for it in items:
                if it.work is not None:
                    it.work.wait()
                    it.work = None
            torch.cuda.synchronize(dev)
        kinds, names = _trace_kinds(prof)
        info["profile"] = (kinds, names)
        check(items)
        assert kinds.get("kernel", 0) == 0, f"the exchange ops ran CUDA kernels: {kinds} {names.get('kernel')}"
        assert kinds.get("gpu_memcpy", 0) > 0, f"the profiler saw no copies: {kinds} {names}"

    failed = ctx.run_cases([("zero_kernels_profiler", fn)])
    return {"failed": failed, "info": info}


def test_cuda_exchange_runs_no_kernel():
    res = run_group(cuda_zero_kernels_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=300,
                    pg_timeout_s=60).check()
    print(res.ranks[0].value["info"])


# ------------------------------------------------------------------------------------ mistakes
def cuda_mistakes_body(ctx):
    return run_mistakes(ctx, ctx.device, MISTAKE_TIMEOUT_S, SLACK_S)


def test_cuda_exchange_mistakes_raise_on_every_rank():
    res = run_group(cuda_mistakes_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True,
                    timeout=MISTAKE_TIMEOUT_S + SLACK_S + 120, pg_timeout_s=60, destroy=False, hard_exit=True,
                    grace=MISTAKE_TIMEOUT_S + SLACK_S + 30)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    print(mistakes_summary(values))
    problems = mistake_problems(values, MISTAKE_TIMEOUT_S, SLACK_S)
    assert not problems, "\n".join(problems) + "\n" + mistakes_summary(values)


# ------------------------------------------------------------------------------------ soak
def cuda_soak_body(ctx, opts):
    return run_soak(opts, ctx.device)


def test_cuda_exchange_soak():
    """The exchange soak on CUDA tensors, its send/recv and batch_isend_irecv ring forms among the exchanges."""
    opts = SoakOptions(seed=20261125, calls=3000, max_bytes=4 << 20, pg_timeout_s=60)
    res = run_group(cuda_soak_body, W, "cpu:gloo,cuda:sdma", env=ENV, kwargs={"opts": opts}, cuda=True,
                    timeout=420, pg_timeout_s=60).check()
    s = res.values()[0]
    print(summary_line(s))
    assert s["calls"] == opts.calls, s
    assert set(s["forms"]) == set(s["forms_run"]), s
    assert "send_recv" in s["forms"] and "p2p_ring" in s["forms"], s["forms"]
    inner = [k for k in s["world_paths"] if k.split(":")[0] in OPS and ":inner:" in k]
    assert not inner, f"exchange calls on the inner backend: {s['world_paths']}"



# ------------------------------------------------------------------------------------ relayed broadcast
def cuda_relayed_broadcast_body(ctx):
    """Broadcasts large enough to be relayed through the ranks (more than two ranks), from every root, of sizes that
    cut into uneven chunks, sync and async, with ranks made late at random so that pairs settle both ways (a rank
    that pulls the tensor from the root, a rank that pulls chunks from the previous one): every byte the root's."""
    import random
    import time

    dev = ctx.device
    rng = random.Random(1000 + ctx.rank)
    sizes = [4 << 20, (4 << 20) + 4098, 17 << 20, 64 << 20]
    done = 0
    for rnd in range(3):
        for root in range(ctx.world):
            for n in sizes:
                gen = torch.Generator(device="cpu").manual_seed(hash((rnd, root, n)) & 0xFFFFFFFF)
                want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(dev)
                t = want.clone() if ctx.rank == root else torch.full((n,), 0xA5, dtype=torch.uint8, device=dev)
                if rng.random() < 0.5:
                    time.sleep(rng.random() * 0.01)  # this rank late by up to 10 ms
                work = dist.broadcast(t, src=root, async_op=bool(rnd % 2))
                if work is not None:
                    work.wait()
                assert torch.equal(t, want), f"round {rnd} root {root} {n} bytes: not the root's bytes"
                done += 1
    torch.cuda.synchronize(dev)
    return {"broadcasts": done, "path": torch_sdma_path()}


def torch_sdma_path():
    import torch_sdma

    return torch_sdma.group_path(op="broadcast")


def test_cuda_relayed_broadcast_every_root_late_ranks():
    res = run_group(cuda_relayed_broadcast_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=420,
                    pg_timeout_s=60).check()
    print(res.values()[0])
    assert all(v["broadcasts"] == 3 * W * 4 for v in res.values())
    want = "dma:relayed" if W > 2 else "dma:direct"
    assert all(v["path"] == want for v in res.values()), [v["path"] for v in res.values()]
