"""Exchange benchmark: all_to_all_single (even splits), broadcast, gather, scatter and point-to-point (a ring by
batch_isend_irecv, each rank sending to rank+1 and receiving from rank-1 as context parallelism does, and a send/recv
pipeline, rank r sending to r+1) on torch_sdma against every other way to run them on this machine, in the same run.

GPU mode (one process per GPU):      torchrun --nproc_per_node <GPUs> examples/bench_exchange.py
Two ranks sharing one GPU:           SDMA_TEST_SHARE_GPU=1 torchrun --nproc_per_node 2 examples/bench_exchange.py
CPU mode (CPU tensors):              torchrun --nproc_per_node 2 examples/bench_exchange.py --mode cpu

Per op and size (bytes per rank, 64 KiB to 1 GiB; CPU mode to 16 MiB), bus bandwidth as nccl-tests counts it
(exchange_peers.bus_bytes; point-to-point as nccl-tests' sendrecv: the bytes each rank sends), the slowest rank's
median over alternating rounds, every row's bytes checked:
- sdma:      the default group, as a user gets it (below TORCH_SDMA_MIN_BYTES the inner backend runs the op);
- sdma-dma:  a group made with TORCH_SDMA_MIN_BYTES=0: every size on sdma's DMA path;
- nccl:      torch's NCCL backend (gloo in CPU mode);
- nccl-ce:   NCCL's zero-CTA copy-engine path with windows registered through torch symmetric memory, where NCCL
             has the op (exchange_peers.py, processes of their own);
- symm-mem:  torch symmetric memory's NVSHMEM collectives, where it has the op (processes of their own);
- ce-limit:  not the op: the bytes the op moves between ranks pushed into peers' memory (mapped by torch symmetric
             memory) with plain copy-engine copies, a stream per receiver, no ordering. What these links and engines
             do with those bytes.
Ratios: sdma's and sdma-dma's bandwidth over nccl's (gloo's), sdma-dma's over the best other row's with right bytes
and over ce-limit's. A note under the table names the rows that ran, op by op, and who sends to whom.
Point-to-point of CUDA tensors takes sdma's copy-engine runner (docs/design.md, "Point-to-point"); the path column
says which path ran. NCCL refuses two ranks of one communicator on one GPU: with ranks sharing GPUs the
nccl, nccl-ce, symm-mem and ce-limit rows say so, and so does the sdma row (its small sizes go to the inner NCCL);
sdma-dma runs alone.

GEMM slowdown (GPU): --gemm-count bf16 GEMMs on the compute stream while --overlap-calls of each op (--overlap-bytes
per rank) run async from a side stream, against the same round's GEMMs alone; the median over --gemm-rounds
interleaved rounds, for sdma-dma and nccl (as examples/bench_allgather.py measures it for all-gathers).

Prints a markdown table; writes exchange_<mode>_w<world>.{json,md} under --out-dir.
"""
import argparse
import json
import os
import statistics
import sys
import time

import bench_allgather
import torch
import torch.distributed as dist
from allgather_peers import CopyEngineLimit, free_port, hashed_bytes, symm_mem_unavailable
from bench_allgather import all_ranks, fmt_bw, machine_info, slowest
from exchange_harness import EXCHANGE_OPS
from exchange_peers import OPS, P2P_OPS, ROOT, OpBuffers, bus_bytes, peer_unavailable, run_peer

