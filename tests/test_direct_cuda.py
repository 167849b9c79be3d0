"""GPU (2 GPUs; skipped elsewhere): the copy-engine direct path (TORCH_SDMA_DIRECT=1), which copies
between the ranks' own buffers without staging.
- all_gather_into_tensor out of place and in place, synchronous and async, from one element to 24 Mi, bit-exact
  against the locally rebuilt concatenation of every rank's random input, outputs poisoned first; stats count every
  call as "dma:direct"; the other forms still take staging ("dma").
- A rank that drops its input and output right after an async call, and reuses the memory before wait(): the Work
  keeps them, the peer's bytes still land, nothing is overwritten.
- Communication buffers from the backend's allocate_tensor (the pool FSDP2 uses after
  set_allocate_memory_from_process_group_for_comm), gathered in place, with empty_cache() between.
- FSDP2 with set_allocate_memory_from_process_group_for_comm: losses bit-identical with the same training on NCCL.
- Allocator churn: 10^4 all-gathers into fresh outputs of random sizes, torch.cuda.empty_cache() between some, so
  that segments are freed and their addresses reused under new allocation ids.
- Mapped memory bounded by what is live: after the churn and after the pool's segments are given back, the peers'
  memory a rank maps is at most what the peers still hold (reserved by their caching allocators, plus their bounce
  areas), as each rank retires what it freed and its peers unmap it; and the device memory of a 2 GiB output and
  1 GiB input that the peer mapped comes back once both ranks freed them and all-gathered again.
- A peer that never calls: the all-gather fails within the group's timeout naming it ("never reached it": its
  Arrived flag never came), and the stream stuck on it is released.
- The same with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), whose memory legacy IPC
  cannot export: every buffer then goes through the bounce area.
- TORCH_SDMA_DIRECT unset (the default): all_gather_into_tensor takes the direct path, unless some member's caching
  allocator makes expandable segments; then the whole group takes staging ("dma"), bit-exact either way.
- Late pairs: one rank always behind the other (each in turn) and no wait for it, so that the later rank of every
  pair moves both directions: every size in both forms, sync and async, and async calls of growing sizes in flight;
  stats count every pair as one moving both.
The cases also run on one GPU shared by two processes (.scratch or the device's one-GPU check), so the reference is
the rebuilt bytes, which are what NCCL returns."""
import collections
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from checks.data import NCCL_SHARED_REASON, SHARE_GPU, assert_bytes_equal, expected_concat, poison_, rand, seed_of
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DIRECT": "1", "TORCH_SDMA_DISABLE": None}
SIZES = (1, 1000, 256 * 1024, 6 << 20, 24 << 20)


def _gather(g, dev, rank, world, name, n, in_place, async_op, dtype=torch.bfloat16):
    return _gather_input(g, rand(name, rank, (n,), dtype, dev), rank, world, in_place, async_op)


def _gather_input(g, x, rank, world, in_place, async_op):
    """all_gather_into_tensor of `x` into a fresh poisoned output (x copied into its slot first when in place)."""
    n = x.numel()
    out = poison_(torch.empty(world * n, dtype=x.dtype, device=x.device))
    if in_place:
        out.narrow(0, rank * n, n).copy_(x)
        x = out.narrow(0, rank * n, n)
    work = dist.all_gather_into_tensor(out, x, group=g, async_op=async_op)
    if async_op:
        work.wait()
    return out


