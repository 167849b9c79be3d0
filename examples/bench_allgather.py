"""All-gather benchmark: torch_sdma against the backend it would otherwise delegate to, in the same run.

GPU mode (one process per GPU):   torchrun --nproc_per_node <number of GPUs> examples/bench_allgather.py
On some of the GPUs:              CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 examples/bench_allgather.py
CPU mode (no GPU, CPU tensors):   torchrun --nproc_per_node 2 examples/bench_allgather.py

GPU mode compares sdma (copy engines) with NCCL on CUDA tensors: a size sweep of all_gather_single, the
slowdown each inflicts on bf16 GEMMs running beside it, and the CPU cost of enqueueing one call. CPU mode compares
sdma (POSIX shared memory) with gloo on CPU tensors. Both backends are timed alternately in one process, so the
figures share the machine's state at the time; compare them inside one run only.

Then every other all-gather a user could pick (examples/allgather_peers.py: NCCL's copy-engine path with symmetric
windows, torch symmetric memory's copy-engine all-gather, and the copy-engine limit), out of place and in place,
each checked for its bytes, with sdma's ratios to the best peer, to the baseline and to the limit; "n/a" and why
where this machine lacks a peer. The limit is measured in the same rounds: the raw copy-engine schedules
(torch_sdma.check.RAW_SCHEDULES: plain copies of the all-gather's bytes between the ranks' buffers, in rank order or
rotated on one stream, a stream per peer, pulls with a stream per peer, all ranks at once), in a table of their own;
the fastest with right bytes is ce-limit. --skip-peers skips them all.

--pseudo-nodes LAYOUT (e.g. 0,1,0,1 with 4 processes on 2 GPUs) splits this ONE host into pseudo-nodes and times the
hierarchical all-gather (docs/multinode.md) beside flat NCCL (gloo in CPU mode), the size sweep only. Its rails cross
NVLink or loopback, not a network: it shows the schedule working and what it costs on one host, not what it does on
a cluster.

Writes to --out-dir: allgather_<mode>_w<world>.{csv,json,png}, allgather_<mode>_w<world>_raw.csv (the raw
schedules, GPUs) and allgather_<mode>_w<world>_peers.png (the PNGs only where matplotlib imports; `make bench`
installs it). On torch >= 2.14 every call is all_gather_single (torch deprecates all_gather_into_tensor, the same
call underneath); before, all_gather_into_tensor. The bytes are checked, and the sizes and paths named, by the same
helpers as `python -m torch_sdma.check`.
"""
import argparse
import csv
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import torch_sdma
except ModuleNotFoundError:  # run from a checkout without installing: the package is beside examples/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch_sdma
from allgather_peers import (
    FORMS,
    CopyEngineLimit,
    CopyEngineLimitLegacyIpc,
    GroupPeer,
    SymmMemAllGather,
    expected_output,
    free_port,
    hashed_bytes,
    nccl_ce_unavailable,
    run_nccl_ce,
)

from torch_sdma.check import (
    GATHER_SINGLE,
    RAW_SCHEDULES,
    SINGLE,
    human_bytes,
    new_group_with_env,
    parse_bytes,
    path_moved,
    seconds_per_call,
)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 8 * MIB, 16 * MIB, 64 * MIB,
                 256 * MIB, 1 * GIB]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "uint8": torch.uint8}