# After bench_allgather, which finds torch_sdma beside examples/ in a checkout that is not installed.
import torch_sdma
from torch_sdma.check import human_bytes, new_group_with_env, parse_bytes, peer_order

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1 * GIB]
PEERS = ("nccl-ce", "symm-mem")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CUDA tensors vs NCCL; cpu: CPU tensors vs gloo; auto: gpu if a GPU is visible")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of: " + ", ".join(OPS))
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                   help="comma-separated bytes per rank (e.g. 64K,1M,1G); default: 64 KiB to 1 GiB")
    p.add_argument("--max-bytes", type=parse_bytes, help="drop sizes above this (default: 1G on GPU, 16M on CPU)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per size and row (median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size and row")
    p.add_argument("--max-iters", type=int, default=200, help="most calls in one timed round")
    p.add_argument("--min-iters", type=int, default=3, help="fewest calls in one timed round")
    p.add_argument("--skip-peers", action="store_true", help="GPU: skip nccl-ce and symm-mem (their own processes)")
    p.add_argument("--skip-gemm", action="store_true", help="GPU: skip the GEMM slowdown")
    p.add_argument("--gemm-size", type=int, default=8192, help="M=N=K of the bf16 GEMMs")
    p.add_argument("--gemm-count", type=int, default=30, help="GEMMs per overlap round")
    p.add_argument("--gemm-rounds", type=int, default=15, help="interleaved rounds of the GEMM slowdown")
    p.add_argument("--overlap-calls", type=int, default=12, help="calls of the op beside the GEMMs")
    p.add_argument("--overlap-bytes", type=parse_bytes, default=256 * MIB, help="bytes per rank of those calls")
    p.add_argument("--out-dir", default="results")
    return p.parse_args()