def _device_bytes(name, rank, n, dev):
    """n bf16 elements of any bit pattern for (name, rank), made on the GPU from the case's seed (compared as bytes:
    torch.equal on int16 views, since NaN patterns never equal themselves as floats)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed_of(name, rank))
    return torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int16, device=dev).view(torch.bfloat16)


def _holds_expected(out, dev, name, world, n):
    """Bit-exact on the device: out's bytes are every rank's rand(name) input in rank order."""
    return torch.equal(out.view(torch.uint8), expected_concat(name, range(world), (n,), out.dtype, device=dev))


def _cpu_barrier(g):
    """Every rank is past its GPU work and this point (an all-reduce on CPU, which gloo runs)."""
    torch.cuda.synchronize()
    dist.all_reduce(torch.zeros(1), group=g)


def _gather_ints(g, world, *values):
    """Every rank's `values`, as lists of ints by rank (over gloo)."""
    every = [torch.zeros(len(values), dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(values, dtype=torch.int64), group=g)
    return [e.tolist() for e in every]


def _mps_serves_this_gpu():
    """Whether an MPS server runs here: its clients' freed memory may show in the device's free memory late."""
    # -f: a process name is cut to 15 characters, "nvidia-cuda-mps".
    return subprocess.run(["pgrep", "-f", "nvidia-cuda-mps-server"], capture_output=True).returncode == 0


def _assert_peer_mappings_bounded(g, dev, rank, world, what):
    """The peer memory this rank maps is at most what its peers hold, once two all-gathers have carried every rank's
    retirements: each rank retires its frees at its next all-gather, and a peer that arrived earlier reads them at
    the one after."""
    import torch_sdma

    torch.cuda.synchronize()
    for i in range(2):
        _gather(g, dev, rank, world, f"{what}-retire{i}", 1024, in_place=False, async_op=False)
        _cpu_barrier(g)  # every rank is past its arrival
    every = _gather_ints(g, world, torch_sdma.peer_mapped_bytes(g),
                         torch.cuda.memory_reserved(dev) + torch_sdma.staging_bytes(g))
    held_by_peers = sum(every[q][1] for q in range(world) if q != rank)
    mapped = every[rank][0]
    assert mapped <= held_by_peers, (
        f"{what}: rank {rank} maps {mapped} bytes of its peers' memory, which hold only {held_by_peers}")
    return mapped, held_by_peers


def direct_cases(ctx, churn_iters=10000):
    import torch_sdma

    rank, dev, world = ctx.rank, ctx.device, ctx.world
    g = dist.group.WORLD

    def every_size_both_forms():
        before = torch_sdma.stats(g).get("dma:direct", {}).get("calls", 0)
        calls = 0
        for n in SIZES:
            for in_place in (False, True):
                for async_op in (False, True):
                    name = f"d{n}{in_place}{async_op}"
                    out = _gather(g, dev, rank, world, name, n, in_place, async_op)
                    torch.cuda.synchronize()
                    assert_bytes_equal(out, expected_concat(name, range(world), (n,), torch.bfloat16), name)
                    calls += 1
        after = torch_sdma.stats(g)["dma:direct"]["calls"]
        assert after - before == calls, f"{after - before} direct calls of {calls}: {torch_sdma.stats(g)}"

    def list_form_takes_staging():
        n = 4096
        x = rand("list", rank, (n,), torch.float32, dev)
        outs = [poison_(torch.empty(n, device=dev)) for _ in range(world)]
        before = torch_sdma.stats(g).get("dma", {}).get("calls", 0)
        dist.all_gather(outs, x, group=g)
        torch.cuda.synchronize()
        assert_bytes_equal(torch.cat(outs), expected_concat("list", range(world), (n,), torch.float32), "list")
        assert torch_sdma.stats(g)["dma"]["calls"] == before + 1

    def freed_before_wait():
        n = 8 << 20
        for rep in range(3):
            name = f"free{rep}"
            x = rand(name, rank, (n,), torch.bfloat16, dev)
            out = poison_(torch.empty(world * n, dtype=torch.bfloat16, device=dev))
            probe = out  # a view that survives the drop below only on rank 1, which checks the bytes
            work = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
            if rank == 0:
                del x, out, probe
                # Whatever the allocator hands out now must not be the Work's buffers.
                junk = [torch.full((n,), 7, dtype=torch.bfloat16, device=dev) for _ in range(world + 1)]
                work.wait()
                torch.cuda.synchronize()
                for j in junk:
                    assert bool((j == 7).all()), "memory the Work still uses was handed out again"
            else:
                work.wait()
                torch.cuda.synchronize()
                assert_bytes_equal(probe, expected_concat(name, range(world), (n,), torch.bfloat16), name)

    def allocator_churn():
        gen = torch.Generator().manual_seed(1234)  # the same sizes on every rank
        for i in range(churn_iters):
            n = int(torch.randint(1, 1 << 20, (1,), generator=gen))
            in_place = bool(torch.randint(0, 2, (1,), generator=gen))
            if i % 37 == 0:
                torch.cuda.empty_cache()
            # Random bytes made on the GPU: 10^4 inputs made on the CPU, and their expected concatenations, took
            # minutes. Every rank rebuilds every rank's input from the same seeds.
            inputs = [_device_bytes(f"churn{i}", r, n, dev) for r in range(world)]
            out = _gather_input(g, inputs[rank], rank, world, in_place, async_op=bool(i % 2))
            if not torch.equal(out.view(torch.int16), torch.cat(inputs).view(torch.int16)):
                raise AssertionError(f"churn iteration {i} ({n} elements, in_place={in_place}): wrong bytes")
        del out, inputs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        _assert_peer_mappings_bounded(g, dev, rank, world, "after the churn")

    def comm_buffers_from_the_pool():
        # What FSDP2 does after set_allocate_memory_from_process_group_for_comm: outputs from the backend's
        # allocate_tensor, gathered in place; the pool's memory is mapped by the peers by descriptor.
        backend = g._get_backend(dev)
        assert backend.supports_tensor_alloc(dev)
        gen = torch.Generator().manual_seed(99)
        for i in range(60):
            n = int(torch.randint(1, 4 << 20, (1,), generator=gen))
            name = f"pool{i}"
            out = backend.allocate_tensor(world * n, dtype=torch.bfloat16, device=dev)
            poison_(out)
            out.narrow(0, rank * n, n).copy_(rand(name, rank, (n,), torch.bfloat16, dev))
            work = dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n), group=g, async_op=bool(i % 2))
            if work is not None:
                work.wait()
            if not _holds_expected(out, dev, name, world, n):
                raise AssertionError(f"pool iteration {i} ({n} elements): wrong bytes")
            if i % 20 == 19:
                del out
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # the pool's free segments go back, and the peers unmap them
                _assert_peer_mappings_bounded(g, dev, rank, world, f"pool, after empty_cache {i // 20}")
        torch.cuda.synchronize()

    def freed_memory_comes_back():
        # A peer's mapping holds the owner's memory until it is closed: only the retirements give it back.
        _cpu_barrier(g)
        start, staged = torch.cuda.mem_get_info(dev)[0], torch_sdma.staging_bytes(g)
        reserved = torch.cuda.memory_reserved(dev)
        n = 512 << 20  # 1 GiB of bf16 per rank
        x = rand("big", rank, (n,), torch.bfloat16, dev)
        out = torch.empty(world * n, dtype=torch.bfloat16, device=dev)
        dist.all_gather_into_tensor(out, x, group=g)
        ok = _holds_expected(out, dev, "big", world, n)
        del x, out
        # A buffer (or outgrown bounce area) is freed once the watchdog has seen the last collective using it done,
        # and retired at the owner's next all-gather after that: on 2x H200 that took a round of retiring
        # all-gathers more now and then (521 MiB back one round late). Every rank takes the same number of rounds.
        for round_ in range(4):
            _cpu_barrier(g)
            torch.cuda.empty_cache()
            what = f"after the large all-gather, round {round_}"
            mapped, _ = _assert_peer_mappings_bounded(g, dev, rank, world, what)
            torch.cuda.empty_cache()
            _cpu_barrier(g)
            short = start - torch.cuda.mem_get_info(dev)[0]
            # Bounce areas (expandable segments) grew and stay: count those of every rank on this device.
            every = _gather_ints(g, world, dev.index, torch_sdma.staging_bytes(g) - staged, short,
                                 torch.cuda.memory_reserved(dev) - reserved, mapped)
            grown_on = collections.Counter()
            for index, grown, *_ in every:
                grown_on[index] += grown
            kept = grown_on[dev.index]
            if max(e[2] - grown_on[e[0]] for e in every) < 256 << 20:
                break
        assert ok, "the large all-gather's bytes are wrong"
        if short - kept < 256 << 20:
            return
        # The device reports less free memory than before. It is ours only if some process still holds it: an
        # allocator that kept segments, or a mapping of a peer's memory (bounded above by what the peers hold).
        on_device = [e for e in every if e[0] == dev.index]
        held = sum(max(e[3], 0) + e[4] for e in on_device)
        assert held < 256 << 20 and _mps_serves_this_gpu(), (
            f"{(short - kept) >> 20} MiB of device memory did not come back; this device's ranks still hold "
            f"{held >> 20} MiB (allocators beyond their start, peers' memory mapped): {every}")
        print(f"freed_memory_comes_back: the device reports {(short - kept) >> 20} MiB less free memory, which no rank "
              f"holds (allocators and mappings back): the MPS server's accounting")

    return [
        ("every_size_both_forms", every_size_both_forms),
        ("comm_buffers_from_the_pool", comm_buffers_from_the_pool),
        ("list_form_takes_staging", list_form_takes_staging),
        ("freed_before_wait", freed_before_wait),
        ("allocator_churn", allocator_churn),
        ("freed_memory_comes_back", freed_memory_comes_back),
    ]


