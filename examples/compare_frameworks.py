"""Runs each framework example twice, with NCCL and with torch_sdma, one after the other, and compares them.

    python examples/compare_frameworks.py                       # FSDP2, DeepSpeed ZeRO-3, Megatron, ~1B model
    python examples/compare_frameworks.py --frameworks fsdp2 -- --steps 20 --layers 4 --dim 256
    python examples/compare_frameworks.py --frameworks moe,pipeline               # expert parallel, pipeline
    python examples/compare_frameworks.py --frameworks moe,pipeline --device cpu  # the same on CPU: gloo vs sdma

Arguments after `--` go to every training script unchanged (model size, steps, batch...): the language-model
scripts (fsdp2, zero3, megatron, the default set) share theirs (lm_harness.py), moe and pipeline theirs
(exchange_harness.py). moe and pipeline move bytes only (all-to-all, send/recv, broadcast, all-gather); pipeline
always runs on 2 ranks. --device cpu compares them on CPU tensors, gloo against sdma ("cpu:sdma"). `--sdma-variant
nowait:TORCH_SDMA_DIRECT_PEER_WAIT_US=0` adds sdma runs with those knobs set, taking turns with the others in every
repeat and compared with the same NCCL runs (a row "zero3 [nowait]"). A framework whose package is not installed is
reported as skipped (examples/install_framework_wheels.sh installs DeepSpeed and megatron-core
offline). Writes <out-dir>/frameworks_w<nproc>.{md,json} and each run's own JSON beside them.
"""
import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import lm_harness

EXAMPLES = Path(__file__).resolve().parent
FRAMEWORKS = {  # name: (script, module it needs)
    "fsdp2": ("fsdp2_train.py", "torch"),
    "zero3": ("deepspeed_zero3.py", "deepspeed"),
    "megatron": ("megatron_distopt.py", "megatron.core"),
    "moe": ("moe_expert_parallel.py", "torch"),
    "pipeline": ("pipeline_two_stage.py", "torch"),
}
DEFAULT_FRAMEWORKS = ("fsdp2", "zero3", "megatron")
# Frameworks that run on a fixed number of ranks, whatever --nproc says.
RANKS = {"pipeline": 2}
# Frameworks that also run on CPU tensors (--device cpu) and against gloo (--baseline gloo); the others train on
# CUDA devices against NCCL only.
BYTE_MOVING = ("moe", "pipeline")
# NVLink multicast (NVLS) stays off in every launched process: on the shared GPU hosts a program using it can take
# the GPUs out of service. Forced, not defaulted, so that no inherited value turns it back on.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script, backend, out_json, nproc, script_args=(), timeout=1800, knobs=None, device=None):
    """One torchrun of examples/<script> on a fresh local port, with `knobs` added to the environment; returns the
    CompletedProcess (output captured)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(EXAMPLES / script), "--backend", backend, "--out", str(out_json),
           *(["--device", device] if device else []), *script_args]
    env = os.environ | (knobs or {}) | SAFE_ENV | {"PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, env=env, cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=timeout)


def losses_of(run):
    """A run's losses as compared: float.hex where the report has them (exchange_harness.py), else the floats."""
    return run.get("losses_hex") or run["losses"]


def compare(nccl, sdma):
    """Summary of two run reports (the dicts lm_harness.report or exchange_harness.report wrote) of one framework:
    the baseline's (nccl, or gloo on CPU tensors; keyed by its backend) and sdma's."""
    base = nccl["backend"]
    first_diff = next((i for i, (a, b) in enumerate(zip(losses_of(nccl), losses_of(sdma))) if a != b), None)
    identical = first_diff is None and len(nccl["losses"]) == len(sdma["losses"])
    pair = ((base, nccl), ("sdma", sdma))
    return {
        "baseline": base, "world_size": nccl.get("world_size"),
        "losses_identical": identical, "first_differing_step": first_diff, "steps": len(nccl["losses"]),
        "final_loss": {b: r["losses"][-1] for b, r in pair},
        "mean_step_ms": {b: r["mean_step_time_s"] * 1e3 for b, r in pair},
        "median_step_ms": {b: statistics.median(r["step_times_s"][lm_harness.STARTUP_STEPS:] or r["step_times_s"])
                           * 1e3 for b, r in pair},
        "tokens_per_s": {b: r["tokens_per_s"] for b, r in pair},
        "speedup": nccl["mean_step_time_s"] / sdma["mean_step_time_s"],
        "peak_memory_gib": {b: r["peak_memory_bytes"] / 2**30 for b, r in pair},
        "staging_bytes": sdma["sdma"].get("staging_bytes", 0),
        "dma_share": sdma["sdma"]["dma_share"], "direct_share": sdma["sdma"].get("direct_share", 0.0),
        "pairs_each_pushing_own_share": sdma["sdma"].get("pairs_each_pushing_own_share", 0.0),
        # All-gathers for the language-model scripts; every byte-moving call for the exchange ones.
        "copy_calls": sdma["sdma"].get("allgather_calls", sdma["sdma"].get("calls", 0)),
        "sdma_stats": sdma["sdma"]["stats"],
        "hw_queues": {b: r.get("cuda_device_max_connections") or "unset (8)" for b, r in pair},
    }


