"""On GPUs (2 GPUs; skipped elsewhere): the hierarchical all-gather with 4 processes, two on each GPU (rank r
on cuda:r % 2), as 2 pseudo-nodes (TORCH_SDMA_TEST_PSEUDO_NODES) laid out so that each rail spans both GPUs, since
NCCL refuses two ranks of one communicator on one GPU:

- "0,1,0,1": pseudo-node A = ranks 0, 2 (both on GPU 0), B = ranks 1, 3 (GPU 1); rails [0,1] and [2,3], each over
  GPU 0 and GPU 1. Inside a node the copy-engine transport moves bytes between two processes on ONE GPU (memory of
  another process mapped on the same device).
- "0,1,1,0": A = ranks 0, 3 (GPU 0, GPU 1), B = ranks 1, 2 (GPU 1, GPU 0); rails [0,1] and [3,2]. Inside a node the
  copy engines move bytes over NVLink, as inside a real node.

(The contiguous "0,0,1,1" would make rail [0,2] of two ranks on GPU 0.)

Every form (into tensor, in place, async, list, coalesced, all_gather_coalesced), 0 bytes to 1 GiB of output, also cut
into many chunks, bit-exact; the path and layout in stats; and the intra-node stage runs no kernel (torch.profiler: the
only kernels are NCCL's, on the rails).

The reference is the flat all-gather's result by definition (every rank's input in group-rank order), rebuilt on every
rank from a per-rank hash computed on the GPU, with outputs poisoned (bitwise NOT of the expected bytes): a flat NCCL
all-gather of these four processes cannot run, NCCL refusing two ranks on one GPU. The small sizes are also checked
against gloo on CPU copies of the same tensors.
"""
import os
import zlib

import pytest
import torch
import torch.distributed as dist

from checks.data import NCCL_SHARED_REASON, SHARE_GPU, coalescing_manager
from checks.trace import exported_events
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices"),
              # On one GPU (SDMA_TEST_SHARE_GPU=1) every rank is on it, so each rail's NCCL would hold two ranks of
              # one GPU whatever the layout: the rails cannot run there.
              pytest.mark.skipif(SHARE_GPU, reason=NCCL_SHARED_REASON)]

W = 4
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# every all-gather must take the DMA path (the group's own inner NCCL cannot run with two ranks on one GPU)
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_MIN_BYTES_ACROSS_NODES": "0", "TORCH_SDMA_DISABLE": None}


def pattern(case, rank, nbytes, device):
    """Rank `rank`'s input bytes for `case`: a hash of (position, rank, case) computed on the GPU, so that every rank
    rebuilds every rank's input without moving it."""
    seed = zlib.crc32(f"{case}|{rank}".encode()) & 0x7FFFFFFF
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    step = 64 << 20
    for at in range(0, nbytes, step):
        x = torch.arange(at, min(nbytes, at + step), dtype=torch.int64, device=device)
        x = x * 0x9E3779B1 + seed
        x ^= x >> 15
        x *= 0x2C1B3C6D
        x ^= x >> 12
        out[at:at + x.numel()] = (x & 0xFF).to(torch.uint8)
    return out


def expected(case, nbytes, device):
    return torch.cat([pattern(case, q, nbytes, device) for q in range(W)])


def as_dtype(bytes_, dtype):
    return bytes_.view(dtype) if bytes_.numel() else torch.empty(0, dtype=dtype, device=bytes_.device)


def nbytes_of(dtype, n):
    return n * torch.empty((), dtype=dtype).element_size()


def raw(t):
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def check_equal(got, want, what):
    got = raw(got)
    if got.numel() != want.numel() or not torch.equal(got, want):
        bad = (got != want).nonzero().flatten() if got.numel() == want.numel() else None
        detail = f"{bad.numel()} bytes differ, first at {int(bad[0])}" if bad is not None else \
            f"{got.numel()} bytes, expected {want.numel()}"
        raise AssertionError(f"{what}: {detail}")