def _use_allocator_settings(conf):
    # The caching allocator reads PYTORCH_CUDA_ALLOC_CONF when torch is imported, which a spawned rank does before
    # the harness sets its environment: the same settings, applied at run time.
    if conf:
        torch.cuda.memory._set_allocator_settings(conf)


def _body(ctx, alloc_conf=""):
    import torch_sdma

    _use_allocator_settings(alloc_conf)
    # Whether this allocator's memory bounces: a fresh group's first all-gather leaves a bounce area only then.
    g = dist.new_group()
    _gather(g, ctx.device, ctx.rank, ctx.world, "bounce", 1 << 20, False, False)
    torch.cuda.synchronize()
    bounced = torch_sdma.staging_bytes(g) > 0
    return {"failed": ctx.run_cases(direct_cases(ctx, int(os.environ.get("SDMA_TEST_CHURN", "10000")))),
            "bounced": bounced}


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"], ids=["cudaMalloc", "expandable"])
def test_direct_path_bit_exact(alloc_conf):
    res = run_group(_body, 2, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=600, kwargs={"alloc_conf": alloc_conf})
    res.check()
    assert all(r.value["failed"] == 0 for r in res.ranks), res.describe()
    assert all(r.value["bounced"] == bool(alloc_conf) for r in res.ranks), [r.value["bounced"] for r in res.ranks]