class Bench(bench_allgather.Bench):
    """Rank, device, the groups of the rows, and why a row is n/a for every op; log, sync, iters_for and time_calls
    as the all-gather benchmark's, whose groups this does not make."""

    def __init__(self, args):  # not super().__init__: that makes the all-gather benchmark's groups
        self.args = args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        mode = args.mode
        if mode == "auto":
            mode = "gpu" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        self.mode = mode
        self.unavailable = {}
        self.ops = args.ops.split(",")
        if mode == "gpu":
            gpus = torch.cuda.device_count()
            # Ranks beyond the visible GPUs share them, as the tests' SDMA_TEST_SHARE_GPU=1 runs do.
            self.shared = self.world > gpus
            self.device = torch.device("cuda", self.local_rank % gpus)
            torch.cuda.set_device(self.device)
            dist.init_process_group("cpu:gloo,cuda:sdma")
            self.base_name = "nccl"
        else:
            self.shared = False
            self.device = torch.device("cpu")
            dist.init_process_group("cpu:sdma")
            self.base_name = "gloo"
        # Barriers and the slowest rank's figures go through gloo: with GPUs shared, no NCCL could run them.
        self.cpu_group = dist.new_group(backend="gloo")
        self.dma_group = new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_LOG="0")
        self.base_group = None
        if self.shared:
            why = f"NCCL refuses two ranks of one communicator on one GPU ({self.world} ranks, {gpus} GPU(s))"
            self.unavailable["sdma"] = f"below TORCH_SDMA_MIN_BYTES its ops go to the inner NCCL: {why}"
            for name in ("nccl", *PEERS, "ce-limit"):
                self.unavailable[name] = why
        else:
            self.base_group = dist.new_group(backend=self.base_name)
            if mode == "gpu" and symm_mem_unavailable():
                self.unavailable["ce-limit"] = symm_mem_unavailable()
        if mode == "cpu":
            for name in (*PEERS, "ce-limit"):
                self.unavailable[name] = "needs CUDA tensors"
        max_bytes = args.max_bytes or (GIB if mode == "gpu" else 16 * MIB)
        # Whole bytes to every rank for all_to_all_single; the same count for every op, peers included.
        self.sizes = [s // self.world * self.world for s in (args.sizes or DEFAULT_SIZES) if s <= max_bytes]

    def groups(self):
        """(row, group) of the rows that run in these processes through torch.distributed."""
        rows = [("sdma", None), ("sdma-dma", self.dma_group), (self.base_name, self.base_group)]
        return [(name, g) for name, g in rows if name not in self.unavailable]

    def alloc(self, k):
        return torch.empty(k, dtype=torch.uint8, device=self.device)


def op_path(before, after, op):
    """The sdma path(s) whose counters `op` moved between two torch_sdma.stats() snapshots (point-to-point: its
    sends' and its recvs')."""
    counted = ("send", "recv") if op in P2P_OPS else (op,)
    names = tuple(f"{c}:" for c in counted)
    legacy = {f"delegated:{EXCHANGE_OPS[c]}" for c in counted}
    moved = [k for k, v in after.items() if (k.startswith(names) or k in legacy)
             and v.get("calls", 0) > before.get(k, {}).get("calls", 0)]
    return "+".join(sorted(moved)) or "none"


class LimitPushes:
    """ce-limit for one op: the bytes `op` moves between ranks, pushed by each rank that sends them into its slot of
    each receiver's buffer (CopyEngineLimit.map_peers), unordered, a stream per receiver, the receivers rotated from
    rank + 1 (the all-gather's fastest raw schedule); check() looks at what the receivers got."""

    def __init__(self, b, op, n):
        self.b, self.op = b, op
        self.slot = s = n // b.world if op == "all_to_all_single" else n
        limit = CopyEngineLimit(b.base_group, b.rank, b.world, b.device)
        self.buf, bufs, self.keep = limit.map_peers(b.world * s)
        self.sent = hashed_bytes(b.rank, n * (b.world if op == "scatter" else 1), b.device)
        self.pushes = []  # (destination view, source, stream)
        for p in peer_order(b.rank, b.world, "rotated"):
            view = bufs[p][b.rank * s:(b.rank + 1) * s]
            if op == "all_to_all_single" or (op == "scatter" and b.rank == ROOT):  # p's own part
                src = self.sent[p * s:(p + 1) * s]
            elif (op == "broadcast" and b.rank == ROOT) or (op == "gather" and p == ROOT):  # the whole input
                src = self.sent
            elif op in P2P_OPS and p == (b.rank + 1) % b.world and (op != "send_recv_pipeline"
                                                                     or b.rank < b.world - 1):
                src = self.sent
            else:
                continue
            self.pushes.append((view, src, torch.cuda.Stream(device=b.device)))

    def call(self):
        cur = torch.cuda.current_stream()
        for dst, src, stream in self.pushes:
            stream.wait_stream(cur)
            with torch.cuda.stream(stream):
                dst.copy_(src)
        for _, _, stream in self.pushes:
            cur.wait_stream(stream)

    def check(self):
        b = self.b
        self.buf.fill_(0xA5)
        b.sync()
        self.call()
        b.sync()
        prev = (b.rank - 1) % b.world
        senders = {"all_to_all_single": [q for q in range(b.world) if q != b.rank],
                   "gather": [q for q in range(b.world) if q != b.rank] if b.rank == ROOT else [],
                   "batch_isend_irecv_ring": [prev],
                   "send_recv_pipeline": [prev] if b.rank > 0 else []}.get(self.op, [ROOT] if b.rank != ROOT else [])
        s = self.slot
        for q in senders:
            whole = hashed_bytes(q, s * (b.world if self.op in ("all_to_all_single", "scatter") else 1), b.device)
            part = whole[b.rank * s:(b.rank + 1) * s] if self.op in ("all_to_all_single", "scatter") else whole
            if not torch.equal(self.buf[q * s:(q + 1) * s], part):
                return False
        return True


def sweep(b, peer_results):
    """Every op and size: the rows of these processes timed in alternating rounds, the peers' figures added."""
    a = b.args
    rows = []
    for op in b.ops:
        for n in b.sizes:
            iters = b.iters_for(n)
            calls, match = {}, {}
            before = {"sdma": torch_sdma.stats(), "sdma-dma": torch_sdma.stats(b.dma_group)}
            for name, group in b.groups():
                if f"{name}:{op}" in b.unavailable:
                    continue
                bufs = OpBuffers(op, b.rank, b.world, n, b.device, b.alloc)
                call = lambda bufs=bufs, group=group: bufs.call(group)
                try:
                    match[name] = bufs.check(call)
                except Exception as e:  # noqa: BLE001  (raised on every rank: the row is n/a from here on)
                    b.unavailable[f"{name}:{op}"] = f"failed at {human_bytes(n)}: {type(e).__name__}: {e}"[:300]
                    b.log(f"  {name} {op}: {b.unavailable[f'{name}:{op}']}")
                    continue
                calls[name] = call
            if "ce-limit" not in b.unavailable:
                limit = LimitPushes(b, op, n)
                calls["ce-limit"], match["ce-limit"] = limit.call, limit.check()
                del limit
            for call in calls.values():
                for _ in range(a.warmup):
                    call()
            per_round = {name: [] for name in calls}
            for r in range(a.rounds):
                for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                    b.sync()
                    per_round[name].append(b.time_calls(calls[name], iters))
            b.sync()
            row = {"op": op, "bytes": n, "size": human_bytes(n), "iters": iters, "rounds": a.rounds,
                   "paths": {"sdma": op_path(before["sdma"], torch_sdma.stats(), op),
                             "sdma-dma": op_path(before["sdma-dma"], torch_sdma.stats(b.dma_group), op)}}
            for name, ts in per_round.items():
                row[name] = {"us": slowest(b, statistics.median(ts)) * 1e6, "match": all_ranks(b, match[name])}
            for peer, got in peer_results.items():
                if op in got and str(n) in got[op]:
                    row[peer] = {"us": got[op][str(n)]["seconds"] * 1e6, "match": got[op][str(n)]["match"]}
            for v in row.values():
                if isinstance(v, dict) and "us" in v:
                    v["busbw_GBps"] = bus_bytes(op, n, b.world) / (v["us"] / 1e6) / 1e9
            add_ratios(row)
            rows.append(row)
            timed = {k: v for k, v in row.items() if isinstance(v, dict) and "us" in v}
            wrong = [k for k, v in timed.items() if not v["match"]]
            figures = ", ".join(f"{k} {fmt_bw(v['busbw_GBps'])}" for k, v in timed.items())
            ratios = "".join(f", {name}/{b.base_name} {row[key]:.2f}" for name, key in
                             (("sdma", "sdma_over_base"), ("sdma-dma", "dma_over_base")) if key in row)
            b.log(f"  {op:>22} {row['size']:>8}: {figures} GB/s{ratios} ({row['paths']['sdma-dma']})"
                  + (f", WRONG BYTES in {', '.join(wrong)}" if wrong else ""))
            del calls
            if b.mode == "gpu":
                torch.cuda.empty_cache()
    return rows


def add_ratios(row):
    """sdma-dma's bandwidth over nccl's, over the best other way with right bytes, and over the limit."""
    ours = row.get("sdma-dma")
    if not ours:
        return
    others = {k: v["us"] for k, v in row.items() if isinstance(v, dict) and v.get("match") and "us" in v
              and k not in ("sdma", "sdma-dma", "ce-limit")}
    for base in ("nccl", "gloo"):
        if base in others:
            row["dma_over_base"] = others[base] / ours["us"]
            if "sdma" in row:
                row["sdma_over_base"] = others[base] / row["sdma"]["us"]
    if others:
        row["best_other"] = min(others, key=others.get)
        row["dma_over_best"] = others[row["best_other"]] / ours["us"]
    if "ce-limit" in row:
        row["dma_over_limit"] = row["ce-limit"]["us"] / ours["us"]


def run_peers(b):
    """nccl-ce and symm-mem in processes of their own, while these wait; {peer: results on rank 0}."""
    results = {}
    for peer in PEERS:
        if peer in b.unavailable:
            continue
        ops = [op for op in b.ops if not peer_unavailable(peer, op)]
        for op in b.ops:
            why = peer_unavailable(peer, op)
            if why:
                b.unavailable[f"{peer}:{op}"] = why
        if not ops:
            continue
        b.log(f"  {peer}: {', '.join(ops)} in processes of their own")
        port = [free_port() if b.rank == 0 else 0]
        dist.broadcast_object_list(port, src=0, group=b.cpu_group)
        b.sync()
        got = run_peer(peer, b.rank, b.world, b.local_rank, ops, b.sizes, [b.iters_for(n) for n in b.sizes],
                       b.args.rounds, os.path.join(b.args.out_dir, f"exchange_{peer}.json"), port[0])
        b.sync()
        if "error" in got:
            b.unavailable[peer] = got["error"]
        else:
            results[peer] = got
    return results


def gemm_slowdown(b, op):
    """Median GEMM slowdown (percent) beside `op` on sdma-dma and on nccl, against the same round's GEMMs alone."""
    a = b.args
    gen = torch.Generator().manual_seed(7)
    lhs, rhs = (torch.randn(a.gemm_size, a.gemm_size, generator=gen).to(b.device, torch.bfloat16) for _ in range(2))
    product = torch.empty_like(lhs)
    n = a.overlap_bytes // b.world * b.world
    beside = {}
    for name, group in b.groups():
        # The default group takes the DMA path at these sizes, as sdma-dma does.
        if name != "sdma" and f"{name}:{op}" not in b.unavailable:
            bufs = OpBuffers(op, b.rank, b.world, n, b.device, b.alloc)
            bufs.fill()
            beside[name] = lambda bufs=bufs, group=group: bufs.call(group, async_op=True)
    side = torch.cuda.Stream()

    def gemm_ms(kind):
        b.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        start.record()
        # GEMMs first, so that the GPU is busy when the op's calls arrive (bench_allgather.gemm_overlap says why).
        for _ in range(a.gemm_count):
            torch.mm(lhs, rhs, out=product)
        end.record()
        works = []
        if kind in beside:
            with torch.cuda.stream(side):
                works = [beside[kind]() for _ in range(a.overlap_calls)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    kinds = ["alone", *beside]
    for kind in kinds:
        gemm_ms(kind)
    per_round = {kind: [] for kind in kinds}
    for r in range(a.gemm_rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            per_round[kind].append(gemm_ms(kind))
    result = {"bytes": n, "gemm_alone_ms": statistics.median(per_round["alone"])}
    for kind in beside:
        pct = [100 * (g / alone - 1) for g, alone in zip(per_round[kind], per_round["alone"])]
        result[kind] = {"slowdown_pct": statistics.median(pct), "rounds_pct": pct,
                        "gemm_ms": statistics.median(per_round[kind])}
    return result


def cell(row, name):
    v = row.get(name)
    if v is None:
        return "n/a"
    return fmt_bw(v["busbw_GBps"]) + ("" if v["match"] else " WRONG")


def markdown(b, rows, gemm, where):
    base = b.base_name
    cols = ["sdma", "sdma-dma", base] + (["nccl-ce", "symm-mem", "ce-limit"] if b.mode == "gpu" else [])
    lines = [f"## Exchange collectives, {where}; bus bandwidth GB/s (slowest rank, median of {b.args.rounds} rounds); "
             f"ratios: a/b is a's bandwidth over b's (dma: sdma-dma)", "",
             "| op | bytes/rank | " + " | ".join(cols) + f" | sdma/{base} | dma/{base} | best other | dma/best"
             + (" | dma/limit" if b.mode == "gpu" else "") + " | sdma-dma path"
             + (f" | GEMM slowdown dma / {base}" if gemm else "") + " |",
             "|" + "---|" * (len(cols) + 7 + (b.mode == "gpu") + bool(gemm))]
    for r in rows:
        ratios = [f"{r[k]:.2f}" if k in r else "" for k in ("sdma_over_base", "dma_over_base")]
        ratios += [r.get("best_other", ""), f"{r['dma_over_best']:.2f}" if "dma_over_best" in r else ""]
        if b.mode == "gpu":
            ratios.append(f"{r['dma_over_limit']:.2f}" if "dma_over_limit" in r else "")
        cells = [r["op"], r["size"], *(cell(r, c) for c in cols), *ratios, r["paths"]["sdma-dma"]]
        if gemm:
            # The GEMM slowdown on the row of the size it was measured at.
            g = gemm.get(r["op"], {})
            cells.append(" / ".join(f"{g[k]['slowdown_pct']:+.1f}%" if k in g else "n/a" for k in ("sdma-dma", base))
                         if g.get("bytes") == r["bytes"] else "")
        lines.append("| " + " | ".join(cells) + " |")
    if gemm:
        a = b.args
        lines += ["", f"GEMM slowdown: {a.gemm_count} bf16 {a.gemm_size}^3 GEMMs beside {a.overlap_calls} calls of the "
                  f"op from a side stream, median over {a.gemm_rounds} rounds against the round's GEMMs alone", "",
                  f"| op | bytes/rank | GEMMs alone ms | beside sdma-dma | beside {base} |", "|---|---|---|---|---|"]
        for op, g in gemm.items():
            lines.append(f"| {op} | {human_bytes(g['bytes'])} | {g['gemm_alone_ms']:.2f} | " + " | ".join(
                f"{g[k]['slowdown_pct']:+.1f}%" if k in g else "n/a" for k in ("sdma-dma", base)) + " |")
    notes = [f"- {name}: n/a, {why}" for name, why in b.unavailable.items()]
    notes += ran_notes(rows)
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# Who sends to whom, for rank r of w ranks (whatever w is).
TRAFFIC = {"all_to_all_single": "every rank to every rank",
           "broadcast": f"rank {ROOT} to every rank", "gather": f"every rank to rank {ROOT}",
           "scatter": f"rank {ROOT} to every rank", "batch_isend_irecv_ring": "rank r to (r+1) mod w",
           "send_recv_pipeline": "rank r to r+1, r < w-1"}


def rows_ran(rows):
    """{op: the rows timed for it at some size, right bytes or not}."""
    ran = {}
    for r in rows:
        ran.setdefault(r["op"], {}).update(dict.fromkeys(k for k, v in r.items() if isinstance(v, dict) and "us" in v))
    return {op: list(names) for op, names in ran.items()}


def ran_notes(rows):
    """Which rows ran each op, and who sent to whom."""
    return [f"- ran {op} ({TRAFFIC[op]}): {', '.join(names)}" for op, names in rows_ran(rows).items()]


def main():
    args = parse_args()
    b = Bench(args)
    info = machine_info(b)
    info["ranks_share_gpus"] = b.shared
    where = (f"{info['gpu']}, {b.world} ranks" + (" sharing GPUs" if b.shared else "") if b.mode == "gpu"
             else f"{info['cpu']}, {b.world} processes")
    b.log(f"# exchange collectives: sdma vs {b.base_name}, {b.mode} mode, {where}, torch {torch.__version__}")
    os.makedirs(args.out_dir, exist_ok=True)
    peer_results = run_peers(b) if b.mode == "gpu" and not args.skip_peers else {}
    if args.skip_peers:
        for peer in PEERS:
            b.unavailable.setdefault(peer, "--skip-peers")
    rows = sweep(b, peer_results)
    gemm = {}
    if b.mode == "gpu" and not args.skip_gemm:
        for op in b.ops:
            b.log(f"# GEMM slowdown beside {op}")
            gemm[op] = gemm_slowdown(b, op)
    b.sync()
    if b.rank == 0:
        table = markdown(b, rows, gemm, where)
        print("\n" + table)
        stem = os.path.join(args.out_dir, f"exchange_{b.mode}_w{b.world}")
        with open(f"{stem}.md", "w") as f:
            f.write(table)
        with open(f"{stem}.json", "w") as f:
            json.dump({"command": " ".join(sys.orig_argv), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "machine": info, "baseline": b.base_name, "unavailable": b.unavailable,
                       "ran": rows_ran(rows), "sweep": rows, "gemm_slowdown": gemm, "markdown": table}, f, indent=2)
        print(f"wrote {stem}.md, {stem}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
