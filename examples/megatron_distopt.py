"""Trains the ~1B-parameter decoder of lm_harness.py with megatron-core's DistributedDataParallel and
DistributedOptimizer (overlap_grad_reduce, overlap_param_gather) on one node, with NCCL or with torch_sdma.

    examples/install_framework_wheels.sh          # once per machine: megatron-core from .whl/, offline
    torchrun --nproc_per_node 2 examples/megatron_distopt.py --backend nccl --out results/megatron_nccl.json
    torchrun --nproc_per_node 2 examples/megatron_distopt.py --backend sdma --out results/megatron_sdma.json

megatron-core (a cp312 wheel needing only torch, numpy and packaging) runs without Transformer Engine or Apex: its
optimizer falls back to torch's AdamW. Its argparse-based trainer (megatron/training, not in megatron-core)
accepts only nccl/gloo as backend names, so torch.distributed is initialized here and megatron-core's model
parallel state is built on top (tensor and pipeline parallel size 1: pure data parallelism over all ranks).

With the distributed optimizer each rank updates its shard of the fp32 main weights; the bf16 parameters are then
all-gathered bucket by bucket, overlapped with the next forward (the first bucket is dispatched by
optimizer.zero_grad(), the next ones by forward pre-hooks), inside torch's _coalescing_manager: in-place
all_gather_into_tensor calls coalesced into allgather_into_tensor_coalesced, which sdma serves on its DMA path.
"""
import importlib.metadata

import lm_harness as h
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig


def main():
    args, device, log, cfg = h.start(__doc__, "megatron_result.json")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    # Megatron's mixed precision: bf16 parameters in the model, fp32 main weights in the (sharded) optimizer,
    # gradients accumulated and reduce-scattered in fp32.
    model = h.build_model(cfg, args.seed, device).to(torch.bfloat16)
    # DDP reads only generic fields of the transformer config; the model itself is lm_harness's, not Megatron's.
    transformer_config = TransformerConfig(num_layers=cfg.layers, hidden_size=cfg.dim, num_attention_heads=cfg.heads,
                                           ffn_hidden_size=cfg.ffn, bf16=True, params_dtype=torch.bfloat16)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               overlap_param_gather=True, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=transformer_config, ddp_config=ddp_config, module=model)
    adamw = h.adamw_kwargs(args)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=adamw["lr"], weight_decay=adamw["weight_decay"],
                        adam_beta1=adamw["betas"][0], adam_beta2=adamw["betas"][1], adam_eps=adamw["eps"],
                        bf16=True, use_distributed_optimizer=True, clip_grad=0.0),  # no clipping, as in the others
        [ddp])
    inputs, targets = h.synthetic_batches(cfg, args.steps, args.batch, args.seed, torch.distributed.get_rank())
    log(f"megatron/{args.backend}: {cfg}, {cfg.n_params() / 1e9:.3f}B params, world "
        f"{torch.distributed.get_world_size()}, batch {args.batch}/rank, optimizer {type(opt).__name__}")
    torch.cuda.reset_peak_memory_stats()

    def step(x, y):
        # The order of Megatron's own training loop (megatron/training/training.py: train_step).
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x, y)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss

    losses, times = h.train(step, inputs, targets, device, log)
    # The groups the parameter all-gathers ran on, and the default group.
    groups = [bg.intra_distributed_optimizer_instance_group for bg in ddp.bucket_groups] + [None]
    h.report(args, "megatron", cfg, losses, times, groups,
             extra={"megatron_core": importlib.metadata.version("megatron-core")})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
