"""GPU (2 GPUs, or one with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): the point-to-point cases of test_p2p_cpu.py
on CUDA tensors, beside copy-engine all-gathers and all-to-alls on the same group, on both routes:
- the default: the copy-engine point-to-point runner (docs/design.md, "Point-to-point"), every dtype, on
  "dma:direct", and the mistakes of test_p2p_cpu.py (sizes that differ raising on both ranks before a byte moves,
  naming both; a recv whose send never comes named within the timeout; the failed group's next all-gather refused),
  and on 3 ranks a batch whose peers match it with lone calls interleaved among themselves;
- TORCH_SDMA_DELEGATE=send: the inner backend (NCCL), bit-exact on the dtypes NCCL sends, counted as delegated;
  skipped where NCCL cannot run (two ranks on one GPU).
Expected bytes are rebuilt locally from every rank's seed."""
import pytest
import torch
import torch.distributed as dist

from checks import p2p
from checks.data import EVERY_DTYPE, NCCL_SHARED_REASON, SHARE_GPU
from conftest import GPU_RANKS, cuda_count
from mp_harness import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_count() < GPU_RANKS, reason=f"needs {GPU_RANKS} CUDA devices"),
]

W = GPU_RANKS
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
# Delegating send delegates recv too: one is the other's match.
ON_NCCL = dict(ENV, TORCH_SDMA_DELEGATE="send")
INNER = "inner:TORCH_SDMA_DELEGATE"
NCCL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int8, torch.int32,
               torch.int64)
MISTAKE_TIMEOUT_S = 10.0
SLACK_S = 20.0


def cuda_p2p_body(ctx, dtypes, expected):
    return ctx.run_cases(p2p.all_cases(dist.group.WORLD, ctx.device, ctx.rank, ctx.world, "cuda", dtypes, expected))


@pytest.mark.skipif(SHARE_GPU, reason=NCCL_SHARED_REASON)
@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "sdma"])
def test_cuda_p2p_on_nccl_matches_local_bytes(init):
    run_group(cuda_p2p_body, W, init, kwargs={"dtypes": NCCL_DTYPES, "expected": INNER}, env=ON_NCCL, cuda=True,
              timeout=540, pg_timeout_s=60).check()


@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "sdma"])
def test_cuda_p2p_on_copy_engines_matches_local_bytes(init):
    run_group(cuda_p2p_body, W, init, kwargs={"dtypes": EVERY_DTYPE, "expected": "dma:direct"}, env=ENV,
              cuda=True, timeout=540, pg_timeout_s=60).check()


def cuda_interleaved_body(ctx):
    return ctx.run_cases(p2p.interleaved_cases(dist.group.WORLD, ctx.device, ctx.rank, ctx.world))


def test_cuda_p2p_batch_among_interleaved_lone_calls_on_3_ranks():
    """3 ranks (several on one GPU where there are fewer GPUs): rank 2's batch to ranks 0 and 1 among their
    interleaved lone calls, each peer of the batch on streams of its own (without them it hangs until the timeout);
    and rings of two peers per batch among async all-gathers and all-to-alls."""
    run_group(cuda_interleaved_body, 3, "cpu:gloo,cuda:sdma", env=ENV, cuda=True, timeout=300,
              pg_timeout_s=60).check()


def cuda_mistakes_body(ctx):
    return p2p.mistake_cases(ctx, ctx.device, MISTAKE_TIMEOUT_S)


def test_cuda_p2p_on_copy_engines_mistakes_raise():
    res = run_group(cuda_mistakes_body, W, "cpu:gloo,cuda:sdma", env=ENV, cuda=True,
                    timeout=4 * (MISTAKE_TIMEOUT_S + SLACK_S) + 60, pg_timeout_s=60, destroy=False, hard_exit=True,
                    grace=4 * (MISTAKE_TIMEOUT_S + SLACK_S))
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    problems = p2p.mistake_problems(values, MISTAKE_TIMEOUT_S, SLACK_S, cuda=True)
    assert not problems, "\n".join(problems) + "\n" + repr(values)