class Forms:
    """Every all-gather form on group g, each checked against the expected bytes."""

    def __init__(self, g, rank, dev, tag):
        self.g, self.rank, self.dev, self.tag = g, rank, dev, tag

    def into_tensor(self, name, n, dtype=torch.uint8, *, inplace=False, async_op=False):
        case = f"{self.tag}/{name}"
        nb = nbytes_of(dtype, n)
        want = expected(case, nb, self.dev)
        out = as_dtype(torch.bitwise_not(want), dtype)
        if inplace:
            inp = out.narrow(0, self.rank * n, n)
            inp.copy_(as_dtype(pattern(case, self.rank, nb, self.dev), dtype))
        else:
            inp = as_dtype(pattern(case, self.rank, nb, self.dev), dtype)
        w = dist.all_gather_into_tensor(out, inp, group=self.g, async_op=async_op)
        if async_op:
            w.wait()
        torch.cuda.current_stream(self.dev).synchronize()
        check_equal(out, want, f"all_gather_into_tensor {case} ({n} x {dtype}, inplace={inplace}, async={async_op})")
        return out

    def as_list(self, name, n, dtype=torch.bfloat16, *, async_op=False):
        case = f"{self.tag}/{name}"
        nb = nbytes_of(dtype, n)
        want = expected(case, nb, self.dev)
        outs = [as_dtype(torch.bitwise_not(want[q * nb:(q + 1) * nb]), dtype) for q in range(W)]
        w = dist.all_gather(outs, as_dtype(pattern(case, self.rank, nb, self.dev), dtype), group=self.g,
                            async_op=async_op)
        if async_op:
            w.wait()
        torch.cuda.current_stream(self.dev).synchronize()
        check_equal(torch.cat([raw(o) for o in outs]), want, f"all_gather (list) {case}")

    def coalesced(self, name, specs, *, inplace=False, async_op=False):
        """_coalescing_manager over all_gather_into_tensor of (numel, dtype) specs."""
        wants, outs, inps = [], [], []
        for k, (n, dtype) in enumerate(specs):
            case = f"{self.tag}/{name}.{k}"
            nb = nbytes_of(dtype, n)
            want = expected(case, nb, self.dev)
            out = as_dtype(torch.bitwise_not(want), dtype)
            mine = as_dtype(pattern(case, self.rank, nb, self.dev), dtype)
            if inplace:
                inp = out.narrow(0, self.rank * n, n)
                inp.copy_(mine)
            else:
                inp = mine
            wants.append(want)
            outs.append(out)
            inps.append(inp)
        with coalescing_manager(self.g, device=self.dev, async_ops=async_op) as cm:
            for o, i in zip(outs, inps):
                dist.all_gather_into_tensor(o, i, group=self.g)
        if async_op:
            cm.wait()
        torch.cuda.current_stream(self.dev).synchronize()
        for k, (o, want) in enumerate(zip(outs, wants)):
            check_equal(o, want, f"coalesced {name}[{k}] {specs[k]} inplace={inplace}")

    def coalesced_legacy(self, name, sizes, dtype=torch.float32):
        """all_gather_coalesced: a list of inputs, one output list per rank."""
        wants, ins = [], []
        for k, n in enumerate(sizes):
            case = f"{self.tag}/{name}.{k}"
            nb = nbytes_of(dtype, n)
            wants.append(expected(case, nb, self.dev))
            ins.append(as_dtype(pattern(case, self.rank, nb, self.dev), dtype))
        outs = [[as_dtype(torch.bitwise_not(wants[k][q * nbytes_of(dtype, n):(q + 1) * nbytes_of(dtype, n)]), dtype)
                 for k, n in enumerate(sizes)] for q in range(W)]
        dist.all_gather_coalesced(outs, ins, group=self.g)
        torch.cuda.current_stream(self.dev).synchronize()
        for k, n in enumerate(sizes):
            check_equal(torch.cat([raw(outs[q][k]) for q in range(W)]), wants[k], f"all_gather_coalesced {name}[{k}]")


def kernel_names(prof):
    kernels, copies = [], 0
    for e in exported_events(prof):
        cat = str(e.get("cat", "")).lower()
        if cat == "kernel":
            kernels.append(str(e.get("name", "")))
        elif cat == "gpu_memcpy":
            copies += 1
    return kernels, copies


