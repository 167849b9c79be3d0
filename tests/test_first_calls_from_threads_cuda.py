"""The GPU twin of test_first_calls_from_threads_cpu.py (2 GPUs, or one shared by two ranks with
SDMA_TEST_SHARE_GPU=1; skipped elsewhere): two threads per rank make the first all-gathers of two groups at once,
on the direct path and through staging, and both groups connect and run their calls bit-exact.

As with NCCL's communicators, two groups' GPU work made in crossed orders on the ranks may wait on each other where
their streams share a hardware queue (docs/errors.md). The ranks run with the 32 queues torch_sdma asks for, and after
the first calls, whose connects at once are the point, the two threads take turns in one order on every rank."""
import pytest
from test_first_calls_from_threads_cpu import run_first_calls_from_threads

from conftest import cuda_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("env", [{}, {"TORCH_SDMA_DIRECT": "0"}], ids=["direct", "staging"])
def test_first_calls_on_two_groups_from_two_threads(env):
    run_first_calls_from_threads(cuda=True, env=env, one_order_after_first=True)
