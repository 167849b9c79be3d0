"""GPU (2 GPUs, or one with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): the point-to-point cases of test_p2p_cpu.py
on CUDA tensors, among copy-engine all-gathers and all-to-alls on the same group. CUDA point-to-point takes the inner
backend (NCCL) until the copy-engine point-to-point runner exists (docs/design.md, "Point-to-point"), so these cases
check that route: bit-exact on the dtypes NCCL sends, interleaved with the DMA collectives, counted as delegated; and
they skip where NCCL cannot run (two ranks on one GPU). Once CUDA takes the DMA path, EXPECTED becomes "dma:direct",
DTYPES every dtype, and the mistakes of test_p2p_cpu.py apply here too."""
import pytest
import torch
import torch.distributed as dist

from checks import p2p
from checks.data import NCCL_SHARED_REASON, SHARE_GPU
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

W = 2
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
EXPECTED = "inner:point-to-point of CUDA tensors takes the inner backend"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32,
          torch.int64)


def cuda_p2p_body(ctx):
    return ctx.run_cases(p2p.all_cases(dist.group.WORLD, ctx.device, ctx.rank, ctx.world, "cuda", DTYPES, EXPECTED))


@pytest.mark.skipif(SHARE_GPU and EXPECTED.startswith("inner"), reason=NCCL_SHARED_REASON)
@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "sdma"])
def test_cuda_p2p_matches_local_bytes(init):
    run_group(cuda_p2p_body, W, init, env=ENV, cuda=True, timeout=540, pg_timeout_s=60).check()
