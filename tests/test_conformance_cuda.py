"""On GPUs (2 GPUs; skipped elsewhere): the checks of test_conformance.py on CUDA tensors of a
"cpu:gloo,cuda:sdma" group, all-gathers on the copy engines (TORCH_SDMA_MIN_BYTES=0): point-to-point with oneself
(the inner NCCL never sees it), "sdma:<collective>" and record_param_comms events for DMA and delegated
collectives, and the DMA all-gathers' copies on the GPU side of the trace."""
import pytest
from test_conformance import conformance_body

from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]


def test_self_p2p_and_profiler_events_cuda():
    res = run_group(conformance_body, 2, "cpu:gloo,cuda:sdma", env={"TORCH_SDMA_MIN_BYTES": "0"}, cuda=True,
                    timeout=300, pg_timeout_s=60)
    print(res.ranks[0].value["info"] if res.ranks[0].value else None)
    res.check()
