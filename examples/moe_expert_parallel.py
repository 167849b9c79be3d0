"""A mixture-of-experts layer with expert parallelism, trained for a few steps on NCCL, gloo or torch_sdma.

    torchrun --standalone --nproc_per_node 2 examples/moe_expert_parallel.py --backend sdma --device cpu
    torchrun --standalone --nproc_per_node 2 examples/moe_expert_parallel.py --backend nccl --out results/moe_nccl.json

Every rank holds --experts-per-rank experts (MLPs) and a copy of the router. Per step, each rank routes its tokens
(top-1 or top-2 of a softmax router), then:
1. counts: an even all_to_all_single of how many rows it sends to each expert (every rank learns what it receives);
2. dispatch: an uneven all_to_all_single of the token rows, grouped by destination expert (zeros allowed);
3. the experts compute on the rows they received;
4. combine: the reverse uneven all_to_all_single brings the results home, where they are weighted by the router's
   probabilities and summed per token.
Backward runs the same two uneven exchanges the other way (an autograd function below). The router's gradients are
summed over ranks by an all-gather and a local sum in rank order; the experts' need no sum (each lives on one rank).
So every collective only moves bytes, and the losses must be bit-identical on every backend for one seed and device.
examples/compare_frameworks.py --frameworks moe runs it on NCCL and on sdma and compares.
"""
import exchange_harness as h
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def moe_args(p):
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of each expert's MLP")
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--top-k", type=int, choices=[1, 2], default=2)
    p.add_argument("--router-bias-std", type=float, default=1.5,
                   help="spread of the router's initial per-expert biases (0: nearly even splits)")


class ExchangeRows(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; its backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits):
        ctx.splits = output_splits, input_splits
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_rows = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_rows, grad.contiguous(), input_splits, output_splits)
        return grad_rows, None, None


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class ExpertParallelMoE(nn.Module):
    def __init__(self, args, rank, world, device):
        super().__init__()
        self.rank, self.world, self.top_k = rank, world, args.top_k
        self.local = args.experts_per_rank
        n_experts = self.local * world
        # The router is the same on every rank (seeded); each expert is seeded by its global index, so that a run's
        # numbers do not depend on which rank builds what.
        torch.manual_seed(args.seed)
        self.router = nn.Linear(args.dim, n_experts)
        # A spread of per-expert biases: some experts popular, some rarely chosen, so that the splits are far from
        # even (and can be zero), as in a router early in training.
        with torch.no_grad():
            self.router.bias.normal_(0.0, args.router_bias_std)
        experts = []
        for e in range(rank * self.local, (rank + 1) * self.local):
            torch.manual_seed(args.seed * 1000 + 1 + e)
            experts.append(Expert(args.dim, args.hidden))
        self.experts = nn.ModuleList(experts)
        self.to(device)
        self.last_splits = None

    def forward(self, x):
        t, k = x.shape[0], self.top_k
        probs = self.router(x).float().softmax(dim=-1)
        weight, expert = probs.topk(k, dim=-1)  # [t, k]
        weight = weight / weight.sum(dim=-1, keepdim=True)
        # Assignments (token, choice) ordered by expert, stably: rows for one rank are contiguous, grouped by expert.
        order = torch.sort(expert.reshape(-1), stable=True).indices
        rows = x.index_select(0, order // k)
        per_expert = torch.bincount(expert.reshape(-1), minlength=self.local * self.world)
        # 1. counts: rank j receives, from every rank i, i's counts for j's experts (an even exchange).
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert)
        received_per_expert = received_per_expert.view(self.world, self.local)  # [source rank, local expert]
        input_splits = per_expert.view(self.world, self.local).sum(dim=1).tolist()
        output_splits = received_per_expert.sum(dim=1).tolist()
        self.last_splits = input_splits
        # 2. dispatch (uneven).
        received = ExchangeRows.apply(rows, output_splits, input_splits)
        # 3. experts: group the received rows by local expert (they come grouped by source rank, then expert).
        local_expert = torch.repeat_interleave(
            torch.arange(self.local, device=x.device).repeat(self.world), received_per_expert.reshape(-1))
        by_expert = torch.sort(local_expert, stable=True).indices
        sizes = received_per_expert.sum(dim=0).tolist()
        grouped = received.index_select(0, by_expert).split(sizes)
        computed = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, grouped)])
        results = computed.index_select(0, torch.argsort(by_expert))
        # 4. combine: the reverse exchange, then back to (token, choice) order, weighted and summed per token.
        returned = ExchangeRows.apply(results, input_splits, output_splits)
        per_choice = returned.index_select(0, torch.argsort(order)).view(t, k, -1)
        return (per_choice * weight.unsqueeze(-1).to(per_choice.dtype)).sum(dim=1)


def synthetic_data(args, rank, device):
    """Per step, this rank's tokens and the targets a fixed random teacher gives them; (seed, rank) decide all."""
    gen = torch.Generator().manual_seed(args.seed)
    teacher_in = torch.randn(args.dim, args.dim, generator=gen) / args.dim ** 0.5
    teacher_out = torch.randn(args.dim, args.dim, generator=gen) / args.dim ** 0.5
    gen.manual_seed(args.seed * 1000 + 7 + rank)
    x = torch.randn(args.steps, args.tokens, args.dim, generator=gen)
    y = x + torch.tanh(x @ teacher_in) @ teacher_out
    return x.to(device), y.to(device)


def main():
    args, device, log = h.start(__doc__, "moe_result.json", 20, moe_args)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ExpertParallelMoE(args, rank, world, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    inputs, targets = synthetic_data(args, rank, device)
    log(f"moe/{args.backend}/{device.type}: world {world}, {args.experts_per_rank} experts per rank, top-{args.top_k}, "
        f"{args.tokens} tokens of {args.dim} per rank, expert hidden {args.hidden}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    router_params = list(model.router.parameters())

    def step(i):
        x, y = inputs[i], targets[i]
        out = x + model(x)
        loss = F.mse_loss(out, y)
        # The mean over ranks of each rank's loss: each rank's backward carries its share; the experts' gradients
        # then arrive whole through the backward exchanges, the router's (one copy per rank) are summed below.
        (loss / world).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in router_params])
        flat = h.sum_over_ranks(flat)
        offset = 0
        for p in router_params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def reported(loss):
        return (h.sum_over_ranks(loss.reshape(1)) / world).item()

    losses, times = h.train(step, args.steps, device, log, reported)
    # Rows each rank received in the last step's dispatch: uneven, as the router left them.
    received = h.sum_over_ranks(torch.tensor(model.last_splits, device=device)).tolist()
    h.report(args, "moe", device, losses, times, args.tokens, [None],
             {"rows_received_per_rank_last_step": received,
              "experts_per_rank": args.experts_per_rank, "top_k": args.top_k})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
