"""What the framework examples (fsdp2_train.py, deepspeed_zero3.py, megatron_distopt.py) share: the model, its data,
process-group setup, the timed training loop and the report.

The point of those examples is a like-for-like comparison: the same training run once with NCCL and once with
torch_sdma, which must give BIT-IDENTICAL losses (an all-gather is a copy; every other collective goes to the same
NCCL underneath). That needs every run to be deterministic by itself: same init on every rank and backend, same
data, and deterministic kernels (see `make_deterministic`).

The model is a plain decoder-only transformer written with torch alone (pre-norm blocks of RMSNorm, causal
self-attention through F.scaled_dot_product_attention, SwiGLU MLP; learned positions; untied head). The default
configuration has about 1.06e9 parameters.
"""
import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# cuBLAS is deterministic only with a fixed workspace configuration, which must be in the environment before cuBLAS
# initializes: set it at import, before anything touches CUDA.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Steps at the start that compile kernels, warm allocators and set up communicators; excluded from mean step time.
STARTUP_STEPS = 5


@dataclass
class ModelConfig:
    vocab: int = 32768
    dim: int = 2048
    layers: int = 18
    heads: int = 16
    ffn: int = 5632
    seq: int = 2048

    def n_params(self):
        block = 4 * self.dim * self.dim + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * block + 2 * self.vocab * self.dim + self.seq * self.dim + self.dim


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DecoderLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.n_layers = cfg.layers

    def init_weights(self, seed):
        """GPT-2 style init from an explicit generator, so it does not depend on what consumed the global RNG."""
        gen = torch.Generator(device=self.tok.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.ones_(p)
            else:
                # Residual-branch outputs are scaled down with depth, as in GPT-2.
                std = 0.02 / (2 * self.n_layers) ** 0.5 if name.endswith(("proj.weight", "down.weight")) else 0.02
                with torch.no_grad():
                    p.normal_(0.0, std, generator=gen)

    def forward(self, tokens, targets):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(cfg, seed, device):
    """The same weights on every rank and under every backend: built and initialized before any sharding."""
    with torch.device(device):
        model = DecoderLM(cfg)
    model.init_weights(seed)
    return model


def synthetic_batches(cfg, steps, batch, seed, rank):
    """Token batches for `steps` steps on this rank: a fixed random permutation of the vocabulary gives each token's
    successor, with 10% of positions replaced by uniform noise. The model can learn it (so the loss falls and the
    run shows real training), and it depends only on (seed, rank), never on the backend.
    Returns (inputs, targets), each [steps, batch, seq] int64 on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    successor = torch.randperm(cfg.vocab, generator=gen)  # same on every rank: one "language"
    gen.manual_seed(seed * 1000 + 1 + rank)  # this rank's share of the data
    n = steps * batch
    noise = torch.rand(n, cfg.seq + 1, generator=gen) < 0.1
    random_tokens = torch.randint(cfg.vocab, (n, cfg.seq + 1), generator=gen)
    seqs = torch.empty(n, cfg.seq + 1, dtype=torch.long)
    seqs[:, 0] = random_tokens[:, 0]
    for t in range(1, cfg.seq + 1):
        seqs[:, t] = torch.where(noise[:, t], random_tokens[:, t], successor[seqs[:, t - 1]])
    seqs = seqs.view(steps, batch, cfg.seq + 1)
    return seqs[..., :-1].contiguous(), seqs[..., 1:].contiguous()


def add_common_args(p, default_out):
    d = ModelConfig()
    p.add_argument("--backend", choices=["nccl", "sdma"], default="nccl",
                   help='sdma: init_process_group("cpu:gloo,cuda:sdma"); nccl: init_process_group("nccl")')
    p.add_argument("--sdma-load", choices=["import", "entry-point"], default="import",
                   help="import: `import torch_sdma` before CUDA starts; entry-point: no import, init_process_group "
                        "loads it after torch.cuda.set_device (torch >= 2.14), as a script that only names the "
                        "backend does; needs the package installed, e.g. pip install --no-build-isolation -e .")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--trace", help="write a torch.profiler Chrome trace of step --trace-step to this path (rank 0; "
                                   "examples/trace_timeline.py draws it)")
    p.add_argument("--trace-step", type=int, default=10)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--ffn", type=int, help="MLP hidden size (default: 2.75 x dim, rounded up to a multiple of 256)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=default_out, help="JSON report (written by rank 0)")


def model_config(args):
    ffn = args.ffn or -(-int(2.75 * args.dim) // 256) * 256
    return ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ffn=ffn, seq=args.seq)


def adamw_kwargs(args):
    return dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def make_deterministic():
    """Kernels that give the same bits on every run. Without this, flash attention's backward and the embedding
    backward accumulate with atomics, and two runs differ in the last bits whatever the backend.
    Not warn_only: in warn-only mode flash attention stays on its non-deterministic backward."""
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every torch.empty with NaN, which puts a fill kernel before each FSDP/ZeRO
    # all-gather into a fresh buffer; determinism does not need it, and it would blur the step times.
    torch.utils.deterministic.fill_uninitialized_memory = False
    # Pin attention to flash (math where flash does not apply, e.g. on CPU): its deterministic backward is known;
    # the cuDNN and memory-efficient kernels could otherwise be picked on some shapes.
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)


def init_distributed(backend, sdma_load="import"):
    """One process per GPU under torchrun. sdma: the string a user would write, CUDA all-gathers on copy engines and
    every other CUDA collective on sdma's inner NCCL, CPU tensors on gloo. nccl: plain NCCL, the reference."""
    local_rank = int(os.environ["LOCAL_RANK"])
    if backend == "sdma" and sdma_load == "import":
        # Before CUDA starts, as a user's `import torch_sdma` at the top of their script: it registers the backend
        # name and asks CUDA for 32 hardware queues (torch_sdma/_hw_queues.py) unless the environment chose.
        import torch_sdma  # noqa: F401
    torch.cuda.set_device(local_rank)
    if backend == "sdma":
        dist.init_process_group("cpu:gloo,cuda:sdma")
    else:
        # device_id: NCCL's communicator exists from here on, which its allocator for communication buffers
        # (FSDP2's set_allocate_memory_from_process_group_for_comm) requires before its first allocation.
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return torch.device("cuda", local_rank)


def allgather_paths(groups):
    """torch_sdma's counters summed over the distinct process groups a framework communicated on: calls and bytes
    per path, the all-gather calls (paths "dma", "dma:<variant>" and "inner:<reason>"), the share of them on a DMA
    path and the share on the direct one ("dma:direct")."""
    import torch_sdma
    stats = {}
    # None and dist.group.WORLD name the same group; count it once.
    groups = list({id(g): g for g in (dist.group.WORLD if g is None else g for g in groups)}.values())
    for group in groups:
        for path, c in torch_sdma.stats(group).items():
            total = stats.setdefault(path, {})
            for field, count in c.items():  # calls, bytes, and on dma:direct how its pairs settled
                total[field] = total.get(field, 0) + count
    # Device memory the groups' staging areas hold outside the caching allocator (not in peak_memory_bytes).
    staging = sum(torch_sdma.staging_bytes(g) for g in groups)
    def on_dma(path):
        return path == "dma" or path.startswith("dma:")
    calls = sum(v["calls"] for k, v in stats.items() if on_dma(k) or k.startswith("inner:"))
    dma_calls = sum(v["calls"] for k, v in stats.items() if on_dma(k))
    direct = stats.get("dma:direct", {})
    direct_calls = direct.get("calls", 0)
    pairs = sum(direct.get(f"pairs_{kind}", 0) for kind in ("each_pushing_own", "one_moving_both"))
    return {"stats": stats, "allgather_calls": calls, "dma_calls": dma_calls, "direct_calls": direct_calls,
            "dma_share": dma_calls / calls if calls else 0.0,
            "direct_share": direct_calls / calls if calls else 0.0, "staging_bytes": staging,
            # this rank's direct pairs in which each rank pushed its own bytes (the rest: one rank came late and
            # then moved both directions)
            "pairs_each_pushing_own_share": direct.get("pairs_each_pushing_own", 0) / pairs if pairs else 0.0}


def profiled_if(wanted, path):
    """A torch.profiler context writing a Chrome trace to `path` on rank 0, or a no-op."""
    if not wanted:
        return contextlib.nullcontext()
    from torch.profiler import ProfilerActivity, profile

    def export(prof):
        if dist.get_rank() == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], on_trace_ready=export)