# Bytes moved per backend per round: a size runs max(min_iters, budget // size) calls, at most max_iters. It keeps
# small sizes far above timer resolution and the large ones short (1 GiB on H200s: ~2 ms a call).
ITER_BUDGET = {"gpu": 4 * GIB, "cpu": 512 * MIB}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CUDA tensors vs NCCL; cpu: CPU tensors vs gloo; auto: gpu if a GPU is visible")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                   help="comma-separated output sizes (e.g. 4K,1M,1G); default: 4 KiB to 1 GiB")
    p.add_argument("--max-bytes", type=parse_bytes,
                   help="drop sizes above this (default: 1G on GPU, 64M on CPU)")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per size and backend (median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size and backend")
    p.add_argument("--max-iters", type=int, default=200, help="most calls in one timed round")
    p.add_argument("--min-iters", type=int, default=3, help="fewest calls in one timed round")
    p.add_argument("--skip-gemm", action="store_true", help="GPU: skip the GEMM-overlap measurement")
    p.add_argument("--gemm-size", type=int, default=8192, help="GPU: M=N=K of the bf16 GEMMs")
    p.add_argument("--gemm-count", type=int, default=30, help="GPU: GEMMs per overlap iteration")
    p.add_argument("--gemm-rounds", type=int, default=21,
                   help="GPU: interleaved rounds of the overlap measurement (GEMMs alone vary by ~6%% from round "
                        "to round on 2x H200, so 7 rounds left a slowdown of 2-3%% uncertain by about 1 point)")
    p.add_argument("--overlap-gathers", type=int, default=12, help="GPU: all-gathers beside the GEMMs")
    p.add_argument("--overlap-bytes", type=parse_bytes, default=256 * MIB,
                   help="GPU: output size of each all-gather beside the GEMMs")
    p.add_argument("--overlap-in-place", action="store_true",
                   help="GPU: the all-gathers beside the GEMMs take their input from the output's own slot, as "
                        "FSDP2 and ZeRO-3 call them")
    p.add_argument("--skip-enqueue", action="store_true", help="GPU: skip the CPU enqueue-cost measurement")
    p.add_argument("--enqueue-iters", type=int, default=200, help="GPU: timed calls per backend for enqueue cost")
    p.add_argument("--enqueue-sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")], default=[MIB, 64 * MIB],
                   help="GPU: output sizes for the enqueue cost, each out of place and in place (default 1M,64M)")
    p.add_argument("--skip-captured", action="store_true", help="GPU: skip the CUDA-graph replay measurement")
    p.add_argument("--captured-sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                   default=[256 * MIB, GIB], help="GPU: output sizes of the captured all-gathers")
    p.add_argument("--captured-calls", type=int, default=10, help="GPU: all-gathers in one captured graph")
    p.add_argument("--skip-groups", action="store_true", help="GPU: skip the staging-across-groups measurement")
    p.add_argument("--skip-peers", action="store_true",
                   help="skip every other all-gather a user could pick (examples/allgather_peers.py), both forms")
    p.add_argument("--pseudo-nodes", metavar="LAYOUT",
                   help="one node name per rank (e.g. 0,1,0,1): split this one host into pseudo-nodes "
                        "(TORCH_SDMA_TEST_PSEUDO_NODES, test-only) and time the hierarchical all-gather beside flat "
                        "NCCL (gloo in CPU mode); several processes may share a GPU")
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    return p.parse_args()


class Bench:
    """State shared by the measurements: rank, device, the two groups and how to time on this device."""

    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        mode = args.mode
        if mode == "auto":
            mode = "gpu" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        self.mode = mode
        self.pseudo = args.pseudo_nodes
        if self.pseudo:
            if len(self.pseudo.split(",")) != self.world:
                raise SystemExit(f"--pseudo-nodes {self.pseudo} names {len(self.pseudo.split(','))} ranks, "
                                 f"not {self.world}")
            # Read at group creation; every size on the hierarchical path.
            os.environ["TORCH_SDMA_TEST_PSEUDO_NODES"] = self.pseudo
            os.environ["TORCH_SDMA_MIN_BYTES"] = os.environ["TORCH_SDMA_MIN_BYTES_ACROSS_NODES"] = "0"
            if mode == "gpu":
                local_rank %= torch.cuda.device_count()  # two processes may share a GPU
        if mode == "gpu":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
            # sdma serves CUDA tensors of the default group; the baseline is a plain NCCL group over the same ranks.
            dist.init_process_group("cpu:gloo,cuda:sdma")
            self.base_name = "nccl"
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("cpu:sdma")
            self.base_name = "gloo"
        # The baseline's members: every rank, unless processes share GPUs, which NCCL refuses within a communicator:
        # then one process per GPU gathers the same output bytes (--pseudo-nodes only).
        self.base_ranks = list(range(self.world))
        if self.pseudo and mode == "gpu" and self.world > torch.cuda.device_count():
            self.base_ranks = list(range(torch.cuda.device_count()))
        self.base_group = dist.new_group(ranks=self.base_ranks, backend=self.base_name)
        # Barriers on gloo: with processes sharing GPUs the default group's NCCL could not run.
        self.cpu_group = dist.new_group(backend="gloo") if self.pseudo else None
        # The groups below log nothing at creation: the default group's line says what applies to this device.
        # The enqueue cost is that of the copy-engine path, which the default group leaves to NCCL below
        # TORCH_SDMA_MIN_BYTES: a second sdma group, with the threshold at 0, takes every size on DMA.
        self.dma_group = new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_LOG="0")
        # Peer rows of their own: the direct path at every size, and staging (the path of the other forms, and of
        # all_gather_single with TORCH_SDMA_DIRECT=0) at every size.
        self.direct_group = new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_DIRECT="1", TORCH_SDMA_LOG="0")
        self.staging_group = new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_DIRECT="0", TORCH_SDMA_LOG="0")
        self.dtype = DTYPES[args.dtype or ("bf16" if mode == "gpu" else "fp32")]
        max_bytes = args.max_bytes or (GIB if mode == "gpu" else 64 * MIB)
        self.sizes = [s for s in (args.sizes or DEFAULT_SIZES) if s <= max_bytes]

    def log(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    def sync(self):
        """Quiesce: local device work done, then all ranks line up (the default group's barrier runs on the CPU)."""
        if self.mode == "gpu":
            torch.cuda.synchronize()
        dist.barrier(group=self.cpu_group)

    def groups(self):
        """(name, group) of both backends; sdma is the default group."""
        return [("sdma", None), (self.base_name, self.base_group)]

    def iters_for(self, out_bytes):
        """Calls in one timed round: max(min_iters, budget // size), at most max_iters."""
        a = self.args
        return max(a.min_iters, min(a.max_iters, ITER_BUDGET[self.mode] // out_bytes))

    def time_calls(self, fn, iters):
        return seconds_per_call(fn, iters, self.mode == "gpu")


PAIR_KINDS = ("each_pushing_own", "one_moving_both")


def direct_pairs(group):
    """This rank's direct-path pair counts in a group so far, one per PAIR_KINDS: each pushing its own bytes, or one
    moving both directions (a peer that called too late)."""
    d = torch_sdma.stats(group).get("dma:direct", {})
    return tuple(d.get(f"pairs_{kind}", 0) for kind in PAIR_KINDS)


def timing_fields(name, seconds, out_bytes, world):
    """A backend's time per call and bandwidths in a row; busbw only where the group's size means something."""
    fields = {f"{name}_us": seconds * 1e6, f"{name}_algbw_GBps": out_bytes / seconds / 1e9}
    if world:
        fields[f"{name}_busbw_GBps"] = out_bytes * (world - 1) / world / seconds / 1e9
    return fields


def with_ratio(b, row, bw, path, match):
    """The row with sdma's bandwidth over the baseline's, logged as it is measured."""
    # The ratio of the times: the same for algbw and busbw, and defined on one rank too (where busbw is 0).
    row[f"ratio_{bw}"] = row[f"{b.base_name}_us"] / row["sdma_us"]
    b.log(f"  {row['size']:>8}: sdma {row['sdma_us']:10.1f} us ({path}), {b.base_name} "
          f"{row[f'{b.base_name}_us']:10.1f} us, sdma / {b.base_name} {row[f'ratio_{bw}']:.2f}, match {match}")
    return row


def sweep(b):
    """all_gather_single over the size list; both backends per round, alternating which one goes first."""
    a = b.args
    elem = torch.tensor([], dtype=b.dtype).element_size()
    rows = []
    for size in b.sizes:
        out_numel = max(1, size // elem // b.world) * b.world  # whole elements, the same count from each rank
        out_bytes = out_numel * elem
        in_numel = out_numel // b.world
        gen = torch.Generator().manual_seed(1000 + b.rank)
        if b.dtype.is_floating_point:
            inp = torch.randn(in_numel, generator=gen).to(b.dtype)
        else:
            inp = torch.randint(0, 256, (in_numel,), generator=gen, dtype=b.dtype)
        inp = inp.to(b.device)
        outs = {name: torch.empty(out_numel, dtype=b.dtype, device=b.device) for name, _ in b.groups()}
        # Bit-exact check against the baseline on fresh data before anything is timed.
        for name, group in b.groups():
            outs[name].fill_(0)
            GATHER_SINGLE(outs[name], inp, group=group)
        match = torch.equal(outs["sdma"], outs[b.base_name])
        iters = b.iters_for(out_bytes)
        per_round = {name: [] for name, _ in b.groups()}
        stats_before = torch_sdma.stats()
        for name, group in b.groups():
            for _ in range(a.warmup):
                GATHER_SINGLE(outs[name], inp, group=group)
        for r in range(a.rounds):
            order = b.groups() if r % 2 == 0 else b.groups()[::-1]
            for name, group in order:
                b.sync()
                t = b.time_calls(lambda o=outs[name], g=group: GATHER_SINGLE(o, inp, group=g), iters)
                per_round[name].append(t)
        b.sync()
        path = path_moved(stats_before, torch_sdma.stats())
        # Each rank timed its own calls; a call is done when the slowest rank is, so report the slowest rank.
        med = {name: slowest(b, statistics.median(ts)) for name, ts in per_round.items()}
        row = {"bytes": out_bytes, "size": human_bytes(out_bytes), "dtype": str(b.dtype).removeprefix("torch."),
               "iters": iters, "rounds": a.rounds, "sdma_path": path, "match": all_ranks(b, match)}
        for name in per_round:
            t = med[name]
            row.update(timing_fields(name, t, out_bytes, b.world))
            row[f"{name}_rounds_us"] = [x * 1e6 for x in per_round[name]]
        rows.append(with_ratio(b, row, "busbw", path, match))
    return rows


def slowest(b, seconds):
    """The slowest rank's figure: a call is done when the slowest rank is. Ranks outside the timed group send 0."""
    t = torch.tensor([seconds], dtype=torch.float64)
    gathered = [torch.zeros_like(t) for _ in range(b.world)]
    dist.all_gather(gathered, t, group=b.cpu_group)
    return max(x.item() for x in gathered)


def all_ranks(b, ok):
    """True where `ok` holds on every rank (a check is passed only if it passed everywhere)."""
    t = torch.tensor([int(ok)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=b.cpu_group)
    return bool(t.item())


def pseudo_node_sweep(b):
    """--pseudo-nodes: all_gather_single on the hierarchical path (the default group) and on the baseline, in
    alternating rounds, uint8 so that every byte pattern occurs and is checked exactly."""
    a = b.args
    base_member = b.rank in b.base_ranks
    rows = []
    for size in b.sizes:
        n = max(1, size // b.world)
        out_bytes = n * b.world
        inp = hashed_bytes(b.rank, n, b.device)
        out = torch.empty(out_bytes, dtype=torch.uint8, device=b.device)
        before = torch_sdma.stats()
        GATHER_SINGLE(out, inp)
        match = torch.equal(out, expected_output(b.world, n, b.device))
        base_n = out_bytes // len(b.base_ranks)
        base_in = torch.empty(base_n, dtype=torch.uint8, device=b.device)
        base_out = torch.empty(base_n * len(b.base_ranks), dtype=torch.uint8, device=b.device)
        iters = b.iters_for(out_bytes)
        calls = {"sdma": lambda: GATHER_SINGLE(out, inp),
                 b.base_name: lambda: GATHER_SINGLE(base_out, base_in, group=b.base_group)}
        for name, fn in calls.items():
            for _ in range(a.warmup if name == "sdma" or base_member else 0):
                fn()
        per_round = {name: [] for name in calls}
        for r in range(a.rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                b.sync()
                if name == "sdma" or base_member:
                    per_round[name].append(b.time_calls(calls[name], iters))
        b.sync()
        path = path_moved(before, torch_sdma.stats())
        med = {name: slowest(b, statistics.median(ts) if ts else 0.0) for name, ts in per_round.items()}
        row = {"bytes": out_bytes, "size": human_bytes(out_bytes), "dtype": "uint8", "iters": iters,
               "rounds": a.rounds, "sdma_path": path, "match": all_ranks(b, match),
               "baseline_ranks": len(b.base_ranks)}
        for name, t in med.items():
            row.update(timing_fields(name, t, out_bytes, None))
        rows.append(with_ratio(b, row, "algbw", path, match))
    return rows


def pseudo_node_report(b, rows, where):
    layout = ",".join(f"[{','.join(str(q) for q, n in enumerate(b.pseudo.split(',')) if n == name)}]"
                      for name in dict.fromkeys(b.pseudo.split(",")))
    rails = "NVLink" if b.mode == "gpu" else "loopback TCP"
    base = (f"flat {b.base_name} over all {b.world} ranks" if len(b.base_ranks) == b.world else
            f"flat {b.base_name} over one process per GPU ({len(b.base_ranks)} ranks; NCCL refuses two ranks of one "
            f"communicator on one GPU), the same output bytes")
    lines = [f"## {SINGLE} on ONE host split into pseudo-nodes {layout} ({where})",
             "",
             f"The hierarchical path's rails cross {rails} here, not a network: this shows the schedule at work on "
             f"one host, not what it does on a cluster. Baseline: {base}. algbw = output bytes / time.",
             "",
             f"| output | sdma (hierarchical) us | {b.base_name} us | sdma algbw | {b.base_name} algbw | "
             f"sdma / {b.base_name} | sdma path | match |",
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['size']} | {r['sdma_us']:.1f} | {r[f'{b.base_name}_us']:.1f} | "
                     f"{fmt_bw(r['sdma_algbw_GBps'])} | {fmt_bw(r[f'{b.base_name}_algbw_GBps'])} | "
                     f"{r['ratio_algbw']:.2f} | {r['sdma_path']} | {'yes' if r['match'] else 'NO'} |")
    return "\n".join(lines), base


def gemm_overlap(b):
    """GEMM slowdown caused by all-gathers running beside it, as in shared/probes/memops_ag.py (gemm_time_with).

    The GEMMs run on the current (compute) stream; the all-gathers are enqueued async from a side stream, as
    FSDP/ZeRO prefetching does, and waited on at the end. Reported per configuration: GEMM time (start to end of
    the GEMMs on the compute stream) and total time (until both the GEMMs and the all-gathers are done).
    """
    a = b.args
    m = a.gemm_size
    gen = torch.Generator().manual_seed(7)
    A = torch.randn(m, m, generator=gen).to(device=b.device, dtype=torch.bfloat16)
    B = torch.randn(m, m, generator=gen).to(device=b.device, dtype=torch.bfloat16)
    C = torch.empty(m, m, dtype=torch.bfloat16, device=b.device)
    n_out = a.overlap_bytes // 2 // b.world * b.world
    if a.overlap_in_place:
        out = torch.randn(n_out, generator=gen).to(device=b.device, dtype=torch.bfloat16)
        inp = out.narrow(0, b.rank * (n_out // b.world), n_out // b.world)
    else:
        inp = torch.randn(n_out // b.world, generator=gen).to(device=b.device, dtype=torch.bfloat16)
        out = torch.empty(n_out, dtype=torch.bfloat16, device=b.device)
    side = torch.cuda.Stream()
    groups = dict(b.groups())
    # sdma's default (the direct path at these sizes) moves no staging drain through HBM: staging is measured beside
    # it, to show what that saves next to GEMMs.
    groups["sdma-staging"] = b.staging_group
    beside = ("sdma", "sdma-staging", b.base_name)

    def once(kind, with_gemm=True):
        b.sync()
        cur = torch.cuda.current_stream()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        side.wait_stream(cur)
        ev[0].record()
        # GEMMs are enqueued first and the all-gathers after them, so the GPU is already busy with GEMMs when the
        # gathers arrive. The other way round, the compute stream would sit idle while the CPU enqueues 12
        # all-gathers (about 0.4 ms), and that idle time would count as GEMM slowdown for both backends.
        if with_gemm:
            for _ in range(a.gemm_count):
                torch.mm(A, B, out=C)
        ev[1].record()
        works = []
        if kind != "alone":
            with torch.cuda.stream(side):
                works = [GATHER_SINGLE(out, inp, group=groups[kind], async_op=True)
                         for _ in range(a.overlap_gathers)]
        for w in works:
            w.wait()
        ev[2].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2])

    # The GPU's clock drifts with its temperature by a few percent over the seconds this takes (GEMMs alone were
    # 47.4 ms before and 48.7 ms after the runs beside all-gathers, 2x H200), as much as the effect measured. So the
    # configurations take turns, round after round, and each slowdown is the median over rounds of the GEMM
    # time against the same round's GEMMs alone.
    stats_before = torch_sdma.stats()
    kinds = ("alone", *beside)
    for kind in kinds:
        once(kind)  # warm-up
    runs = {kind: [] for kind in kinds}
    for r in range(a.gemm_rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            runs[kind].append(once(kind))
    gathers_alone = {name: statistics.median(once(name, with_gemm=False)[1] for _ in range(3)) for name in beside}
    path = path_moved(stats_before, torch_sdma.stats())
    alone = [g for g, _ in runs["alone"]]
    result = {"gemm_size": m, "gemm_count": a.gemm_count, "gathers": a.overlap_gathers, "rounds": a.gemm_rounds,
              "in_place": a.overlap_in_place,
              "gather_bytes": n_out * 2, "gemm_alone_ms": statistics.median(alone),
              "gemm_alone_min_ms": min(alone), "gemm_alone_max_ms": max(alone), "sdma_path": path,
              "gemm_alone_rounds_ms": alone, "beside": list(beside)}
    for name in beside:
        result[f"gemm_beside_{name}_ms"] = statistics.median(g for g, _ in runs[name])
        per_round = [100 * (g / base - 1) for (g, _), base in zip(runs[name], alone)]
        result[f"gemm_slowdown_{name}_pct"] = statistics.median(per_round)
        result[f"gemm_slowdown_{name}_rounds_pct"] = per_round
        quartiles = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
        result[f"gemm_slowdown_{name}_iqr_pct"] = [quartiles[0], quartiles[2]]
        result[f"total_with_{name}_ms"] = statistics.median(t for _, t in runs[name])
        result[f"gathers_alone_{name}_ms"] = gathers_alone[name]
    # The ranks' figures differ slightly; rank 0's are reported (the probe did the same).
    return result


def enqueue_cost(b):
    """CPU time of one async all_gather_single call, per backend, size and form; batches alternate between
    backends and each batch is waited on and synchronized so that no queue fills up and throttles the calls being
    timed."""
    a = b.args
    batch = 20
    groups = [("sdma", b.dma_group), ("sdma-staging", b.staging_group), (b.base_name, b.base_group)]
    rows = []
    for size in a.enqueue_sizes:
        n_out = size // 2 // b.world * b.world
        for form in ("out", "in"):
            out = torch.empty(n_out, dtype=torch.bfloat16, device=b.device)
            if form == "in":
                inp = out.narrow(0, b.rank * (n_out // b.world), n_out // b.world)
            else:
                inp = torch.randn(n_out // b.world, device=b.device).to(torch.bfloat16)
            samples = {name: [] for name, _ in groups}

            def run_batch(group, record):
                works = []
                for _ in range(batch):
                    t0 = time.perf_counter_ns()
                    w = GATHER_SINGLE(out, inp, group=group, async_op=True)
                    t1 = time.perf_counter_ns()
                    works.append(w)
                    if record is not None:
                        record.append((t1 - t0) / 1e3)
                for w in works:
                    w.wait()
                b.sync()

            for _, group in groups:
                run_batch(group, None)  # warm-up
            before = torch_sdma.stats(b.dma_group)
            before_staging = torch_sdma.stats(b.staging_group)
            for i in range(max(1, a.enqueue_iters // batch)):
                order = groups if i % 2 == 0 else groups[::-1]
                for name, group in order:
                    run_batch(group, samples[name])
            rows.append({
                "output_bytes": n_out * 2, "form": form,
                "paths": {"sdma": path_moved(before, torch_sdma.stats(b.dma_group)),
                          "sdma-staging": path_moved(before_staging, torch_sdma.stats(b.staging_group))},
                "backends": {name: {"calls": len(s), "median_us": statistics.median(s),
                                    "mean_us": statistics.fmean(s), "p90_us": sorted(s)[int(0.9 * (len(s) - 1))]}
                             for name, s in samples.items()}})
    return {"base": b.base_name, "rows": rows}


def enqueue_markdown(enqueue):
    """The enqueue-cost table: one row per size, form and backend, with the median's ratio to the base backend's."""
    base = enqueue["base"]
    lines = [f"## CPU cost of enqueueing one async {SINGLE} (bf16; lower is better)\n",
             f"| output | form | backend | path | calls | median us | mean us | p90 us | median / {base} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in enqueue["rows"]:
        ref = r["backends"][base]["median_us"]
        for name, e in r["backends"].items():
            lines.append(f"| {human_bytes(r['output_bytes'])} | {r['form']} | {name} | {r['paths'].get(name, base)} "
                         f"| {e['calls']} | {e['median_us']:.1f} | {e['mean_us']:.1f} | {e['p90_us']:.1f} "
                         f"| {e['median_us'] / ref:.2f} |")
    return "\n".join(lines) + "\n"


def captured_replay(b):
    """A CUDA graph of --captured-calls all_gather_single per backend, both captured the same way, replayed in
    alternating rounds: microseconds per all-gather inside a replay."""
    a = b.args
    rows = []
    for size in a.captured_sizes:
        n_out = size // 2 // b.world * b.world
        gen = torch.Generator().manual_seed(2000 + b.rank)
        inp = torch.randn(n_out // b.world, generator=gen).to(device=b.device, dtype=torch.bfloat16)
        graphs, outs = {}, {}
        stats_before = torch_sdma.stats()
        for name, group in b.groups():
            out = torch.empty(n_out, dtype=torch.bfloat16, device=b.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph, as torch.cuda.graph asks
                GATHER_SINGLE(out, inp, group=group)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(a.captured_calls):
                    GATHER_SINGLE(out, inp, group=group)
            out.zero_()
            graph.replay()
            b.sync()
            graphs[name], outs[name] = graph, out
        match = torch.equal(outs["sdma"], outs[b.base_name])
        path = path_moved(stats_before, torch_sdma.stats())
        per_round = {name: [] for name, _ in b.groups()}
        for r in range(a.rounds):
            order = b.groups() if r % 2 == 0 else b.groups()[::-1]
            for name, _ in order:
                b.sync()
                per_round[name].append(b.time_calls(graphs[name].replay, 1) / a.captured_calls)
        b.sync()
        row = {"bytes": n_out * 2, "size": human_bytes(n_out * 2), "calls_per_graph": a.captured_calls,
               "sdma_path": path, "match": all_ranks(b, match)}
        for name, ts in per_round.items():
            t = slowest(b, statistics.median(ts))
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_busbw_GBps"] = n_out * 2 * (b.world - 1) / b.world / t / 1e9
        row["ratio_busbw"] = row[f"{b.base_name}_us"] / row["sdma_us"]
        rows.append(row)
        b.log(f"  captured {row['size']}: sdma {row['sdma_us']:.1f} us ({path}), {b.base_name} "
              f"{row[f'{b.base_name}_us']:.1f} us, sdma / {b.base_name} {row['ratio_busbw']:.2f}, match {match}")
        del graphs, outs
        torch.cuda.synchronize()
    return rows


def staging_across_groups(b, groups=8, size=64 * MIB):
    """Staging held by `groups` new sdma groups over the same GPUs after one all-gather of `size` each, and the device
    memory they hold; then given back by destroying them."""
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    made = [dist.new_group() for _ in range(groups)]
    n_out = size // 2 // b.world * b.world
    inp = torch.randn(n_out // b.world, device=b.device).to(torch.bfloat16)
    out = torch.empty(n_out, dtype=torch.bfloat16, device=b.device)
    for g in made:
        GATHER_SINGLE(out, inp, group=g)
    torch.cuda.synchronize()
    staging = sum(torch_sdma.staging_bytes(g) for g in made)
    free_with, _ = torch.cuda.mem_get_info()
    for g in made:
        dist.destroy_process_group(g)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    return {"groups": groups, "gather_bytes": n_out * 2, "staging_bytes": staging,
            "device_bytes_held": free_before - free_with, "device_bytes_after_destroy": free_before - free_after,
            "default_group_staging_bytes": torch_sdma.staging_bytes()}


def peer_sweep(b):
    """Every all-gather a user could pick (allgather_peers.py) beside sdma, out of place and in place, on the sweep's
    sizes: busbw per peer and form, each checked for its bytes, and our ratios to the best peer, to the baseline and
    to the limit (the fastest raw schedule, each timed in the same rounds)."""
    a = b.args
    sizes = [s for s in b.sizes if s // b.world >= 2]
    per_rank = {s: s // b.world // 2 * 2 for s in sizes}  # whole bf16 elements from each rank
    peers = [GroupPeer("sdma", None, b.rank, b.world, b.device),
             GroupPeer("sdma-direct", b.direct_group, b.rank, b.world, b.device),
             GroupPeer("sdma-staging", b.staging_group, b.rank, b.world, b.device),
             GroupPeer(b.base_name, b.base_group, b.rank, b.world, b.device)]
    unavailable = {}
    nccl_ce = {}
    if b.mode == "gpu":
        peers += [SymmMemAllGather(b.base_group, b.rank, b.world, b.device),
                  CopyEngineLimit(b.base_group, b.rank, b.world, b.device),
                  CopyEngineLimitLegacyIpc(b.base_group, b.rank, b.world, b.device)]
        why = nccl_ce_unavailable()
        if not why:
            # Its own processes, while these wait: NCCL reads NCCL_CTA_POLICY once per process.
            b.log("  nccl-ce: in processes of its own (NCCL_CTA_POLICY=2)")
            port = [free_port() if b.rank == 0 else 0]
            dist.broadcast_object_list(port, src=0)
            b.sync()
            nccl_ce = run_nccl_ce(b.rank, b.world, int(os.environ.get("LOCAL_RANK", 0)),
                                  [per_rank[s] * b.world for s in sizes], a.rounds, b.iters_for,
                                  a.out_dir / "nccl_ce_peer.json", port[0])
            b.sync()
            why = nccl_ce.get("error", "")
        if why:
            unavailable["nccl-ce"] = why
    else:
        gpu_only = ("nccl-ce", "symm-mem-ce", "ce-limit", "ce-limit-ipc")
        unavailable.update({name: "needs CUDA tensors" for name in gpu_only})
    for peer in peers:
        if peer.why_not:
            unavailable[peer.name] = peer.why_not
    live = [p for p in peers if not p.why_not]
    rows = []
    for size in sizes:
        n = per_rank[size]
        out_bytes = n * b.world
        prepared, match = {}, {}
        for p in live:
            # A peer that fails to set up is reported as n/a with its error, not the end of the benchmark.
            try:
                prepared[p.name] = p.prepare(n)
                for form in p.forms:
                    match[(p.name, form)] = prepared[p.name][form][1]()
            except Exception as e:  # noqa: BLE001
                unavailable[p.name] = f"failed at {human_bytes(out_bytes)}: {type(e).__name__}: {e}"
                prepared.pop(p.name, None)
        live = [p for p in live if p.name in prepared]
        entries = [(p.name, form) for p in live for form in p.forms]
        b.sync()
        iters = b.iters_for(out_bytes)
        per_round = {e: [] for e in entries}
        # How the timed calls' pairs settled, per sdma group: one rank moving both directions halves a call's rate.
        ours = [p for p in live if isinstance(p, GroupPeer) and p.name.startswith("sdma")]
        pairs_before = {p.name: direct_pairs(p.group) for p in ours}
        for r in range(a.rounds):
            for e in (entries if r % 2 == 0 else entries[::-1]):
                b.sync()
                per_round[e].append(b.time_calls(prepared[e[0]][e[1]][0], iters))
        b.sync()
        row = {"bytes": out_bytes, "size": human_bytes(out_bytes), "iters": iters, "unavailable": dict(unavailable)}
        row["direct_pairs"] = {p.name: dict(zip(PAIR_KINDS, (now - then for now, then in zip(direct_pairs(p.group),
                                                                                            pairs_before[p.name]))))
                               for p in ours}
        for (name, form), ts in per_round.items():
            row[f"{name}_{form}"] = {"us": slowest(b, statistics.median(ts)) * 1e6,
                                     "match": all_ranks(b, match[(name, form)])}
        for form, got in (nccl_ce.get(str(out_bytes)) or {}).items():
            row[f"nccl-ce_{form}"] = {"us": got["seconds"] * 1e6, "match": got["match"]}
        for key, v in list(row.items()):
            if isinstance(v, dict) and "us" in v:
                v["busbw_GBps"] = out_bytes * (b.world - 1) / b.world / (v["us"] / 1e6) / 1e9
        # The raw schedules go to a table of their own; the fastest with right bytes on every rank is ce-limit.
        raw = {s: row.pop(f"ce-limit_{s}") for s in RAW_SCHEDULES if f"ce-limit_{s}" in row}
        if raw:
            row["raw"] = raw
            right = [s for s, v in raw.items() if v["match"]]
            best = min(right or raw, key=lambda s: raw[s]["us"])
            row["ce-limit_out"] = dict(raw[best], schedule=best)
        # Ratios of times (of bandwidths, the same thing), so that they are defined on one rank too.
        for form in FORMS:
            others = {k.rsplit("_", 1)[0]: v["us"] for k, v in row.items()
                      if k.endswith(f"_{form}") and isinstance(v, dict) and v.get("match")
                      and not k.startswith(("sdma", "ce-limit"))}
            best = min(others, key=others.get) if others else None
            if best:
                row[f"best_peer_{form}"] = best
            base = row.get(f"{b.base_name}_{form}")
            for ours in RATIO_ROWS:
                got = row.get(f"{ours}_{form}")
                if got and best:
                    row[f"{ours}_over_best_{form}"] = others[best] / got["us"]
                if got and base:
                    row[f"{ours}_over_base_{form}"] = base["us"] / got["us"]
                if got and "ce-limit_out" in row:
                    row[f"{ours}_over_limit_{form}"] = row["ce-limit_out"]["us"] / got["us"]
        rows.append(row)
        # One line per size as it is measured; the figures are in the tables at the end.
        timed = {k: v for k, v in row.items() if isinstance(v, dict) and "us" in v and k != "ce-limit_out"}
        timed |= {f"raw {s}": v for s, v in raw.items()}
        wrong = [k for k, v in timed.items() if not v["match"]]
        b.log(f"  peers {row['size']:>8}: {len(timed)} rows timed, "
              + (f"WRONG BYTES in {', '.join(wrong)}" if wrong else "all bytes right")
              + f", best peer {row.get('best_peer_out', 'n/a')} / {row.get('best_peer_in', 'n/a')} (out / in)"
              + (f", ce-limit {fmt_bw(row['ce-limit_out']['busbw_GBps'])} GB/s "
                 f"({RAW_SCHEDULES[row['ce-limit_out']['schedule']]})" if raw else ""))
        del prepared
        if b.mode == "gpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


PEER_COLUMNS = ("sdma", "sdma-direct", "sdma-staging", "nccl", "gloo", "nccl-ce", "symm-mem-ce",
                "ce-limit", "ce-limit-ipc")
# Our rows whose ratios to the best peer, to the baseline and to the limit the peer table gives.
RATIO_ROWS = ("sdma", "sdma-direct")
SHORT = {"sdma-direct": "dir"}


def peer_table(rows, base):
    """busbw (GB/s) per peer and form; "n/a" where the peer lacks the form or this machine lacks the peer. Then our
    rows' bandwidth over the best peer's (with right bytes), over the baseline's (`base`) and over ce-limit's."""
    if not rows:
        return ""
    # Only the peers this machine has: the notes below the table say why each other one is n/a. Short ratio
    # headers ("dir/best": sdma-direct over the best peer), so that the header stays under 200 characters.
    cols = [c for c in PEER_COLUMNS if any(f"{c}_{f}" in r for r in rows for f in FORMS)
            or (c.startswith("ce-limit") and f"{c}_out" in rows[0])]
    ours = [c for c in RATIO_ROWS if c in cols]
    ratios = (("best", "best"), ("base", base), ("limit", "limit"))
    lines = ["| output | form | " + " | ".join(cols) + " | best peer | "
             + " | ".join(f"{SHORT.get(c, c)}/{head}" for c in ours for _, head in ratios) + " |",
             "|" + "---|" * (len(cols) + 3 + len(ratios) * len(ours))]
    for r in rows:
        for form in FORMS:
            cells = [bw_cell(r.get(f"{c}_{form}") or (r.get(f"{c}_out") if c.startswith("ce-limit") else None))
                     for c in cols]
            got = [r.get(f"{c}_over_{what}_{form}") for c in ours for what, _ in ratios]
            lines.append(f"| {r['size']} | {form} | " + " | ".join(cells) + f" | {r.get(f'best_peer_{form}', '')} | "
                         + " | ".join("" if x is None else f"{x:.2f}" for x in got) + " |")
    notes = [f"- {name}: n/a, {why}" for name, why in rows[0]["unavailable"].items() if why]
    notes.append(f"- a/b: a's busbw over b's; {', '.join(f'{v}: {k}' for k, v in SHORT.items() if k in ours)}; best: "
                 f"the best peer with right bytes (best peer); limit: ce-limit")
    if "ce-limit" in cols:
        notes.append("- ce-limit: the fastest raw schedule at each size (out of place; the in-place rows are measured "
                     "against it too), from the raw schedules' table")
    # Both forms' timed calls together: a pair in which one rank moved both directions ran at about half the rate.
    pairs = [f"{r['size']} {name} " + "/".join(str(v.get(kind, 0)) for kind in PAIR_KINDS)
             for r in rows for name, v in r.get("direct_pairs", {}).items() if sum(v.values())]
    if pairs:
        notes.append("- this rank's direct-path pairs in the timed calls, each pushing its own bytes / one moving "
                     "both: " + ", ".join(pairs))
    return "\n".join(lines + ([""] + notes if notes else []))


def raw_unavailable(b, peers):
    """Why the raw schedules' table is empty ("" where it is not)."""
    if b.mode != "gpu":
        return "no GPUs (CPU tensors have no copy engines)"
    if peers is None:
        return "--skip-peers"
    if any("raw" in r for r in peers):
        return ""
    return (peers[0]["unavailable"].get("ce-limit") if peers else "") or "no size ran them"


def bw_cell(v):
    """A timed entry's busbw for a table, WRONG after it where its bytes were wrong; n/a where it did not run."""
    return "n/a" if v is None else fmt_bw(v["busbw_GBps"]) + ("" if v["match"] else " WRONG")


def raw_table(rows):
    """busbw (GB/s) of each raw copy-engine schedule per size, and the fastest (ce-limit); "" where none ran."""
    rows = [r for r in rows if "raw" in r]
    if not rows:
        return ""
    keys = [k for k in RAW_SCHEDULES if any(k in r["raw"] for r in rows)]
    lines = ["| output | " + " | ".join(RAW_SCHEDULES[k] for k in keys) + " | fastest (ce-limit) |",
             "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        cells = [bw_cell(r["raw"].get(k)) for k in keys]
        lines.append(f"| {r['size']} | " + " | ".join(cells) + f" | {RAW_SCHEDULES[r['ce-limit_out']['schedule']]} |")
    return "\n".join(lines)


def raw_rows(rows):
    """The raw schedules' figures as flat rows (the CSV's)."""
    flat = []
    for r in rows:
        if "raw" not in r:
            continue
        row = {"bytes": r["bytes"], "size": r["size"], "fastest": r["ce-limit_out"]["schedule"]}
        for k in RAW_SCHEDULES:
            v = r["raw"].get(k)
            if v:
                row |= {f"{k}_us": v["us"], f"{k}_busbw_GBps": v["busbw_GBps"], f"{k}_match": v["match"]}
        flat.append(row)
    return flat


def plot_peers(b, rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    x = [r["bytes"] for r in rows]
    for c in PEER_COLUMNS:
        for form, style in (("out", "-"), ("in", "--")):
            ys = [(r.get(f"{c}_{form}") or {}).get("busbw_GBps") for r in rows]
            if any(y is not None for y in ys):
                ax.plot(x, ys, "o" + style, label=f"{c} ({'in place' if form == 'in' else 'out of place'})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [r["size"] for r in rows], rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_xlabel("all-gather output size")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sdma_version():
    try:
        return importlib.metadata.version("torch_sdma")
    except importlib.metadata.PackageNotFoundError:  # used from a source tree without being installed
        return None


def machine_info(b):
    info = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_sdma": sdma_version(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "world_size": b.world, "mode": b.mode}
    if b.mode == "gpu":
        info |= {"gpu": torch.cuda.get_device_name(b.device), "gpu_count": torch.cuda.device_count(),
                 "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    info["env"] = {k: v for k, v in os.environ.items()
                   if k.startswith(("TORCH_SDMA_", "NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_",
                                    "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"))}
    return info


def fmt_bw(x):
    """GB/s with enough digits to tell small sizes apart (0.012) without cluttering large ones (315.2)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def markdown_table(b, rows):
    base = b.base_name
    head = (f"| output | sdma us | {base} us | sdma algbw | {base} algbw | sdma busbw | {base} busbw "
            f"| sdma / {base} | sdma path | match |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        bws = " | ".join(fmt_bw(r[f"{name}_{kind}_GBps"]) for kind in ("algbw", "busbw") for name in ("sdma", base))
        lines.append(f"| {r['size']} | {r['sdma_us']:.1f} | {r[f'{base}_us']:.1f} | {bws} "
                     f"| {r['ratio_busbw']:.2f} | {r['sdma_path']} | {'yes' if r['match'] else 'NO'} |")
    return "\n".join(lines)


def plot(b, rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        b.log(f"matplotlib is not installed: no plot ({path} not written)")
        return None
    # Log-log: the sweep spans five orders of magnitude in size and three in bandwidth.
    fig, (ax, ax_ratio) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1])
    x = [r["bytes"] for r in rows]
    for name, style in (("sdma", "o-"), (b.base_name, "s--")):
        ax.plot(x, [r[f"{name}_busbw_GBps"] for r in rows], style, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax_ratio.plot(x, [r["ratio_busbw"] for r in rows], "o-", color="black")
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_ylabel(f"sdma / {b.base_name}")
    ax_ratio.grid(True, alpha=0.3)
    ax_ratio.set_xscale("log", base=2)
    ax_ratio.set_xticks(x, [r["size"] for r in rows], rotation=45, ha="right")
    ax_ratio.set_xlabel("all-gather output size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main():
    args = parse_args()
    b = Bench(args)
    info = machine_info(b)
    where = f"{info['gpu']} x{b.world}" if b.mode == "gpu" else f"{info['cpu']}, {b.world} processes"
    b.log(f"# all-gather: sdma vs {b.base_name}, {b.mode} mode, {where}, torch {torch.__version__}")
    if b.pseudo:
        pseudo_main(b, info, where)
        return
    rows = sweep(b)
    peers = None
    if not args.skip_peers:
        b.log("# every all-gather a user could pick, both forms")
        args.out_dir.mkdir(parents=True, exist_ok=True)
        peers = peer_sweep(b)
    # The GPU-only measurements, each skippable.
    extra = {}
    for key, skip, label, measure in (("captured", args.skip_captured, "captured replay", captured_replay),
                                      ("groups", args.skip_groups, "staging across groups", staging_across_groups),
                                      ("overlap", args.skip_gemm, "GEMM overlap", gemm_overlap),
                                      ("enqueue", args.skip_enqueue, "CPU enqueue cost", enqueue_cost)):
        if b.mode == "gpu" and not skip:
            b.log(f"# {label}")
            extra[key] = measure(b)
    captured, groups, overlap, enqueue = (extra.get(k) for k in ("captured", "groups", "overlap", "enqueue"))
    b.sync()
    if b.rank == 0:
        tag = f"{b.mode}_w{b.world}"
        args.out_dir.mkdir(parents=True, exist_ok=True)
        table = markdown_table(b, rows)
        peers_table = peer_table(peers, b.base_name) if peers else None
        raw = {"names": RAW_SCHEDULES, "rows": raw_rows(peers or []), "markdown": raw_table(peers or []),
               "unavailable": raw_unavailable(b, peers)}
        print(f"\n## {SINGLE}, {where}, "
              f"{rows[0]['dtype'] if rows else ''}; busbw = out*(w-1)/w/t, GB/s\n\n{table}\n")
        if peers:
            print(f"## Every all-gather a user could pick, {where}; busbw GB/s (examples/allgather_peers.py)\n\n"
                  f"{peers_table}\n")
        if raw["markdown"]:
            print(f"## Raw copy-engine schedules, {where}: not all-gathers, each rank's n bytes copied into every "
                  f"peer's output (pulls: fetched from every peer's), plain copies, no ordering between ranks, all "
                  f"ranks at once; busbw = out*(w-1)/w/t, GB/s\n\n{raw['markdown']}\n")
        else:
            print(f"## Raw copy-engine schedules: n/a, {raw['unavailable']}\n")
        if overlap:
            print(f"## GEMM overlap: {overlap['gemm_count']} bf16 {overlap['gemm_size']}^3 GEMMs beside "
                  f"{overlap['gathers']} all-gathers of {human_bytes(overlap['gather_bytes'])}"
                  f"{' (in place)' if overlap['in_place'] else ''}, "
                  f"{overlap['rounds']} interleaved rounds; slowdown: median over rounds against the round's GEMMs "
                  f"alone\n")
            print("| configuration | GEMM ms | GEMM slowdown | middle half of rounds | total ms | "
                  "all-gathers alone ms |")
            print("|---|---|---|---|---|---|")
            print(f"| GEMMs alone | {overlap['gemm_alone_ms']:.2f} (min {overlap['gemm_alone_min_ms']:.2f}, max "
                  f"{overlap['gemm_alone_max_ms']:.2f}) | | | | |")
            for name in overlap["beside"]:
                lo, hi = overlap[f'gemm_slowdown_{name}_iqr_pct']
                print(f"| beside {name} | {overlap[f'gemm_beside_{name}_ms']:.2f} "
                      f"| {overlap[f'gemm_slowdown_{name}_pct']:+.1f}% | {lo:+.1f}% to {hi:+.1f}% "
                      f"| {overlap[f'total_with_{name}_ms']:.2f} | {overlap[f'gathers_alone_{name}_ms']:.2f} |")
            print(f"\nsdma path during the overlap runs: {overlap['sdma_path']}\n")
        if captured:
            print(f"## CUDA graph replay: {args.captured_calls} {SINGLE} (bf16) per graph, both backends "
                  f"captured the same way; per all-gather\n")
            print(f"| output | sdma us | {b.base_name} us | sdma busbw | {b.base_name} busbw | sdma / {b.base_name} "
                  f"| sdma path | match |\n|---|---|---|---|---|---|---|---|")
            for r in captured:
                print(f"| {r['size']} | {r['sdma_us']:.1f} | {r[f'{b.base_name}_us']:.1f} | "
                      f"{fmt_bw(r['sdma_busbw_GBps'])} | {fmt_bw(r[f'{b.base_name}_busbw_GBps'])} | "
                      f"{r['ratio_busbw']:.2f} | {r['sdma_path']} | {'yes' if r['match'] else 'NO'} |")
            print()
        if groups:
            print(f"## Staging across groups: {groups['groups']} new groups over the same GPUs, one "
                  f"{human_bytes(groups['gather_bytes'])} all-gather each (per rank)\n")
            print("| staging of the groups | device memory they held | left after destroying them | "
                  "default group's staging |\n|---|---|---|---|")
            print(f"| {groups['staging_bytes'] / MIB:.0f} MiB | {groups['device_bytes_held'] / MIB:.0f} MiB | "
                  f"{groups['device_bytes_after_destroy'] / MIB:.0f} MiB | "
                  f"{groups['default_group_staging_bytes'] / MIB:.0f} MiB |\n")
        if enqueue:
            print(enqueue_markdown(enqueue))
        csv_path = args.out_dir / f"allgather_{tag}.csv"
        with open(csv_path, "w", newline="") as f:
            fields = [k for k in rows[0] if not k.endswith("_rounds_us")] if rows else []
            w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        raw_csv = None
        if raw["rows"]:
            raw_csv = args.out_dir / f"allgather_{tag}_raw.csv"
            with open(raw_csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in raw["rows"] for k in r)))
                w.writeheader()
                w.writerows(raw["rows"])
        png = plot(b, rows, args.out_dir / f"allgather_{tag}.png",
                   f"{SINGLE} busbw, {where}") if rows else None
        peers_png = plot_peers(b, peers, args.out_dir / f"allgather_{tag}_peers.png",
                               f"all-gather busbw of every peer, {where}") if peers else None
        json_path = args.out_dir / f"allgather_{tag}.json"
        json_path.write_text(json.dumps({
            "command": " ".join(sys.orig_argv), "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": info, "baseline": b.base_name, "sweep": rows, "gemm_overlap": overlap,
            "enqueue_cost": enqueue, "captured_replay": captured, "staging_across_groups": groups,
            "peers": peers, "markdown": table, "peers_markdown": peers_table, "raw_schedules": raw}, indent=2))
        print("wrote", ", ".join(str(p) for p in (csv_path, raw_csv, json_path, png, peers_png) if p))
    dist.destroy_process_group()


def pseudo_main(b, info, where):
    b.log(f"# pseudo-nodes {b.pseudo} on ONE host (test-only TORCH_SDMA_TEST_PSEUDO_NODES): not a multi-node result")
    rows = pseudo_node_sweep(b)
    b.sync()
    if b.rank == 0:
        table, base = pseudo_node_report(b, rows, where)
        print("\n" + table + "\n")
        b.args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = b.args.out_dir / f"allgather_{b.mode}_w{b.world}_pseudo_nodes"
        with open(f"{stem}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
            w.writeheader()
            w.writerows(rows)
        Path(f"{stem}.json").write_text(json.dumps({
            "command": " ".join(sys.orig_argv), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": info,
            "one_host": True, "pseudo_nodes": b.pseudo, "baseline": base, "sweep": rows, "markdown": table},
            indent=2))
        print(f"wrote {stem}.csv, {stem}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