def hierarchical_cuda_body(ctx, layout):
    import torch_sdma

    rank, dev = ctx.rank, ctx.device
    world = dist.group.WORLD
    f = Forms(world, rank, dev, "h")
    cases = []

    def path_and_layout():
        f.into_tensor("warm", 1000)
        assert torch_sdma.group_path(world, device="cuda") == "dma:hierarchical", torch_sdma.group_path(world, "cuda")
        nodes = {}
        for q, name in enumerate(layout.split(",")):
            nodes.setdefault(name, []).append(q)
        rails = ",".join("[" + ",".join(str(m[i]) for m in nodes.values()) + "]" for i in range(2))
        got = torch_sdma.node_layout(world)
        assert got == f"2 nodes x 2 ranks (rails {rails})", got

    cases.append(("path_and_layout", path_and_layout))

    # Sizes are output bytes (4 ranks): 0, odd small ones, 1 MiB, 64 MiB (chunked at the default staging) and 1 GiB.
    for out_bytes in (0, 4 * 1001, 1 * MIB + 4 * 3, 64 * MIB, 1 * GIB):
        n = out_bytes // W

        def sweep(n=n, s=out_bytes):
            f.into_tensor(f"t{s}", n)
            f.into_tensor(f"ti{s}", n // 2, torch.bfloat16, inplace=True, async_op=True)
            f.into_tensor(f"ta{s}", n // 4, torch.float32, async_op=True)
            f.as_list(f"l{s}", n // 2)
            f.coalesced(f"c{s}", [(n // 8, torch.float32), (3, torch.uint8), (n // 4, torch.bfloat16)])
            f.coalesced(f"ci{s}", [(n // 2, torch.bfloat16), (5, torch.int64)], inplace=True, async_op=True)
            f.coalesced_legacy(f"g{s}", [n // 8, 7])

        cases.append((f"every_form_output_bytes={out_bytes}", sweep))

    def against_gloo():
        # The same collective on gloo with CPU copies: the expected bytes are the flat all-gather's.
        gloo = dist.new_group(backend="gloo")
        for n in (1, 4097, 1 << 20):
            out = f.into_tensor(f"gl{n}", n)
            ref = torch.empty(W * n, dtype=torch.uint8)
            dist.all_gather_into_tensor(ref, pattern(f"h/gl{n}", rank, n, dev).cpu(), group=gloo)
            assert torch.equal(out.cpu(), ref), f"hierarchical vs gloo on CPU copies, {n} bytes a rank"

    cases.append(("against_gloo", against_gloo))

    def many_chunks():
        # 256 KiB chunks: a 64 MiB output crosses the rails in 64 chunks a rank, every slot reused many times.
        os.environ["TORCH_SDMA_CHUNK_BYTES"] = "256K"
        try:
            g = dist.new_group()
        finally:
            os.environ.pop("TORCH_SDMA_CHUNK_BYTES", None)
        fc = Forms(g, rank, dev, "mc")
        fc.into_tensor("t", 16 * MIB + 4099)
        fc.into_tensor("ti", 8 * MIB, torch.bfloat16, inplace=True, async_op=True)
        fc.as_list("l", 4 * MIB + 1)
        fc.coalesced("c", [(MIB + 1, torch.float32), (7, torch.uint8), (2 * MIB, torch.bfloat16)])
        assert torch_sdma.group_path(g, device="cuda") == "dma:hierarchical", torch_sdma.group_path(g, "cuda")

    cases.append(("many_chunks", many_chunks))

    def zero_kernels_inside_nodes():
        from torch.profiler import ProfilerActivity, profile

        n = 16 * MIB
        x = pattern("zk", rank, n, dev)
        outs = [torch.empty(W * n, dtype=torch.uint8, device=dev) for _ in range(3)]
        dist.all_gather_into_tensor(outs[0], x, group=world)  # warm
        outs[1].narrow(0, rank * n, n).copy_(x)
        lists = list(outs[2].chunk(W))
        torch.cuda.synchronize()
        ctx.barrier_store("zk")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            dist.all_gather_into_tensor(outs[0], x, group=world)
            dist.all_gather_into_tensor(outs[1], outs[1].narrow(0, rank * n, n), group=world)  # in place
            dist.all_gather(lists, x, group=world)
            torch.cuda.synchronize()
        kernels, copies = kernel_names(prof)
        foreign = [k for k in kernels if "nccl" not in k.lower()]
        assert any("nccl" in k.lower() for k in kernels), f"profiler sanity: no NCCL kernel on the rails: {kernels}"
        assert not foreign, f"kernels other than NCCL's ran: {sorted(set(foreign))}"
        assert copies > 0, "profiler saw no copy-engine copies inside the node"

    cases.append(("zero_kernels_inside_nodes", zero_kernels_inside_nodes))

    def stats_hierarchical():
        s = torch_sdma.stats(world)
        assert s.get("dma:hierarchical", {}).get("calls", 0) > 0, s
        assert not any(k.startswith("inner:") for k in s), f"some all-gathers went to the inner NCCL: {s}"

    cases.append(("stats_hierarchical", stats_hierarchical))
    return ctx.run_cases(cases)


def _two_gpus():
    """The first two GPUs this process sees: rank r runs on the (r % 2)-th, so that two processes share each GPU on a
    machine with more than two as well."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ",".join(visible.split(",")[:2]) if visible else "0,1"


@pytest.mark.parametrize("layout", ["0,1,0,1", "0,1,1,0"], ids=["node_per_gpu", "node_across_gpus"])
def test_hierarchical_cuda_bit_exact(layout):
    env = dict(ENV, TORCH_SDMA_TEST_PSEUDO_NODES=layout, CUDA_VISIBLE_DEVICES=_two_gpus())
    res = run_group(hierarchical_cuda_body, W, "cpu:gloo,cuda:sdma", kwargs={"layout": layout}, env=env, cuda=True,
                    timeout=300, pg_timeout_s=60)
    res.check()
