"""GPU (2 GPUs; skipped elsewhere): what real training stacks do to the backend.
- CUDA graph capture of every all-gather form on the DMA path (torch.cuda.graph, global capture mode): replays
  bit-exact against NCCL with new input values each replay, eager calls on the same group before, between and
  after replays, an NCCL collective captured in the same graph, zero kernels in a replay (profiler), stats
  "dma:captured"; all_gather_tensor of the functional collectives inside torch.compile(mode="reduce-overhead").
- A capture of unrelated work while sdma all-gathers are in flight (the watchdog polls their events meanwhile).
- A watchdog that fails (TORCH_SDMA_TEST_FAULT=watchdog): its collectives fail with its message, later ones are
  refused, the process and the group's other collectives live on.
- Every dtype below and above TORCH_SDMA_MIN_BYTES in every form.
- Staging bounded across groups: eight groups over the same GPUs, one 64 MiB all-gather each, hold at most 512 MiB
  of staging per rank, and destroying them gives the device memory back."""
import os

import pytest
import torch
import torch.distributed as dist

from checks.allgather import dtype_sweep_cases
from checks.data import (
    NCCL_SHARED_REASON,
    SHARE_GPU,
    assert_bytes_equal,
    coalescing_manager,
    expected_concat,
    poison_,
    rand,
    raw,
)
from checks.faults import assert_refused_after
from conftest import GPU_RANKS, cuda_count
from mp_harness import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_count() < GPU_RANKS, reason=f"needs {GPU_RANKS} CUDA devices"),
]

W = GPU_RANKS
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_TEST_FAULT": None}
MIB = 1 << 20