def compare_runs(nccl_runs, sdma_runs):
    """compare() of the median runs, plus every pair's speedup and whether all runs (both backends, every repeat)
    produced the same losses."""
    def median_run(runs):
        return sorted(runs, key=lambda r: r["mean_step_time_s"])[(len(runs) - 1) // 2]
    summary = compare(median_run(nccl_runs), median_run(sdma_runs))
    if len(nccl_runs) > 1:
        reference = losses_of(nccl_runs[0])
        summary["losses_identical"] = all(losses_of(r) == reference for r in nccl_runs + sdma_runs)
        summary["runs"] = len(nccl_runs)
        summary["speedup_per_run"] = [n["mean_step_time_s"] / s["mean_step_time_s"]
                                      for n, s in zip(nccl_runs, sdma_runs)]
        summary["step_ms_per_run"] = {summary["baseline"]: [r["mean_step_time_s"] * 1e3 for r in nccl_runs],
                                      "sdma": [r["mean_step_time_s"] * 1e3 for r in sdma_runs]}
    return summary


def parse_variant(text):
    """"staging:TORCH_SDMA_DIRECT=0,TORCH_SDMA_STAGING_BYTES=64M" -> ("staging", {knob: value})."""
    name, sep, assignments = text.partition(":")
    knobs = dict(a.split("=", 1) for a in assignments.split(",") if "=" in a)
    if not sep or not name or not knobs or not all(k.startswith("TORCH_SDMA_") for k in knobs):
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME:TORCH_SDMA_X=VALUE[,TORCH_SDMA_Y=VALUE]")
    return name, knobs


def markdown(results, nproc, base="nccl", where=None):
    where = where or f"{nproc} GPUs on NCCL"
    lines = [f"Each framework trained on {where} and on sdma (with --repeats, alternately, and the "
             f"run with the median step time per backend is shown); step times exclude the first "
             f"{lm_harness.STARTUP_STEPS} steps. Hardware queues: CUDA_DEVICE_MAX_CONNECTIONS in each run (the "
             f"sdma runs' `import torch_sdma` sets 32 where the environment left it unset). Calls on dma: the "
             f"all-gathers of fsdp2, zero3 and megatron; every byte-moving call of moe and pipeline.", "",
             f"| framework | losses bit-identical | steps | step ms {base} | step ms sdma | sdma speedup "
             f"| tok/s {base} | tok/s sdma | peak GiB {base} | peak GiB sdma | sdma staging bytes "
             f"| calls on dma (direct) | HW queues {base} / sdma |",
             "|" + "---|" * 13]
    for name, r in results.items():
        if "skipped" in r or "failed" in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('failed')} |" + " |" * 11)
            continue
        same = "yes" if r["losses_identical"] else f"NO (from step {r['first_differing_step']})"
        ranks = f" ({r['world_size']} ranks)" if r.get("world_size") not in (None, nproc) else ""
        lines.append(
            f"| {name}{ranks} | {same} | {r['steps']} | {r['mean_step_ms'][base]:.1f} "
            f"| {r['mean_step_ms']['sdma']:.1f} | {r['speedup']:.3f}x | {r['tokens_per_s'][base]:.0f} "
            f"| {r['tokens_per_s']['sdma']:.0f} "
            f"| {r['peak_memory_gib'][base]:.2f} | {r['peak_memory_gib']['sdma']:.2f} | {r['staging_bytes']} "
            f"| {r['dma_share']:.1%} ({r['direct_share']:.1%}; {r['pairs_each_pushing_own_share']:.0%}) "
            f"of {r['copy_calls']} "
            f"| {r['hw_queues'][base]} / {r['hw_queues']['sdma']} |")
    for name, r in results.items():
        if r.get("runs"):
            per_run = ", ".join(f"{n:.1f}/{s:.1f}" for n, s in zip(r["step_ms_per_run"][base],
                                                                   r["step_ms_per_run"]["sdma"]))
            lines.append("")
            knobs = "".join(f" {k}={v}" for k, v in r.get("knobs", {}).items())
            lines.append(f"{name}{knobs}: median of {r['runs']} runs per backend (step ms {base}/sdma per run: "
                         f"{per_run}; speedup per run: {', '.join(f'{x:.3f}x' for x in r['speedup_per_run'])})")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", default=",".join(DEFAULT_FRAMEWORKS), help="comma-separated subset of: "
                   + ", ".join(FRAMEWORKS) + " (default: " + ",".join(DEFAULT_FRAMEWORKS) + ")")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: CPU tensors, gloo against sdma (moe and pipeline only; the others are skipped)")
    p.add_argument("--baseline", choices=["nccl", "gloo"],
                   help="what sdma is compared with (default: nccl on CUDA, gloo on CPU); gloo on CUDA tensors lets "
                        "moe run with ranks sharing a GPU (--nproc above the GPU count), which NCCL refuses")
    p.add_argument("--nproc", type=int, help="processes; default: all visible GPUs (2 with --device cpu); more "
                                             "than the GPUs: ranks share them (local rank modulo the count)")
    p.add_argument("--out-dir", type=Path, default=Path("results"))
    p.add_argument("--timeout", type=int, default=1800, help="seconds per training run")
    p.add_argument("--repeats", type=int, default=1,
                   help="training runs per backend, alternating which backend goes first; the table reports the "
                        "median step time per backend (run-to-run spread on 2x H200 reached 8%% for ZeRO-3)")
    p.add_argument("--sdma-variant", type=parse_variant, action="append", default=[], metavar="NAME:KNOB=VALUE,...",
                   help="also run sdma with these TORCH_SDMA_* knobs, in turn with the other runs (repeatable)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: arguments for every training script")
    args = p.parse_args()
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    cpu = args.device == "cpu"
    base = args.baseline or ("gloo" if cpu else "nccl")
    gpus = 0
    if not cpu:
        import torch
        gpus = torch.cuda.device_count()
    if args.nproc is None:
        args.nproc = 2 if cpu else gpus
    if args.nproc < 1 or (not cpu and gpus == 0):
        sys.exit("no GPU visible: the framework examples train on CUDA devices (moe and pipeline: --device cpu)")
    if cpu and base == "nccl":
        sys.exit("NCCL moves CUDA tensors only: --device cpu compares with gloo")
    shared = not cpu and args.nproc > gpus
    if shared and base == "nccl":
        sys.exit(f"{args.nproc} ranks on {gpus} GPU(s): NCCL refuses two ranks of one communicator on one GPU; "
                 f"--baseline gloo compares moe with gloo on CUDA tensors")
    unknown = [n for n in args.frameworks.split(",") if n not in FRAMEWORKS]
    if unknown:
        sys.exit(f"unknown framework(s) {', '.join(unknown)}: choose from {', '.join(FRAMEWORKS)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.frameworks.split(","):
        script, module = FRAMEWORKS[name]
        nproc = RANKS.get(name, args.nproc)
        why_not = None
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            why_not = f"{module} is not installed"
        elif name not in BYTE_MOVING and (cpu or base != "nccl"):
            why_not = "trains on CUDA devices against NCCL only"
        elif nproc > args.nproc:
            why_not = f"needs {nproc} ranks, {args.nproc} given"
        elif name == "pipeline" and not cpu and base == "gloo":
            why_not = "gloo sends and receives CPU tensors only"
        if why_not:
            results[name] = {"skipped": f"skipped: {why_not}"}
            print(f"{name}: {why_not}, skipped", flush=True)
            continue
        # (label, backend, knobs): the baseline (NCCL, gloo on CPU), sdma as configured, and each sdma variant.
        kinds = ([(base, base, {}), ("sdma", "sdma", {})]
                 + [(f"sdma-{v}", "sdma", knobs) for v, knobs in args.sdma_variant])
        runs = {label: [] for label, _, _ in kinds}
        failed = None
        for r in range(args.repeats):
            # Alternate the order, so that no backend always runs on the warmer (or cooler) GPU.
            for label, backend, knobs in (kinds if r % 2 == 0 else kinds[::-1]):
                tag = f"{name}_{label}{'_cpu' if cpu else ''}_w{nproc}" + (f"_r{r}" if args.repeats > 1 else "")
                out_json = args.out_dir / f"{tag}.json"
                print(f"{name}/{label}: running {script} (run {r + 1} of {args.repeats}) ...", flush=True)
                proc = launch(script, backend, out_json, nproc, script_args, args.timeout, knobs,
                              device=args.device if name in BYTE_MOVING else None)
                (args.out_dir / f"{tag}.log").write_text(proc.stdout + proc.stderr)
                if proc.returncode != 0:
                    print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
                    failed = f"FAILED ({label}, exit {proc.returncode})"
                    break
                runs[label].append(json.loads(out_json.read_text()))
                print(proc.stdout.strip().splitlines()[-1], flush=True)
            if failed:
                break
        results[name] = {"failed": failed} if failed else compare_runs(runs[base], runs["sdma"])
        for v, knobs in args.sdma_variant:
            variant = f"{name} [{v}]"
            results[variant] = {"failed": failed} if failed else compare_runs(runs[base], runs[f"sdma-{v}"])
            results[variant]["knobs"] = knobs
    where = (f"{args.nproc} CPU ranks on gloo" if cpu else
             f"{args.nproc} ranks on {gpus} GPU(s) on {'NCCL' if base == 'nccl' else 'gloo (CUDA tensors)'}")
    table = markdown(results, args.nproc, base, where)
    print("\n" + table)
    stem = f"frameworks{'_cpu' if cpu else ''}{'_gloo' if base == 'gloo' and not cpu else ''}_w{args.nproc}"
    (args.out_dir / f"{stem}.md").write_text(table)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(
        {"command": " ".join(sys.orig_argv), "script_args": script_args, "nproc": args.nproc, "device": args.device,
         "results": results},
        indent=2))
    # Non-zero when a comparison did not hold, so that scripts can rely on the exit status.
    bad = [n for n, r in results.items() if "failed" in r or ("losses_identical" in r and not r["losses_identical"])]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
