"""The CPU cost of enqueueing one async call on the sdma backend, per path, for comparing two builds.

Run with torchrun, two ranks (on one GPU with SDMA_TEST_SHARE_GPU=1, or two):
    torchrun --standalone --nproc_per_node 2 examples/enqueue_cost.py --label new --out results/enqueue_new.json
Each rank times `--calls` async calls in batches of 20 (each batch waited on and synchronized, so that no queue fills
up and throttles the calls being timed), for all_gather_into_tensor on the direct path, the same on staging
(TORCH_SDMA_DIRECT off, through pg_options) and the list form, an isend (rank 0) met by an irecv (rank 1) of the same
bytes, and all_to_all_single; rank 0 prints the median and p90 in microseconds and writes them as JSON. `--forms`
picks some of them. Beside the wall clock of each call, each batch's CPU time on the calling thread per call: it does
not count the time the thread waits descheduled, which moves the wall clock when two ranks and their threads share
the cores.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torch_sdma

BATCH = 20


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="this build")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--bytes", type=int, default=1 << 20, help="output bytes of each all-gather")
    p.add_argument("--out", type=Path)
    p.add_argument("--forms", default="direct,staging,list,send,all_to_all_single",
                   help="comma-separated: direct, staging, list, send, all_to_all_single")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:sdma")
    staging_options = torch_sdma.ProcessGroupSDMA.Options()
    staging_options.direct_cuda = False
    groups = {"direct": dist.new_group(list(range(world))),
              "staging": dist.new_group(list(range(world)), pg_options=staging_options)}
    n = a.bytes // 2 // world
    inp = torch.randn(n, device=dev).to(torch.bfloat16)
    out = torch.empty(n * world, dtype=torch.bfloat16, device=dev)
    outs = list(out.chunk(world))
    a2a_in = torch.randn(n * world, device=dev).to(torch.bfloat16)
    p2p = torch.randn(n * world, device=dev).to(torch.bfloat16)

    def send(g):
        if rank == 0:
            return dist.isend(p2p, 1, group=g)
        return dist.irecv(p2p, 0, group=g) if rank == 1 else None

    forms = {"direct": lambda g: dist.all_gather_into_tensor(out, inp, group=g, async_op=True),
             "staging": lambda g: dist.all_gather_into_tensor(out, inp, group=g, async_op=True),
             "list": lambda g: dist.all_gather(outs, inp, group=g, async_op=True),
             "send": send,
             "all_to_all_single": lambda g: dist.all_to_all_single(out, a2a_in, group=g, async_op=True)}
    group_of = {"direct": groups["direct"], "staging": groups["staging"], "list": groups["direct"],
                "send": groups["direct"], "all_to_all_single": groups["direct"]}
    picked = a.forms.split(",")
    forms = {k: v for k, v in forms.items() if k in picked}
    samples = {name: [] for name in forms}
    cpu_us = {name: [] for name in forms}
    for rnd in range(max(1, a.calls // BATCH) + 1):
        for name, call in forms.items():
            works = []
            cpu0 = time.thread_time_ns()
            for _ in range(BATCH):
                t0 = time.perf_counter_ns()
                works.append(call(group_of[name]))
                if rnd > 0:  # the first round warms up
                    samples[name].append((time.perf_counter_ns() - t0) / 1e3)
            if rnd > 0:
                cpu_us[name].append((time.thread_time_ns() - cpu0) / 1e3 / BATCH)
            for w in works:
                if w is not None:
                    w.wait()
            torch.cuda.synchronize()
    result = {"label": a.label, "output_bytes": n * world * 2, "paths": {}}
    for name, s in samples.items():
        s.sort()
        result["paths"][name] = {"calls": len(s), "median_us": statistics.median(s),
                                 "p90_us": s[int(0.9 * (len(s) - 1))],
                                 "thread_cpu_median_us": statistics.median(cpu_us[name])}
    result["stats"] = {k: v for k, v in torch_sdma.stats(groups["direct"]).items() if k.startswith("dma")}
    if rank == 0:
        for name, r in result["paths"].items():
            print(f"{a.label}: {name}: median {r['median_us']:.2f} us, p90 {r['p90_us']:.2f} us, thread CPU "
                  f"{r['thread_cpu_median_us']:.2f} us per call ({r['calls']} calls)")
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
