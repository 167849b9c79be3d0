"""Trains the ~1B-parameter decoder of lm_harness.py with DeepSpeed ZeRO-3 (bf16, default bucket sizes and
prefetching) on one node, with NCCL or with torch_sdma.

    examples/install_framework_wheels.sh          # once per machine: DeepSpeed from .whl/, offline
    torchrun --nproc_per_node 2 examples/deepspeed_zero3.py --backend nccl --out results/zero3_nccl.json
    torchrun --nproc_per_node 2 examples/deepspeed_zero3.py --backend sdma --out results/zero3_sdma.json

How DeepSpeed is given the backend: deepspeed.initialize() always passes the accelerator's name ("nccl") to
deepspeed.comm.init_distributed(), which, when torch.distributed is already initialized, only wraps the existing
default group (comm/comm.py: `cdb = TorchBackend(dist_backend, ...)`, whose init_process_group is skipped when
torch.distributed.is_initialized()). So torch.distributed is initialized here first, with the backend string of
our choice; the one string DeepSpeed looks at afterwards is get_backend() == 'mpi' (comm/torch.py). Letting
DeepSpeed initialize instead (deepspeed.init_distributed(dist_backend="cpu:gloo,cuda:sdma")) would also pass the
string through, but adds device_id=cuda:LOCAL_RANK to init_process_group, which the NCCL run here does not get.

ZeRO-3 fetches the parameters of each module (and prefetches the next ones) with one async all_gather_into_tensor
per dtype into a flat buffer, on the world group; with --backend sdma those take the copy-engine path, while its
gradient reduce-scatters and the initial parameter broadcast stay on NCCL. The optimizer is torch's AdamW
("torch_adam": true), so no DeepSpeed op needs JIT compilation.
"""
import deepspeed
import lm_harness as h
import torch


def ds_config(args):
    opt = h.adamw_kwargs(args)
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": opt["lr"], "betas": list(opt["betas"]), "eps": opt["eps"],
                                                  "weight_decay": opt["weight_decay"], "torch_adam": True}},
        "steps_per_print": 1 << 30,  # the harness logs each step itself
    }


def main():
    args, device, log, cfg = h.start(__doc__, "zero3_result.json")
    # Every rank builds the full model with the same seed; deepspeed.initialize partitions it (ZeRO-3).
    model = h.build_model(cfg, args.seed, device)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(args))
    inputs, targets = h.synthetic_batches(cfg, args.steps, args.batch, args.seed, torch.distributed.get_rank())
    log(f"zero3/{args.backend}: {cfg}, {cfg.n_params() / 1e9:.3f}B params, world "
        f"{torch.distributed.get_world_size()}, batch {args.batch}/rank, deepspeed {deepspeed.__version__}")
    torch.cuda.reset_peak_memory_stats()

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    losses, times = h.train(step, inputs, targets, device, log)
    # The groups ZeRO-3 may gather on: each parameter's (the world group unless configured otherwise) and the
    # optimizer's data-parallel group (a clone of the world group).
    groups = [p.ds_process_group for p in engine.module.parameters()] + [engine.optimizer.dp_process_group, None]
    h.report(args, "zero3", cfg, losses, times, groups, extra={"deepspeed": deepspeed.__version__})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
