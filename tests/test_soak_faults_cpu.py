"""The fault soak (soak_faults.py) on CPU ranks: one episode a fault, two real processes each, a group timeout of two
seconds. In every episode every call on every rank returns bit-exact bytes or raises, tensors allocated where a
failed call's output was stay unwritten after a delay longer than the timeout, no rank dies by a signal (but the one
SIGKILLed) or hangs, and the surviving ranks' other group gathers bit-exact after the fault. Each fault runs on the
path where it bites: staging, the direct path, or where the ranks' paths part (a zero-size call, the list form)."""
import pytest
from soak_faults import describe, run_episode

SEED = 20261125
TIMEOUT_S = 2.0


def _fault(kind, rank, at, direct, inner_allgathers=False):
    return {"kind": kind, "rank": rank, "at": at, "direct": direct, "inner_allgathers": inner_allgathers}


FAULTS = [
    _fault("late_cpu", 1, 2, False),
    _fault("late_cpu", 0, 4, True),
    # Zero-size: staging on the rank that passes it, direct on the other. The list form goes through staging where
    # the peer's into-tensor call goes direct.
    _fault("zero_size", 1, 3, True),
    _fault("other_form", 0, 2, True),
    _fault("other_call", 1, 3, True),
    _fault("other_call", 0, 2, False),
    _fault("other_call", 1, 2, True, inner_allgathers=True),
    _fault("two_threads", 0, 3, False),
    _fault("two_threads", 0, 3, True),
    _fault("exit_in_flight", 1, 3, True),
    _fault("sigkill", 0, 5, False),
]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f['kind']}-{'direct' if f['direct'] else 'staging'}"
                         f"{'-inner' if f['inner_allgathers'] else ''}")
def test_fault_keeps_the_rules(fault):
    problems, outcomes, _ = run_episode(SEED, fault["at"], fault, calls=8, timeout_s=TIMEOUT_S)
    assert not problems, f"{describe(fault)}:\n" + "\n".join(problems)
    for rank, seen in outcomes.items():
        if fault["kind"] in ("late_cpu", "zero_size", "exit_in_flight", "sigkill", "other_call"):
            # The fault must have been seen: some call raised on every survivor.
            assert any(not o.startswith("ok") for o in seen), f"rank {rank} saw no error: {seen}"
        if fault["kind"] == "other_call":
            # In the board's words on both ranks, whichever path each call took (an inner all-gather too).
            first = next(o for o in seen if not o.startswith("ok"))
            assert "the ranks called different collectives" in first, f"rank {rank}: {first}"
