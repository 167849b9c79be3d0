"""Draws the GPU timeline of a torch.profiler Chrome trace: one row per CUDA stream, compute kernels, NCCL kernels
and copy-engine copies in three colours, and the CPU's sdma:<collective> ranges on top. For a picture of where
sdma's all-gathers run beside the compute (docs/profiling.md).

    python examples/trace_timeline.py TRACE.json OUT.png [--title TEXT]
"""
import argparse
import json
from collections import defaultdict

COLOURS = {"compute": "#4c72b0", "nccl": "#c44e52", "copy": "#dd8452", "sdma": "#55a868"}


def classify(event):
    cat = str(event.get("cat", "")).lower()
    name = event.get("name", "")
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    if cat == "kernel":
        return "nccl" if name.lower().startswith("nccl") else "compute"
    return None


def load(path):
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    gpu, cpu = defaultdict(list), []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        kind = classify(e)
        if kind:
            gpu[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), kind, e.get("name", "")))
        elif str(e.get("name", "")).startswith("sdma:"):
            cpu.append((float(e["ts"]), float(e["dur"]), e["name"]))
    return gpu, cpu


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--title", default="one FSDP2 step")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gpu, cpu = load(args.trace)
    t0 = min([s for rows in gpu.values() for s, *_ in rows] + [s for s, *_ in cpu])
    streams = sorted(gpu, key=lambda k: (str(k[0]), str(k[1])))
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.55 * (len(streams) + 1)))
    for row, key in enumerate(streams):
        for start, dur, kind, _ in gpu[key]:
            ax.broken_barh([((start - t0) / 1e3, max(dur, 1.0) / 1e3)], (row - 0.4, 0.8), color=COLOURS[kind])
    cpu_row = len(streams)
    for start, dur, _ in cpu:
        ax.broken_barh([((start - t0) / 1e3, max(dur, 1.0) / 1e3)], (cpu_row - 0.4, 0.8), color=COLOURS["sdma"])
    ax.set_yticks(range(len(streams) + 1),
                  [f"GPU {k[0]} stream {k[1]}" for k in streams] + ["CPU: sdma:<collective> calls"])
    ax.set_xlabel("ms")
    ax.set_title(args.title)
    ax.legend(handles=[Patch(color=COLOURS[k], label=label) for k, label in
                       (("compute", "compute kernels"), ("nccl", "NCCL kernels"),
                        ("copy", "copies (copy engines)"), ("sdma", "sdma:<collective> on the CPU"))],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
