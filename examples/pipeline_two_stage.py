"""A two-stage pipeline (rank 0 runs stage 1, rank 1 stage 2) with microbatches, trained for a few steps on NCCL,
gloo or torch_sdma.

    torchrun --standalone --nproc_per_node 2 examples/pipeline_two_stage.py --backend sdma --device cpu
    torchrun --standalone --nproc_per_node 2 examples/pipeline_two_stage.py --backend nccl --out results/pipe_nccl.json

A GPipe schedule: every microbatch's forward, then every backward in reverse order. Stage 1 sends each microbatch's
activations forward with dist.send, stage 2 takes them with dist.recv; in the backward, the gradients of those
activations go back with batch_isend_irecv. Stage 2 computes the loss and broadcasts it to rank 0, which reports it.
Every collective only moves bytes, so the losses must be bit-identical on every backend for one seed and device.
examples/compare_frameworks.py --frameworks pipeline runs it on NCCL and on sdma and compares.

Two ranks exactly. On one GPU shared by both ranks only sdma runs it: NCCL refuses two ranks on one GPU, and gloo
sends and receives CPU tensors only.
"""
import sys

import exchange_harness as h
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

FIRST, LAST = 0, 1


def pipeline_args(p):
    p.add_argument("--batch", type=int, default=256, help="samples per step, split into --microbatches")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="residual MLP blocks per stage")
    p.add_argument("--classes", type=int, default=16)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def build_stage(args, stage, device):
    """Stage 1: blocks; stage 2: blocks and a classifier head. Seeded per stage."""
    torch.manual_seed(args.seed * 10 + stage)
    layers = [Block(args.dim) for _ in range(args.layers)]
    if stage == LAST:
        layers += [nn.LayerNorm(args.dim), nn.Linear(args.dim, args.classes)]
    return nn.Sequential(*layers).to(device)


def synthetic_data(args, device):
    """Inputs and the labels a fixed random teacher gives them; the seed decides all (both ranks build the same)."""
    gen = torch.Generator().manual_seed(args.seed)
    teacher = torch.randn(args.dim, args.classes, generator=gen)
    x = torch.randn(args.steps, args.batch, args.dim, generator=gen)
    labels = (x @ teacher).argmax(dim=-1)
    return x.to(device), labels.to(device)


def main():
    args, device, log = h.start(__doc__, "pipeline_result.json", 20, pipeline_args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        sys.exit(f"a two-stage pipeline: run it with 2 ranks, not {world}")
    if args.batch % args.microbatches:
        sys.exit(f"--batch {args.batch} does not split into {args.microbatches} microbatches")
    if args.backend == "gloo" and device.type == "cuda":
        sys.exit("gloo sends and receives CPU tensors only: use --device cpu with --backend gloo")
    stage = rank
    model = build_stage(args, stage, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    inputs, labels = synthetic_data(args, device)
    micro = args.batch // args.microbatches
    log(f"pipeline/{args.backend}/{device.type}: 2 stages of {args.layers} blocks (dim {args.dim}), batch "
        f"{args.batch} in {args.microbatches} microbatches")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(i):
        xs, ys = inputs[i].split(micro), labels[i].split(micro)
        outputs, received, losses = [], [], []
        # Forward: stage 1 sends each microbatch's activations as soon as they exist.
        for m in range(args.microbatches):
            if stage == FIRST:
                out = model(xs[m])
                dist.send(out.detach(), dst=LAST)
                outputs.append(out)
            else:
                act = torch.empty(micro, args.dim, device=device)
                dist.recv(act, src=FIRST)
                act.requires_grad_()
                received.append(act)
                losses.append(F.cross_entropy(model(act), ys[m]))
        # Backward, last microbatch first: stage 2 sends each activation gradient as soon as it has it.
        for m in reversed(range(args.microbatches)):
            if stage == LAST:
                (losses[m] / args.microbatches).backward()
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, received[m].grad, FIRST)])
            else:
                grad = torch.empty(micro, args.dim, device=device)
                works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, LAST)])
            for w in works:
                w.wait()
            if stage == FIRST:
                outputs[m].backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The step's loss (mean over microbatches, summed in order on stage 2), for rank 0 to report.
        loss = torch.zeros(1, device=device)
        if stage == LAST:
            for m_loss in losses:
                loss += m_loss.detach()
            loss /= args.microbatches
        return loss

    def reported(loss):
        dist.broadcast(loss, src=LAST)
        return loss.item()

    losses, times = h.train(step, args.steps, device, log, reported)
    h.report(args, "pipeline", device, losses, times, args.batch / world, [None],
             {"microbatches": args.microbatches})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