def train(step_fn, inputs, targets, device, log, trace=None, trace_step=10):
    """Runs step_fn(inputs, targets) -> loss tensor for every batch; times each step between two device
    synchronizations and returns the mean loss over ranks (full precision) and the time of every step. With
    `trace`, step `trace_step` runs under torch.profiler and its Chrome trace goes to that path."""
    losses, times = [], []
    world = dist.get_world_size()
    for step in range(inputs.shape[0]):
        x = inputs[step].to(device, non_blocking=True)
        y = targets[step].to(device, non_blocking=True)
        torch.cuda.synchronize()
        with profiled_if(trace is not None and step == trace_step, trace):
            t0 = time.perf_counter()
            loss = step_fn(x, y)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # Outside the timed region: the mean loss over ranks, in fp32 (one all-reduce, bitwise the same on any
        # backend for a given set of inputs).
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append((mean / world).item())
        log(f"step {step:4d} loss {losses[-1]!r} time {times[-1] * 1e3:.1f} ms")
    return losses, times


def report(args, framework, cfg, losses, times, comm_groups, extra=None):
    """Gathers peak memory over ranks and sdma's counters for comm_groups (the groups the framework communicated
    on), prints a summary on rank 0 and writes args.out."""
    peak = torch.tensor([torch.cuda.max_memory_allocated()], dtype=torch.float64, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    tokens_per_step = args.batch * cfg.seq * world
    steady = times[STARTUP_STEPS:] or times
    mean_t = statistics.fmean(steady)
    result = {
        "framework": framework, "backend": args.backend, "world_size": world,
        "model": asdict(cfg), "n_params": cfg.n_params(), "batch_per_rank": args.batch, "steps": len(losses),
        "losses": losses, "step_times_s": times, "startup_steps_excluded": STARTUP_STEPS,
        "mean_step_time_s": mean_t, "tokens_per_s": tokens_per_step / mean_t,
        "peak_memory_bytes": int(peak.item()),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "hostname": socket.gethostname(),
        # How many hardware queues CUDA spreads streams over: it moves sdma's step time by several percent (README).
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "sdma_load": args.sdma_load if args.backend == "sdma" else None,
        "command": " ".join(sys.orig_argv),
    }
    if args.backend == "sdma":
        result["sdma"] = allgather_paths(comm_groups)
        from torch_sdma import _hw_queues
        result["sdma"]["hw_queues"] = _hw_queues.decision  # "set", "user", or "late" (CUDA had started)
    if extra:
        result |= extra
    if dist.get_rank() == 0:
        share = f", dma share {result['sdma']['dma_share']:.3f}" if args.backend == "sdma" else ""
        print(f"{framework}/{args.backend}: {cfg.n_params() / 1e9:.3f}B params, mean step {mean_t * 1e3:.1f} ms "
              f"(first {len(times) - len(steady)} steps excluded), {result['tokens_per_s']:.0f} tok/s, "
              f"peak {result['peak_memory_bytes'] / 2**30:.2f} GiB{share}", flush=True)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result


def rank0_logger():
    rank = dist.get_rank()
    return (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)


def start(description, default_out, add_args=None):
    """What every training example does first: its arguments (the common ones, then add_args(parser)'s),
    deterministic kernels, the process group on --backend. Returns (args, this rank's device, a logger that prints
    on rank 0 only, the model config)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, default_out)
    if add_args:
        add_args(p)
    args = p.parse_args()
    make_deterministic()
    device = init_distributed(args.backend, args.sdma_load)
    return args, device, rank0_logger(), model_config(args)
