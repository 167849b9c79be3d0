"""The GPU twin of test_async_error_handling_cpu.py (2 GPUs, or one shared by two ranks with SDMA_TEST_SHARE_GPU=1;
skipped elsewhere): a peer later than the group's timeout on a synchronous call of every op. The early rank's call
returns once its copies are enqueued; its watchdog finds the timeout afterwards, with the caller's stream waiting on
the call. Under the default the process names the failure on stderr and exits with status 75 before anything
releases that wait, so the read queued after the call never runs; under TORCH_SDMA_ASYNC_ERROR_HANDLING=0 every rank
gets an error (the early one from the group's next call) and later calls are refused. Both need the early rank's
watchdog to act at the timeout, 1.5 s before the late rank calls, with nothing of the GPU's to wait on: it names the
peers that never reached the call from their CPUs' posts (the call board, a direct call's mailbox)."""
import os
import shutil

import pytest

from checks.late_peer import LATE, OPS, check_errors_on_every_rank, late_peer_body
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

TIMEOUT_S = 3.0
SLACK_S = 8.0
EXIT_STATUS = 75  # csrc/runner/async_error_exit.hpp
# The watchdog's driver calls wait behind the main thread's blocking read of the failed call's output (a copy into
# pageable memory, which waits for the peer): the copy-engine watchdog therefore polls a call's end through pinned
# host memory and reads nothing of the GPU before it exits or describes a call.


@pytest.mark.parametrize("op", OPS)
def test_default_exits_naming_the_failure_before_the_output_is_read(op):
    limit = 3 * TIMEOUT_S + 150
    res = run_group(late_peer_body, 2, "cpu:gloo,cuda:sdma", env={"TORCH_SDMA_ASYNC_ERROR_HANDLING": None},
                    kwargs={"ops": (op,), "timeout_s": TIMEOUT_S}, cuda=True, timeout=limit, pg_timeout_s=60,
                    grace=limit, keep_dir=True)
    try:
        check_the_exit(res, op)
    finally:
        shutil.rmtree(res.run_dir, ignore_errors=True)


def check_the_exit(res, op):
    early = next(r for r in res.ranks if r.rank != LATE)
    assert early.exitcode == EXIT_STATUS, f"the early rank did not exit with {EXIT_STATUS}:\n{res.describe()}"
    assert "torch_sdma:" in early.log_tail and "timed out" in early.log_tail and "exits with status 75" in \
        early.log_tail, f"the early rank's exit does not name its failure:\n{early.log_tail}"
    assert not os.path.exists(os.path.join(res.run_dir, f"read.{early.rank}.{op}")), \
        "the early rank read the failed call's output"
    late = next(r for r in res.ranks if r.rank == LATE)
    if late.exitcode == EXIT_STATUS:
        assert "torch_sdma:" in late.log_tail, late.log_tail
    else:
        # The late rank's call may complete, with the early rank's bytes where it reads them from memory that the
        # exit does not take back (staging, a send's own input), or fail; never return wrong bytes without an error.
        v = late.value[op] if late.status == "ok" else None
        assert v is not None and (v["error"] or v["exact"]), \
            f"the late rank got neither an error nor the right bytes:\n{res.describe()}\n{v}"


def test_knob_0_raises_on_every_rank_and_refuses_later_calls():
    limit = len(OPS) * (3 * TIMEOUT_S + 15) + 150
    res = run_group(late_peer_body, 2, "cpu:gloo,cuda:sdma", env={"TORCH_SDMA_ASYNC_ERROR_HANDLING": "0"},
                    kwargs={"ops": OPS, "timeout_s": TIMEOUT_S}, cuda=True, timeout=limit, pg_timeout_s=60,
                    grace=limit)
    check_errors_on_every_rank(res, OPS, TIMEOUT_S, SLACK_S, returned_exact=False)
