"""The GPU twins of test_user_mistakes_cpu.py (2 GPUs, or one shared by two ranks with SDMA_TEST_SHARE_GPU=1;
skipped elsewhere): the same mistakes on CUDA tensors give the same errors on every rank, no signal death, no wrong
bytes, nothing left in /dev/shm."""
import pytest
from test_user_mistakes_cpu import (
    PG_TIMEOUT_S,
    SLACK_S,
    assert_named_on_every_rank,
    calls_differ_body,
    destroyed_body,
    first_call_missing_body,
    knobs_differ_body,
    one_paragraph,
    run_mistake,
    sizes_agree_body,
    sizes_differ_body,
)

from checks.data import SHARE_GPU
from conftest import cuda_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.parametrize("knob,rank0,rank1_shows", [
    ("TORCH_SDMA_STAGING_BYTES", "64M", "group rank 0 has 67108864, group rank 1 has 268435456"),
    ("TORCH_SDMA_SLOTS", "4", "group rank 0 has 4, group rank 1 has 2"),
    ("TORCH_SDMA_CHUNK_BYTES", "8K", "group rank 0 has 8192, group rank 1 has 0"),
    ("TORCH_SDMA_DIRECT", "0", "group rank 0 has 0, group rank 1 has 1"),
    ("TORCH_SDMA_DISABLE", "1", "group rank 0 has 1, group rank 1 has 0"),
    ("TORCH_SDMA_MIN_BYTES", "1M", "group rank 0 has 1048576, group rank 1 has 0"),
])
def test_knob_set_on_one_rank_refuses_the_group(knob, rank0, rank1_shows):
    values = run_mistake(knobs_differ_body, per_rank_env={0: {knob: rank0}}, cuda=True)
    for rank, v in enumerate(values):
        err = v["error"]
        assert err is not None and err.startswith("ValueError: torch_sdma: group"), f"rank {rank}: {err}"
        assert knob in err and rank1_shows in err, f"rank {rank}: {err}"
        one_paragraph(err)


# Sizes are compared at every call on both GPU paths: the direct path in its arrival mailbox, staging (direct off,
# and every list form) on its size board. A rank that finds the other's size refuses the call before it enqueues;
# a rank that posted first has enqueued its copies, and its watchdog fails the call within moments: a synchronous
# call's error then comes with the next call.
@pytest.mark.parametrize("form,async_op,env", [
    ("into_tensor", False, {}),
    ("into_tensor", True, {}),
    ("into_tensor", False, {"TORCH_SDMA_DIRECT": "0"}),
    ("into_tensor", True, {"TORCH_SDMA_DIRECT": "0"}),
    ("list", False, {}),
])
def test_sizes_differ_fail_every_rank(form, async_op, env):
    values = run_mistake(sizes_differ_body, "sdma", kwargs={"form": form, "async_op": async_op}, env=env,
                         cuda=True)
    direct = env.get("TORCH_SDMA_DIRECT") != "0" and form == "into_tensor"
    assert any(v["refused_at_call"] for v in values), f"no rank refused the call before enqueueing it: {values}"
    for rank, v in enumerate(values):
        err = v["error"] or v["after"]
        assert err is not None and "different sizes" in err, f"rank {rank}: {v}"
        assert "4096 bytes" in err and "8192 bytes" in err, err
        one_paragraph(err)
        # A rank that refused enqueued nothing. Through staging its output then keeps its poison (peers write only
        # into its staging); on the direct path a peer that did not see the mismatch may have pushed into it.
        assert not v["refused_at_call"] or v["untouched"] or direct, f"rank {rank}: bytes landed in its output"


@pytest.mark.parametrize("env", [{}, {"TORCH_SDMA_DIRECT": "0"}])
def test_equal_sizes_pass_the_size_check(env):
    run_mistake(sizes_agree_body, "sdma", env=env, cuda=True)


def test_destroyed_group_raises():
    for rank, errors in enumerate(run_mistake(destroyed_body, "sdma", cuda=True)):
        for what, err in errors.items():
            assert err is not None, f"rank {rank}: {what} on a destroyed group did not raise"
            one_paragraph(err)


def test_peer_missing_at_the_first_call_is_named():
    v = run_mistake(first_call_missing_body, "sdma", cuda=True)[0]
    err = v["error"]
    assert err is not None and "group ranks [1]" in err and "never reached it" in err, err
    one_paragraph(err)
    assert v["elapsed"] < PG_TIMEOUT_S + SLACK_S, v


