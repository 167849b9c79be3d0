"""What the exchange training examples (moe_expert_parallel.py, pipeline_two_stage.py) share: arguments, the process
group on --backend and --device, reductions done locally, the timed step loop and a report compare_frameworks.py
reads.

The point is the same as lm_harness.py's: one training run on NCCL (or gloo) and on sdma must give BIT-IDENTICAL
losses. Here every collective only moves bytes (all-to-all, all-gather, send/recv, broadcast): whatever needs a sum
over ranks is all-gathered and added up locally, in rank order, so no backend's reduction order enters the numbers.
Losses are written as float.hex as well, so that two reports compare exactly by eye too.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import lm_harness  # sets CUBLAS_WORKSPACE_CONFIG at import, before CUDA starts
import torch
import torch.distributed as dist

# The byte-moving ops the reports count, by their names in torch_sdma.stats(): "<op>:<path>" once sdma serves them,
# "delegated:<inner name>" while they go to the inner backend. All-gathers keep their own keys ("dma...", "inner:").
EXCHANGE_OPS = {"all_to_all_single": "alltoall_base", "all_to_all": "alltoall", "broadcast": "broadcast",
                "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv"}


def add_common_args(p, default_out, default_steps):
    p.add_argument("--backend", choices=["nccl", "gloo", "sdma"], default="nccl",
                   help='sdma: `import torch_sdma`, then init_process_group("cpu:gloo,cuda:sdma") for CUDA tensors or '
                        '"cpu:sdma" for CPU tensors; nccl, gloo: that backend alone')
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the tensors live (auto: cuda where a GPU is visible)")
    p.add_argument("--steps", type=int, default=default_steps)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=default_out, help="JSON report (written by rank 0)")


def start(description, default_out, default_steps, add_args=None):
    """Arguments, deterministic kernels and the process group. Returns (args, this rank's device, a rank-0 logger)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_out, default_steps)
    if add_args:
        add_args(p)
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if args.backend == "nccl" and args.device == "cpu":
        sys.exit("--backend nccl moves CUDA tensors only: use --device cuda, or --backend gloo/sdma on the CPU")
    lm_harness.make_deterministic()
    device = init_distributed(args.backend, args.device)
    return args, device, lm_harness.rank0_logger()


def init_distributed(backend, device_type):
    """One process per rank under torchrun. Ranks beyond the visible GPUs share them (local rank modulo the count):
    sdma serves that (SDMA_TEST_SHARE_GPU=1 in the tests), NCCL refuses it, so an NCCL run says so here."""
    if backend == "sdma":
        # Before CUDA starts, as a user's `import torch_sdma` at the top of a script: it registers the backend name and
        # chooses the hardware-queue count.
        import torch_sdma  # noqa: F401
    if device_type == "cpu":
        dist.init_process_group("cpu:sdma" if backend == "sdma" else "gloo")
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ["WORLD_SIZE"])
    count = torch.cuda.device_count()
    if backend == "nccl" and world > count:
        sys.exit(f"{world} ranks on {count} GPU(s): NCCL refuses two ranks of one communicator on one GPU; "
                 f"run --backend sdma (or gloo) to share a GPU")
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    if backend == "sdma":
        dist.init_process_group("cpu:gloo,cuda:sdma")
    elif backend == "nccl":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    return device


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def sum_over_ranks(t, group=None):
    """The sum of `t` over the ranks, added up here in rank order (an all-gather moves the bytes): the same bits on
    every rank and every backend, whatever the world size."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def train(step_fn, steps, device, log, reported_loss):
    """Runs step_fn(step) for every step, timed between two device synchronizations; after each step, outside the
    timed region, reported_loss(step_output) -> float gives the step's loss. Returns (losses, step times)."""
    losses, times = [], []
    for step in range(steps):
        sync(device)
        t0 = time.perf_counter()
        out = step_fn(step)
        sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(reported_loss(out))
        log(f"step {step:4d} loss {losses[-1]!r} ({losses[-1].hex()}) time {times[-1] * 1e3:.2f} ms")
    return losses, times


def exchange_paths(groups):
    """torch_sdma's counters summed over `groups`: calls and bytes per path, and per byte-moving op how many calls took
    a DMA path; "calls" and "dma_share" over all of them (all-gathers included)."""
    import torch_sdma
    stats = {}
    groups = list({id(g): g for g in (dist.group.WORLD if g is None else g for g in groups)}.values())
    for group in groups:
        for path, c in torch_sdma.stats(group).items():
            total = stats.setdefault(path, {})
            for field, count in c.items():
                total[field] = total.get(field, 0) + count

    def calls(keys):
        return sum(stats[k].get("calls", 0) for k in keys)
    per_op = {}
    for op, inner_name in EXCHANGE_OPS.items():
        dma = [k for k in stats if k.startswith(f"{op}:dma")]
        other = [k for k in stats if k.startswith(f"{op}:inner:") or k == f"delegated:{inner_name}"]
        per_op[op] = {"calls": calls(dma + other), "dma_calls": calls(dma),
                      "direct_calls": calls(k for k in dma if k == f"{op}:dma:direct")}
    per_op["all_gather"] = {"calls": calls(k for k in stats if k == "dma" or k.startswith(("dma:", "inner:"))),
                            "dma_calls": calls(k for k in stats if k == "dma" or k.startswith("dma:")),
                            "direct_calls": calls(k for k in stats if k == "dma:direct")}
    per_op = {op: c for op, c in per_op.items() if c["calls"]}
    total = sum(c["calls"] for c in per_op.values())
    dma = sum(c["dma_calls"] for c in per_op.values())
    direct = sum(c["direct_calls"] for c in per_op.values())
    return {"stats": stats, "per_op": per_op, "calls": total, "dma_calls": dma, "direct_calls": direct,
            "dma_share": dma / total if total else 0.0, "direct_share": direct / total if total else 0.0,
            "staging_bytes": sum(torch_sdma.staging_bytes(g) for g in groups)}


def report(args, framework, device, losses, times, items_per_step, groups, extra=None):
    """Prints a summary on rank 0 and writes args.out there: the fields lm_harness.report writes (so that
    compare_frameworks.py compares these runs like the others), the losses as float.hex too, and sdma's paths."""
    steady = times[lm_harness.STARTUP_STEPS:] or times
    mean_t = statistics.fmean(steady)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    result = {
        "framework": framework, "backend": args.backend, "device": device.type, "world_size": dist.get_world_size(),
        "steps": len(losses), "losses": losses, "losses_hex": [x.hex() for x in losses], "step_times_s": times,
        "startup_steps_excluded": len(times) - len(steady), "mean_step_time_s": mean_t,
        "tokens_per_s": items_per_step * dist.get_world_size() / mean_t, "peak_memory_bytes": peak,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "hostname": socket.gethostname(),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "command": " ".join(sys.orig_argv), "args": vars(args),
    }
    if args.backend == "sdma":
        result["sdma"] = exchange_paths(groups)
    if extra:
        result |= extra
    if dist.get_rank() == 0:
        share = f", byte-moving calls on dma {result['sdma']['dma_share']:.3f}" if args.backend == "sdma" else ""
        print(f"{framework}/{args.backend}/{device.type}: {len(losses)} steps, mean step {mean_t * 1e3:.2f} ms "
              f"(first {result['startup_steps_excluded']} excluded), final loss {losses[-1]!r} "
              f"({losses[-1].hex()}){share}", flush=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result