class CapturedForms:
    """Static buffers of one all-gather per form, for a graph: fill(name) writes new inputs, check(name) compares
    every output with the locally rebuilt concatenation of every rank's inputs."""

    def __init__(self, g, dev, rank, n, dtype=torch.bfloat16):
        self.g, self.dev, self.rank, self.n, self.dtype = g, dev, rank, n, dtype
        self.x = torch.empty(n, dtype=dtype, device=dev)
        self.out = torch.empty(W * n, dtype=dtype, device=dev)
        self.out_inplace = torch.empty(W * n, dtype=dtype, device=dev)
        self.outs_list = [torch.empty(n, dtype=dtype, device=dev) for _ in range(W)]
        self.xs_cm = [torch.empty(n, dtype=dtype, device=dev), torch.empty(n // 2 + 3, dtype=dtype, device=dev)]
        self.outs_cm = [torch.empty(W * t.numel(), dtype=dtype, device=dev) for t in self.xs_cm]
        self.out_async = torch.empty(W * n, dtype=dtype, device=dev)

    def fill(self, name):
        with torch.no_grad():
            self.x.copy_(rand(f"{name}/x", self.rank, (self.n,), self.dtype, self.dev))
            self.out_inplace.narrow(0, self.rank * self.n, self.n).copy_(self.x)
            for k, t in enumerate(self.xs_cm):
                t.copy_(rand(f"{name}/cm{k}", self.rank, (t.numel(),), self.dtype, self.dev))
            for t in [self.out, self.out_async, *self.outs_list, *self.outs_cm]:
                poison_(t)
            for q in range(W):
                if q != self.rank:
                    poison_(self.out_inplace.narrow(0, q * self.n, self.n))

    def enqueue(self):
        """Every form once, on the current stream (the caller captures it)."""
        g = self.g
        dist.all_gather_into_tensor(self.out, self.x, group=g)
        dist.all_gather_into_tensor(self.out_inplace, self.out_inplace.narrow(0, self.rank * self.n, self.n), group=g)
        dist.all_gather(self.outs_list, self.x, group=g)
        with coalescing_manager(g):
            for o, i in zip(self.outs_cm, self.xs_cm):
                dist.all_gather_into_tensor(o, i, group=g)
        w = dist.all_gather_into_tensor(self.out_async, self.x, group=g, async_op=True)
        w.wait()

    def check(self, name, what):
        ranks = range(W)
        e = expected_concat(f"{name}/x", ranks, (self.n,), self.dtype)
        assert_bytes_equal(self.out, e, f"{what}: into tensor")
        assert_bytes_equal(self.out_inplace, e, f"{what}: in place")
        assert_bytes_equal(torch.cat([raw(t) for t in self.outs_list]), e, f"{what}: list")
        assert_bytes_equal(self.out_async, e, f"{what}: async_op=True")
        for k, t in enumerate(self.xs_cm):
            assert_bytes_equal(self.outs_cm[k], expected_concat(f"{name}/cm{k}", ranks, (t.numel(),), self.dtype),
                               f"{what}: coalesced [{k}]")


def process_device_bytes(dev):
    """Device memory this process holds on every GPU, by NVML's per-process accounting (staging is allocated
    outside torch's allocator), or None where NVML cannot say (no pynvml, another pid namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        used = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(i)):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    used = (used or 0) + int(p.usedGpuMemory)
        return used
    except Exception:  # noqa: BLE001
        return None


def _kernels_in(prof):
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in names if not n.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset"))]
    return kernels, names


def capture_body(ctx):
    from torch.profiler import ProfilerActivity, profile

    import torch_sdma

    rank, dev = ctx.rank, ctx.device
    g = dist.group.WORLD
    info = {}
    cases = []
    # Ranks sharing one GPU: the delegated NCCL all_reduce captured beside the all-gathers is left out (NCCL refuses
    # two ranks on one GPU); the all-gathers are captured and checked all the same.
    with_nccl = not SHARE_GPU
    if not with_nccl:
        info["left_out"] = f"the captured NCCL all_reduce: {NCCL_SHARED_REASON}"

    def replay_every_form(n, label, zero_kernels):
        def fn():
            forms = CapturedForms(g, dev, rank, n)
            side = torch.cuda.Stream(dev)
            nccl_in = torch.full((1024,), float(rank + 1), device=dev)
            # Warm-up on a side stream, as torch.cuda.graph asks: connects everything eagerly first.
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                forms.fill(f"{label}/warm")
                forms.enqueue()
                if with_nccl:
                    dist.all_reduce(nccl_in.clone(), group=g)  # NCCL, like sdma, must not connect inside a capture
            torch.cuda.synchronize()
            forms.check(f"{label}/warm", "eager warm-up")
            graph = torch.cuda.CUDAGraph()
            torch_sdma.reset_stats(g)
            with torch.cuda.graph(graph):
                forms.enqueue()
                if with_nccl:
                    dist.all_reduce(nccl_in, group=g)  # an NCCL collective (delegated) in the same graph
            s = torch_sdma.stats(g)
            captured = s.get("dma:captured", {}).get("calls", 0)
            assert captured >= 5 and not any(k.startswith(("inner:", "dma") ) and k != "dma:captured" for k in s), \
                f"captured all-gathers not all on the captured DMA path: {s}"
            for rep in range(3):
                forms.fill(f"{label}/rep{rep}")
                nccl_in.fill_(float(rank + 1))
                graph.replay()
                torch.cuda.synchronize()
                forms.check(f"{label}/rep{rep}", f"replay {rep}")
                if with_nccl:
                    assert torch.equal(nccl_in, torch.full_like(nccl_in, 3.0)), "captured NCCL all_reduce"
                # an eager call of the same group between replays, itself checked
                eager_in = rand(f"{label}/eager{rep}", rank, (n,), torch.bfloat16, dev)
                eager_out = poison_(torch.empty(W * n, dtype=torch.bfloat16, device=dev))
                dist.all_gather_into_tensor(eager_out, eager_in, group=g)
                torch.cuda.synchronize()
                assert_bytes_equal(eager_out, expected_concat(f"{label}/eager{rep}", range(W), (n,), torch.bfloat16),
                                   "eager call between replays")
            # zero kernels in a replay of the sdma all-gathers alone
            only = torch.cuda.CUDAGraph()
            with torch.cuda.graph(only):
                forms.enqueue()
            torch.cuda.synchronize()
            ctx.barrier_store(f"{label}/prof")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                only.replay()
                torch.cuda.synchronize()
            kernels, names = _kernels_in(prof)
            info[f"replay_gpu_events[{label}]"] = sorted(set(names))[:12]
            if zero_kernels:
                assert not kernels, f"a replay of captured sdma all-gathers ran kernels: {sorted(set(kernels))[:8]}"
            else:
                # At this size the driver may run the graph's local device-to-device copy nodes (own slot, drain)
                # as its own memcpy kernels (memcpy32_post, ...); peer copies stay on the copy engines.
                others = [k for k in kernels if not k.startswith("memcpy")]
                assert not others, f"a replay of captured sdma all-gathers ran kernels: {sorted(set(others))[:8]}"
            forms.fill(f"{label}/after")
            only.replay()
            torch.cuda.synchronize()
            forms.check(f"{label}/after", "replay of the second graph")
            del graph, only

        return fn

    # 1 MiB output: one chunk; 96 MiB: two chunks, pushed on a forked stream inside the graph.
    cases.append(("capture_replay_every_form[1MiB]", replay_every_form(256 * 1024, "small", zero_kernels=False)))
    cases.append(("capture_replay_every_form[96MiB]", replay_every_form(24 * MIB, "large", zero_kernels=True)))

    def unrelated_capture_beside_in_flight():
        a = torch.randn(2048, 2048, device=dev)
        torch.cuda.synchronize()
        ctx.barrier_store("inflight-warm")
        (a @ a).relu()  # cuBLAS and the kernels warm, as torch.cuda.graph asks
        torch.cuda.synchronize()
        n = 32 * MIB
        xs = [rand(f"inflight{k}", rank, (n,), torch.bfloat16, dev) for k in range(6)]
        outs = [poison_(torch.empty(W * n, dtype=torch.bfloat16, device=dev)) for _ in range(6)]
        side = torch.cuda.Stream(dev)
        torch.cuda.synchronize()
        ctx.barrier_store("inflight")
        if rank == 1:
            torch.cuda._sleep(200_000_000)  # rank 0's all-gathers wait for this one's: in flight for a while
        with torch.cuda.stream(side):
            works = [dist.all_gather_into_tensor(o, x, group=g, async_op=True) for o, x in zip(outs, xs)]
        graph = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream(dev)
        with torch.cuda.stream(cap):
            with torch.cuda.graph(graph, stream=cap):
                b = a @ a
                c = b.relu() + 1
        graph.replay()
        with torch.cuda.stream(side):
            for w in works:
                w.wait()
        torch.cuda.synchronize()
        assert torch.allclose(c, (a @ a).relu() + 1), "the captured matmuls"
        for k, o in enumerate(outs):
            assert_bytes_equal(o, expected_concat(f"inflight{k}", range(W), (n,), torch.bfloat16), f"in flight #{k}")

    cases.append(("unrelated_capture_beside_in_flight_all_gathers", unrelated_capture_beside_in_flight))

    def compiled_functional_all_gather():
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError as e:
            info["compile"] = f"skipped: {e}"
            return
        n = 4096

        def f(x):
            return funcol.all_gather_tensor(x + 1, 0, g) * 2

        compiled = torch.compile(f, mode="reduce-overhead")
        for step in range(4):
            x = rand(f"compile{step}", rank, (n,), torch.float32, dev, kind="int")
            got = compiled(x)
            torch.cuda.synchronize()
            want = (torch.cat([rand(f"compile{step}", q, (n,), torch.float32, "cpu", kind="int") for q in range(W)])
                    + 1) * 2
            assert torch.equal(got.cpu(), want), f"compiled all_gather_tensor, step {step}"
        info["compile_stats"] = torch_sdma.stats(g)

    cases.append(("torch_compile_reduce_overhead_all_gather_tensor", compiled_functional_all_gather))

    def staging_bounded_across_groups():
        def free():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return torch.cuda.mem_get_info(dev)[0]

        groups = [dist.new_group() for _ in range(8)]
        free_created = free()
        n = 32 * MIB // 2  # bf16: 32 MiB per rank, 64 MiB of output
        for k, grp in enumerate(groups):
            x = rand(f"bounded{k}", rank, (n,), torch.bfloat16, dev)
            out = poison_(torch.empty(W * n, dtype=torch.bfloat16, device=dev))
            dist.all_gather_into_tensor(out, x, group=grp)
            torch.cuda.synchronize()
            assert_bytes_equal(out, expected_concat(f"bounded{k}", range(W), (n,), torch.bfloat16), f"group {k}")
            del x, out
        total = sum(torch_sdma.staging_bytes(grp) for grp in groups)
        free_gathered, held = free(), process_device_bytes(dev)
        for grp in groups:
            dist.destroy_process_group(grp)
        del groups, grp
        free_destroyed, left = free(), process_device_bytes(dev)
        # The GPU's free memory moves with every other process on it (the suite runs its groups in parallel): it is
        # reported, not asserted. What this process holds on the device (NVML, per process) is asserted.
        info["staging"] = {"eight_groups_staging_bytes": total, "process_device_bytes_before_destroy": held,
                           "process_device_bytes_after_destroy": left,
                           "device_free_delta_all_gathers": free_created - free_gathered,
                           "device_free_delta_destroy": free_destroyed - free_gathered}
        assert total <= 512 * MIB, f"eight groups hold {total / MIB:.0f} MiB of staging per rank"
        if held is not None:
            assert held - left >= total, f"destroying the groups did not free their staging: {info['staging']}"

    cases.append(("staging_bounded_across_groups", staging_bounded_across_groups))

    failed = ctx.run_cases(cases)
    return {"failed": failed, "info": info}


def test_capture_and_replay_every_form_and_hardening():
    res = run_group(capture_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=540, pg_timeout_s=60)
    print(res.ranks[0].value["info"] if res.ranks[0].value else None)
    res.check()


def dtype_body(ctx):
    ref = dist.new_group(backend="nccl")
    os.environ["TORCH_SDMA_MIN_BYTES"] = str(64 << 10)
    try:
        g = dist.new_group()
    finally:
        os.environ.pop("TORCH_SDMA_MIN_BYTES")
    return ctx.run_cases(dtype_sweep_cases(g, ref, ctx.device, "gpusweep", 64 << 10))


def test_every_dtype_below_and_above_the_threshold_cuda():
    if SHARE_GPU:  # below the threshold every call goes to the inner NCCL; the sweep asserts both paths
        pytest.skip(NCCL_SHARED_REASON)
    run_group(dtype_body, W, "cpu:gloo,cuda:sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES=None), cuda=True,
              timeout=300, pg_timeout_s=60).check()


def watchdog_fault_body(ctx):
    import time

    import torch_sdma

    rank, dev = ctx.rank, ctx.device
    g = dist.group.WORLD
    n = MIB
    x = rand("wd", rank, (n,), torch.float32, dev)
    out = torch.empty(W * n, device=dev)
    first = None
    try:
        w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
    except Exception as e:  # noqa: BLE001  (the peer's watchdog failed first, and this rank learnt it at the call)
        first = str(e)
    deadline = time.monotonic() + 20
    while first is None and time.monotonic() < deadline:
        try:
            if w.is_completed():
                w.wait()
        except Exception as e:  # noqa: BLE001
            first = str(e)
        time.sleep(0.05)
    assert first is not None, "the all-gather whose watchdog failed never reported an error"
    # Its own watchdog's failure, or the peer's, which fails the group on every rank.
    own, peers = "watchdog thread failed", "failed the group: its watchdog failed"
    assert (own in first or peers in first) and "TORCH_SDMA_TEST_FAULT=watchdog" in first, first
    assert_refused_after("watchdog failed", out, x, g)
    if not SHARE_GPU:  # NCCL refuses two ranks on one GPU: the inner NCCL's survival is checked on two GPUs only
        y = torch.ones(10, device=dev)
        dist.all_reduce(y, group=g)  # the inner NCCL lives on
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.full((10,), float(W))), y
    return {"first": first, "stats": torch_sdma.stats(g)}


def test_watchdog_fault_fails_its_collectives_not_the_process():
    res = run_group(watchdog_fault_body, W, "cpu:gloo,cuda:sdma", env=dict(ENV, TORCH_SDMA_TEST_FAULT="watchdog"),
                    cuda=True, timeout=180, pg_timeout_s=30)
    res.check()
