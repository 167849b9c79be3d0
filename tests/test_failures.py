"""On CPU: a peer that is SIGKILLed (before or in the middle of an all-gather) or
that never calls gives every other rank a clear error naming the missing peer within the group's timeout,
never a hang."""
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from checks.data import rand
from mp_harness import run_group

PG_TIMEOUT_S = 6.0
SLACK_S = 25.0  # scheduling on a loaded 2-core CI machine
VICTIM = 1


def _mentions_peer(msg, peer):
    return re.search(rf"(peer|rank)[^\n]{{0,60}}\b{peer}\b", msg, re.I) is not None


def _attempt(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "runtime_error": isinstance(e, RuntimeError),
                "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def _all_gather(form, W, n, async_op, name, rank):
    x = rand(name, rank, (n,), torch.float32)
    if form == "into_tensor":
        out = torch.empty(W * n)
        w = dist.all_gather_into_tensor(out, x, async_op=async_op)
    elif form == "list":
        w = dist.all_gather([torch.empty(n) for _ in range(W)], x, async_op=async_op)
    else:  # coalesced
        with dist._coalescing_manager(async_ops=async_op) as cm:
            dist.all_gather_into_tensor(torch.empty(W * n), x)
            dist.all_gather_into_tensor(torch.empty(W * 3), x[:3].clone())
        w = cm if async_op else None
    if async_op:
        w.wait()


def killed_before_call_body(ctx, n, form, async_op):
    W, rank = ctx.world, ctx.rank
    _all_gather(form, W, n, False, "warm", rank)  # every member has mapped everything
    _all_gather(form, W, 1000, False, "warm2", rank)
    ctx.barrier_store("warm")
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.3)
    return _attempt(lambda: _all_gather(form, W, n, async_op, "after", rank))


def killed_mid_collective_body(ctx, n, killer):
    """Every rank loops over large all-gathers; the victim is SIGKILLed while they run (by a timer thread of its
    own, or by rank 0)."""
    W, rank = ctx.world, ctx.rank
    ctx.publish(f"pid{rank}", os.getpid())
    _all_gather("into_tensor", W, n, False, "warm", rank)
    ctx.barrier_store("warm")
    # The kill is armed once the killer has finished one all-gather of the loop (on a loaded 2-core machine a
    # fixed delay from the start could land before the survivors finished any).
    arm = None
    if killer == "self" and rank == VICTIM:
        arm = threading.Timer(0.25, os.kill, (os.getpid(), signal.SIGKILL))
    if killer == "rank0" and rank == 0:
        arm = threading.Timer(0.25, os.kill, (ctx.fetch(f"pid{VICTIM}"), signal.SIGKILL))
    x = rand("loop", rank, (n,), torch.float32)
    out = torch.empty(W * n)
    t0 = time.monotonic()
    k = 0

    def loop():
        nonlocal k
        while time.monotonic() - t0 < 60:
            dist.all_gather_into_tensor(out, x)
            k += 1
            if k == 1 and arm is not None:
                arm.start()

    r = _attempt(loop)
    r["iterations"] = k
    return r


def never_calls_body(ctx, n, form, async_op):
    W, rank = ctx.world, ctx.rank
    _all_gather(form, W, n, False, "warm", rank)
    ctx.barrier_store("warm")
    if rank == VICTIM:
        # stay alive without calling until the others are done (or the harness ends us)
        deadline = time.monotonic() + PG_TIMEOUT_S + SLACK_S + 30
        while time.monotonic() < deadline:
            if ctx.store.check(["pub/done"]) and int(ctx.store.add("ndone", 0)) >= W - 1:
                break
            time.sleep(0.1)
        return {"victim": True}
    r = _attempt(lambda: _all_gather(form, W, n, async_op, "after", rank))
    ctx.store.add("ndone", 1)
    ctx.publish("done", 1)
    return r


def _check_survivors(res, victim_dead, limit_s):
    problems = []
    for r in res.ranks:
        if r.rank == VICTIM:
            if victim_dead and r.exitcode != -signal.SIGKILL:
                problems.append(f"victim rank {VICTIM} exit code {r.exitcode}, expected SIGKILL")
            continue
        if r.status != "ok":
            problems.append(f"rank {r.rank}: {r.error or 'no result'} (killed_by_harness={r.killed_by_harness})")
            continue
        v = r.value
        if v["error"] is None:
            problems.append(f"rank {r.rank}: the all-gather succeeded although rank {VICTIM} was missing")
            continue
        if not v["runtime_error"]:
            problems.append(f"rank {r.rank}: error is not a RuntimeError: {v['error']}")
        if not _mentions_peer(v["error"], VICTIM):
            problems.append(f"rank {r.rank}: error does not name the missing peer {VICTIM}: {v['error']!r}")
        if v["elapsed"] > limit_s:
            problems.append(f"rank {r.rank}: error after {v['elapsed']:.1f}s, limit {limit_s:.1f}s "
                            f"(group timeout {PG_TIMEOUT_S}s): {v['error']}")
    assert not problems, "\n".join(problems) + "\n" + res.describe(expect_dead=(VICTIM,))


def _run(body, world, kwargs, env=None):
    return run_group(body, world, "sdma", kwargs=kwargs, env=env, timeout=PG_TIMEOUT_S + SLACK_S + 90,
                     pg_timeout_s=PG_TIMEOUT_S, grace=PG_TIMEOUT_S + SLACK_S + 30, destroy=False, hard_exit=True)


@pytest.mark.parametrize(
    "world,form,async_op",
    [(2, "into_tensor", False), (3, "into_tensor", True), (2, "list", True), (3, "coalesced", False)],
)
def test_peer_killed_before_call(world, form, async_op):
    res = _run(killed_before_call_body, world, {"n": 1 << 20, "form": form, "async_op": async_op})
    _check_survivors(res, True, PG_TIMEOUT_S + SLACK_S)


@pytest.mark.parametrize("world,killer", [(2, "self"), (3, "rank0")])
def test_peer_killed_mid_collective(world, killer):
    # small staging: the large all-gathers are chunked, so the kill lands inside a pipelined collective
    res = _run(killed_mid_collective_body, world, {"n": 2 << 20, "killer": killer},
               env={"TORCH_SDMA_STAGING_BYTES": "256K"})
    _check_survivors(res, True, 0.25 + PG_TIMEOUT_S + SLACK_S)
    for r in res.ranks:
        if r.rank != VICTIM and r.status == "ok":
            assert r.value["iterations"] >= 1, r.value


@pytest.mark.parametrize("world,form,async_op", [(2, "into_tensor", False), (3, "into_tensor", True),
                                                 (2, "coalesced", True)])
def test_peer_never_calls(world, form, async_op):
    res = _run(never_calls_body, world, {"n": 4096, "form": form, "async_op": async_op})
    _check_survivors(res, False, PG_TIMEOUT_S + SLACK_S)
