"""A peer later than the group's timeout on a synchronous call of every op, on CPU ranks, under both settings of
TORCH_SDMA_ASYNC_ERROR_HANDLING (docs/api.md). A CPU call's failure reaches its caller as the exception of the call
(or of the wait() that c10d makes for a synchronous call), never after it returned, so neither setting ends the
process: every rank raises within the timeout plus a few seconds, from the call or (the late rank, whose call may
complete with the right bytes from the early rank's posted buffers) from the group's next call, which fails at once."""
import pytest

from checks.late_peer import OPS, check_errors_on_every_rank, late_peer_body
from mp_harness import run_group

TIMEOUT_S = 2.0
SLACK_S = 4.0


@pytest.mark.parametrize("setting", ["default", "0"])
def test_late_peer_on_every_sync_op_raises_on_every_rank(setting):
    env = {"TORCH_SDMA_ASYNC_ERROR_HANDLING": None if setting == "default" else setting}
    limit = len(OPS) * (3 * TIMEOUT_S + 10) + 90
    res = run_group(late_peer_body, 2, "sdma", env=env, kwargs={"ops": OPS, "timeout_s": TIMEOUT_S},
                    timeout=limit, pg_timeout_s=60, grace=limit)
    check_errors_on_every_rank(res, OPS, TIMEOUT_S, SLACK_S, returned_exact=True)