def _default_path_body(ctx, expandable_on=()):
    import torch_sdma

    rank, dev, world = ctx.rank, ctx.device, ctx.world
    _use_allocator_settings("expandable_segments:True" if rank in expandable_on else "")
    g = dist.new_group()  # TORCH_SDMA_DIRECT is read at group creation, and unset here
    for in_place in (False, True):
        name = f"default{in_place}"
        out = _gather(g, dev, rank, world, name, 3 << 20, in_place, False)
        torch.cuda.synchronize()
        assert_bytes_equal(out, expected_concat(name, range(world), (3 << 20,), torch.bfloat16), name)
    return {k: v["calls"] for k, v in torch_sdma.stats(g).items()}


# TORCH_SDMA_DIRECT unset: the direct path where every member's allocator makes memory peers can map, staging for the
# whole group where some member's makes expandable segments.
@pytest.mark.parametrize("expandable_on", [(), (0, 1), (1,)], ids=["none", "all", "rank1"])
def test_direct_path_is_the_default_unless_expandable_segments(expandable_on):
    env = dict(ENV, TORCH_SDMA_DIRECT=None, PYTORCH_CUDA_ALLOC_CONF=None)
    res = run_group(_default_path_body, 2, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=300,
                    kwargs={"expandable_on": expandable_on})
    res.check()
    want = {"dma": 2} if expandable_on else {"dma:direct": 2}
    assert all(r.value == want for r in res.ranks), [r.value for r in res.ranks]


@pytest.mark.parametrize("async_op", [True, False])
def test_direct_peer_never_calls_is_named(async_op):
    from test_allgather_cuda import run_peer_never_calls

    v = run_peer_never_calls(async_op, ENV)
    assert "never reached it: [1]" in v["error"], v


def _behind_body(ctx):
    """Every all-gather with one rank behind the other (rank 1 for the first half of the calls, then rank 0) and no
    wait for it: the later rank of every pair moves both directions. The later rank calls only once the earlier one's
    call has returned (the pair settled without it), not after a sleep, which two ranks running at once under MPS
    outran. A group's first call connects it, which every member makes together: each group's first call is made by
    both ranks at once, and its counts are reset. Returns this rank's pair counts and calls."""

    import torch_sdma

    rank, dev, world = ctx.rank, ctx.device, ctx.world
    groups = []
    calls = []

    def connected_group(name):
        group = dist.new_group()  # the knobs are read at group creation
        out = _gather(group, dev, rank, world, name, 1000, False, False)
        torch.cuda.synchronize()
        assert_bytes_equal(out, expected_concat(name, range(world), (1000,), torch.bfloat16), name)
        torch_sdma.reset_stats(group)
        groups.append(group)
        return group

    g = connected_group("connect0")

    def gather_behind(name, n, in_place, async_op, behind):
        if rank == behind:
            ctx.fetch(f"returned/{name}")
        out = _gather(g, dev, rank, world, name, n, in_place, async_op)
        if rank != behind:
            ctx.publish(f"returned/{name}", True)
        calls.append(name)
        return out

    # Every size in both forms, sync and async.
    for i, n in enumerate(SIZES):
        for in_place in (False, True):
            for async_op in (False, True):
                name = f"late{n}{in_place}{async_op}"
                behind = 1 if i < len(SIZES) // 2 + 1 else 0
                out = gather_behind(name, n, in_place, async_op, behind)
                torch.cuda.synchronize()
                assert_bytes_equal(out, expected_concat(name, range(world), (n,), torch.bfloat16), name)
    # A fresh group, async calls of growing sizes in flight, the late rank alternating.
    g = connected_group("connect1")
    works, outs = [], []
    for k, n in enumerate((1000, 600 << 10, 1200 << 10, 2400 << 10, 4800 << 10, 1000)):
        name = f"grow{k}"
        x = rand(name, rank, (n,), torch.bfloat16, dev)
        out = poison_(torch.empty(world * n, dtype=torch.bfloat16, device=dev))
        if rank == k % 2:
            ctx.fetch(f"returned/{name}")
        works.append(dist.all_gather_into_tensor(out, x, group=g, async_op=True))
        if rank != k % 2:
            ctx.publish(f"returned/{name}", True)
        calls.append(name)
        outs.append((name, n, out))
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    for name, n, out in outs:
        assert_bytes_equal(out, expected_concat(name, range(world), (n,), torch.bfloat16), name)
    counts = {}
    for group in groups:
        for k, v in torch_sdma.stats(group).get("dma:direct", {}).items():
            counts[k] = counts.get(k, 0) + v
    return {"calls": len(calls), "counts": counts}


