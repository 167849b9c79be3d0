"""A collective that one rank refuses on its own arguments (a local ValueError or RuntimeError that its script catches
and goes on from) takes its sequence number all the same: the peers' call of that number fails at once, naming that
rank, instead of meeting the rank's next call; the group then refuses further collectives on every rank, so no rank
gets another call's bytes. CPU ranks in real processes, 2 and 3 ranks, every exchange and all-gather form; the
highest rank refuses, the others call with valid arguments and outputs poisoned first, before it (their calls enqueued,
what watches them finds the refusal) or after it (they read it as they post)."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from checks.data import assert_bytes_equal, poison_, rand
from mp_harness import run_group

ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
GROUP_TIMEOUT_S = 60.0
AT_ONCE_S = 20.0  # well below the group's timeout, with room for a loaded 2-core machine


def _calls(W, r, n=16):
    """op: (the valid call, the call its refusing rank makes instead); each returns what the valid one wrote."""

    def out(k):
        return poison_(torch.empty(k, dtype=torch.float32))

    def inp(name, k):
        return rand(name, r, k, torch.float32)

    def a2a_single(g, bad):
        o = out(W * n)
        splits = [n] * (W - 1) + [n + 1] if bad else None
        dist.all_to_all_single(o, inp("a2a", W * n), None, splits, group=g)
        return o

    def a2a_list(g, bad):
        o = [out(n) for _ in range(W + (1 if bad else 0))]
        dist.all_to_all(o, [inp(f"a2al{p}", n) for p in range(len(o))], group=g)
        return torch.cat(o)

    def broadcast(g, bad):
        t = inp("bc", 2 * n).view(n, 2)[:, 0] if bad else (inp("bc", n) if r == 0 else out(n))
        dist.broadcast(t, src=0, group=g)
        return t

    def gather(g, bad):
        t = inp("ga", 2 * n).view(n, 2)[:, 0] if bad else inp("ga", n)
        slots = [out(n) for _ in range(W)] if r == 0 else None
        dist.gather(t, slots, dst=0, group=g)
        return torch.cat(slots) if slots else t

    def scatter(g, bad):
        o = out(2 * n).view(n, 2)[:, 0] if bad else out(n)
        dist.scatter(o, [inp(f"sc{p}", n) for p in range(W)] if r == 0 else None, src=0, group=g)
        return o

    def ag_tensor(g, bad):
        o = out(W * n + (1 if bad else 0))
        dist.all_gather_into_tensor(o, inp("agt", n), group=g)
        return o

    def ag_list(g, bad):
        o = [out(n + (1 if bad and p == 1 else 0)) for p in range(W)]
        dist.all_gather(o, inp("agl", n), group=g)
        return torch.cat(o)

    return {"all_to_all_single": a2a_single, "all_to_all": a2a_list, "broadcast": broadcast, "gather": gather,
            "scatter": scatter, "all_gather_into_tensor": ag_tensor, "all_gather": ag_list}


def refusal_body(ctx, refuser_late):
    torch.set_num_threads(1)
    W, r = ctx.world, ctx.rank
    refuser = W - 1
    calls = _calls(W, r)
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    groups = {op: dist.new_group(list(range(W)), timeout=timeout) for op in calls}
    results = {}
    for op, call in calls.items():
        g = groups[op]
        # Connected first, so that no call below waits for its peers' posts as a group's first DMA call does.
        warm = poison_(torch.empty(W * 8))
        dist.all_gather_into_tensor(warm, rand("warm", r, 8, torch.float32), group=g)
        assert_bytes_equal(warm, torch.cat([rand("warm", q, 8, torch.float32) for q in range(W)]), "warm-up")
        if refuser_late and r == refuser:
            time.sleep(1.0)  # the peers post and enqueue first: what watches their calls finds the refusal
        t0 = time.monotonic()
        try:
            call(g, r == refuser)
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}".split("\nException raised from")[0]
        dt = time.monotonic() - t0
        # The refusing rank goes on to its next call, which must not meet the peers' refused one.
        t1 = time.monotonic()
        nxt = poison_(torch.empty(W * 8))
        try:
            dist.all_gather_into_tensor(nxt, rand("next", r, 8, torch.float32), group=g)
            after = None
        except Exception as e:  # noqa: BLE001
            after = f"{type(e).__name__}: {e}".split("\nException raised from")[0]
        results[op] = (dt, err, time.monotonic() - t1, after, bool((nxt.view(torch.uint8) != 0xA5).any()))
        ctx.barrier_store(f"refusal-{op}", timeout_s=3 * GROUP_TIMEOUT_S)
    return results


@pytest.mark.parametrize("refuser_late", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_refused_call_fails_the_peers_call(world, refuser_late):
    res = run_group(refusal_body, world, "sdma", env=ENV, kwargs={"refuser_late": refuser_late}, timeout=600,
                    pg_timeout_s=GROUP_TIMEOUT_S, destroy=False, hard_exit=True, grace=300)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    problems = []
    refuser = world - 1
    for rank, results in enumerate(res.values()):
        for op, (dt, err, dt_after, after, written) in results.items():
            where = f"rank {rank} {op}"
            if err is None:
                problems.append(f"{where}: no error")
                continue
            if rank == refuser:
                if not err.startswith(("ValueError", "RuntimeError")):
                    problems.append(f"{where}: the refusal is not the local error: {err}")
            else:
                if f"group rank {refuser}" not in err or "refused" not in err:
                    problems.append(f"{where}: the error does not name the refusing rank: {err}")
                if dt > AT_ONCE_S:
                    problems.append(f"{where}: the error took {dt:.1f} s: {err}")
            if after is None:
                problems.append(f"{where}: the next call on the group raised nothing")
            elif dt_after > AT_ONCE_S:
                problems.append(f"{where}: the next call's error took {dt_after:.1f} s: {after}")
            if written:
                problems.append(f"{where}: the next call wrote its output")
    assert not problems, "\n".join(problems) + "\n" + repr(res.values())