# Ranks that make different calls at one sequence number: the rank that reads the other's post on the call board
# refuses at once; the other's copy-engine watchdog (an all-gather) or the watcher of delegated calls (NCCL's
# all_reduce or broadcast, whose communicator it aborts) fails its call in the same words.
@pytest.mark.parametrize("case,warm,late", [
    ("all_reduce", True, 0),
    ("all_reduce", True, 1),
    ("all_reduce", False, None),
    ("all_reduce_on_0", False, None),  # rank 0's all_reduce creates NCCL's communicator; rank 1 never joins it
    ("all_reduce_on_0", False, 1),  # rank 0 posts first, so it reads rank 1's post only by waiting for it
    ("broadcast", True, 0),
    ("zero", True, 1),
    ("zero", False, 0),
    ("list", True, 1),
    ("list", True, 0),
])
@pytest.mark.parametrize("env", [{}, {"TORCH_SDMA_DIRECT": "0"}])
def test_calls_that_differ_are_named_on_every_rank(case, warm, late, env):
    if SHARE_GPU and case in ("all_reduce", "all_reduce_on_0", "broadcast"):
        pytest.skip("NCCL refuses two ranks on one GPU")
    values = run_mistake(calls_differ_body, "cpu:gloo,cuda:sdma", kwargs={"case": case, "warm": warm, "late": late},
                         env=env, cuda=True)
    assert_named_on_every_rank(values, case, 3 if warm and not SHARE_GPU else 2 if warm else 1, late=None)


# Below TORCH_SDMA_MIN_BYTES the all-gathers go to NCCL: the one a peer's other call meets fails in the board's words,
# its communicator aborted, also where it posted first (late 1) and is inside NCCL's all-gather.
@pytest.mark.parametrize("late", [1, 0])
def test_inner_allgather_that_differs_is_named_on_every_rank(late):
    if SHARE_GPU:
        pytest.skip("NCCL refuses two ranks on one GPU")
    values = run_mistake(calls_differ_body, "cpu:gloo,cuda:sdma",
                         kwargs={"case": "all_reduce", "warm": True, "late": late},
                         env={"TORCH_SDMA_MIN_BYTES": "1M"}, cuda=True)
    assert_named_on_every_rank(values, "all_reduce", 3, late)


def refused_exchange_body(ctx, before):
    """Rank 1's all_to_all_single is refused on its own arguments (input splits past its input) while rank 0 makes a
    valid one; `before`, the collective both made first, if any."""
    import time

    import torch
    import torch.distributed as dist

    dev, n = ctx.device, 1024
    inp = torch.arange(2 * n, dtype=torch.int32, device=dev) + 7 * ctx.rank
    out = torch.full((2 * n,), -1, dtype=torch.int32, device=dev)
    if before == "all_to_all_single":
        dist.all_to_all_single(out, inp)
    elif before == "all_gather":
        dist.all_gather_into_tensor(torch.empty(4 * n, dtype=torch.int32, device=dev), inp)
    torch.cuda.synchronize(dev)
    ctx.barrier_store("refused-exchange")
    t0 = time.monotonic()
    try:
        if ctx.rank == 1:
            dist.all_to_all_single(out, inp, [n, n], [n, n + 1])
        else:
            dist.all_to_all_single(out, inp, [n, n], [n, n])
        torch.cuda.synchronize(dev)
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    elapsed, next_err = time.monotonic() - t0, None
    if err is None:  # an enqueued NCCL call fails afterwards: the group's next call says so
        try:
            dist.all_to_all_single(out, inp)
            torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001
            next_err = f"{type(e).__name__}: {e}"
    return {"error": err, "elapsed": elapsed, "next_error": next_err}


# NCCL connects a direction with a peer at its first use inside the call, on the caller's CPU, waiting for the peer
# there: a peer that refused its call must still fail this rank's at once, in the board's words. The exchange goes to
# NCCL by the route (below TORCH_SDMA_MIN_BYTES) or by the runner (the direct path off); its NCCL directions are new
# (after nothing, or after an all-gather, on the copy engines or NCCL), or connected (after an all_to_all_single: the
# watcher of delegated collectives then aborts NCCL's communicator, and the error may come with the next call).
@pytest.mark.parametrize(
    "env,before",
    [
        ({"TORCH_SDMA_DIRECT": "0"}, "nothing"),
        ({"TORCH_SDMA_DIRECT": "0"}, "all_gather"),
        ({"TORCH_SDMA_MIN_BYTES": "1G"}, "all_gather"),
        ({"TORCH_SDMA_DIRECT": "0"}, "all_to_all_single"),
    ],
    ids=["direct_off-first", "direct_off-after_all_gather", "below_min_bytes-after_all_gather", "direct_off-warm"],
)
def test_delegated_exchange_refused_on_a_peer_fails_at_once(env, before):
    if SHARE_GPU:
        pytest.skip("NCCL refuses two ranks on one GPU")
    v0, v1 = run_mistake(refused_exchange_body, "cpu:gloo,cuda:sdma", kwargs={"before": before},
                         env={**env, "TORCH_SDMA_ASYNC_ERROR_HANDLING": "0"}, cuda=True)
    assert v1["error"] is not None and v1["error"].startswith(("ValueError", "RuntimeError")), v1
    words = v0["error"] if before != "all_to_all_single" else (v0["error"] or v0["next_error"])
    assert words is not None and "group rank 1 refused" in words, v0
    assert v0["elapsed"] < PG_TIMEOUT_S + SLACK_S, v0