def test_late_pairs_move_both_when_a_rank_is_behind():
    env = dict(ENV, TORCH_SDMA_DIRECT_PEER_WAIT_US="0")
    res = run_group(_behind_body, 2, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=300)
    res.check()
    for r in res.ranks:
        calls, counts = r.value["calls"], r.value["counts"]
        assert counts.get("calls") == calls, r.value
        # One pair per call on each of the two ranks, every one settled late.
        assert counts.get("pairs_one_moving_both") == calls and counts.get("pairs_each_pushing_own") == 0, r.value


def _fsdp2_body(ctx, steps=4):
    """The same FSDP2 training twice, its all-gathers once on sdma's direct path with the outputs from sdma's pool
    (set_allocate_memory_from_process_group_for_comm) and once on NCCL: the losses are bit-identical."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import torch_sdma

    dev = ctx.device
    nccl = dist.new_group(backend="nccl")
    # Count the all-gather outputs FSDP2 takes from a backend's allocate_tensor (where this torch has the hook).
    pool_allocations = []
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
        mixin = collectives.ProcessGroupAllocMixin
        allocate = mixin.allocate

        def counted(self, size, *, dtype, device):
            if self._group._get_backend(device).supports_tensor_alloc(device):
                pool_allocations.append(1)
            return allocate(self, size, dtype=dtype, device=device)
        mixin.allocate = counted
    except (ImportError, AttributeError):
        pool_allocations = None

    def train(group, comm_buffers):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, device=dev) for _ in range(4)])
        mesh = DeviceMesh.from_group(group, "cuda")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # Per module: the setting covers the module's own parameter group only.
        for m in model.modules():
            if comm_buffers and isinstance(m, FSDPModule):
                m.set_allocate_memory_from_process_group_for_comm(True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for step in range(steps):
            x = rand(f"fsdp{step}", ctx.rank, (64, 1024), torch.float32, dev, kind="normal")
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    before = torch_sdma.stats().get("dma:direct", {}).get("calls", 0)
    sdma_losses = train(dist.group.WORLD, comm_buffers=True)
    direct_calls = torch_sdma.stats()["dma:direct"]["calls"] - before
    from_pool = None if pool_allocations is None else len(pool_allocations)
    nccl_losses = train(nccl, comm_buffers=False)  # the reference: plain allocations, plain NCCL
    assert sdma_losses == nccl_losses, (sdma_losses, nccl_losses)
    assert direct_calls >= steps * 4, f"only {direct_calls} all-gathers took the direct path"  # 4 forwards a step
    assert from_pool is None or from_pool >= steps * 4, f"only {from_pool} outputs came from sdma's pool"
    return {"losses": sdma_losses, "direct_calls": direct_calls, "outputs_from_pool": from_pool}


@pytest.mark.skipif(SHARE_GPU, reason=NCCL_SHARED_REASON)  # reduce-scatters on the inner NCCL, losses against NCCL
def test_fsdp2_comm_buffers_on_the_direct_path():
    res = run_group(_fsdp2_body, 2, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=300)
    res.check()
