"""Trains the ~1B-parameter decoder of lm_harness.py with FSDP2 on one node, with NCCL or with torch_sdma.

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --backend nccl --out results/fsdp2_nccl.json
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --backend sdma --out results/fsdp2_sdma.json

FSDP2 all-gathers each block's bf16 parameters before its forward and again before its backward
(reshard_after_forward), as all_gather_into_tensor on the group of the mesh; with --backend sdma those take the
copy-engine path, everything else (the fp32 gradient reduce-scatters) stays on NCCL. Losses must match the NCCL run
bit for bit. examples/compare_frameworks.py runs both and compares.

--comm-buffers calls set_allocate_memory_from_process_group_for_comm(True) on every FSDP module: the all-gather
outputs then come from the backend's allocate_tensor where it offers one (sdma where its direct path is on, the
CUDA default: a pool its peers map once; NCCL: its own allocator), e.g.

    python examples/compare_frameworks.py --frameworks fsdp2 --repeats 3 -- --comm-buffers
"""
import lm_harness as h
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def comm_buffer_args(p):
    p.add_argument("--comm-buffers", action="store_true",
                   help="all-gather outputs from the process group's allocator (every FSDP module)")


def main():
    args, device, log, cfg = h.start(__doc__, "fsdp2_result.json", comm_buffer_args)
    world = torch.distributed.get_world_size()
    # An explicit 1-D mesh, so that the group FSDP communicates on is known (its counters are the ones reported).
    mesh = init_device_mesh("cuda", (world,))
    model = h.build_model(cfg, args.seed, device)
    # fp32 master weights sharded by FSDP; compute and all-gathers in bf16; gradients reduced in fp32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if args.comm_buffers:
        # Per module: the setting covers the module's own parameter group only.
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_allocate_memory_from_process_group_for_comm(True)
    opt = torch.optim.AdamW(model.parameters(), **h.adamw_kwargs(args))
    inputs, targets = h.synthetic_batches(cfg, args.steps, args.batch, args.seed, torch.distributed.get_rank())
    log(f"fsdp2/{args.backend}: {cfg}, {cfg.n_params() / 1e9:.3f}B params, world {world}, batch {args.batch}/rank"
        + (", outputs from the group's allocator" if args.comm_buffers else ""))
    torch.cuda.reset_peak_memory_stats()

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses, times = h.train(step, inputs, targets, device, log, args.trace, args.trace_step)
    h.report(args, "fsdp2", cfg, losses, times, [mesh.get_group()])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
