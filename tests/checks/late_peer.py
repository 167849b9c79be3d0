"""A peer that reaches a synchronous call after the group's timeout, for every op that moves bytes (docs/api.md,
TORCH_SDMA_ASYNC_ERROR_HANDLING). Each op runs on a group of its own, made by every rank up front: once in time on
both ranks (the group connects), then with rank LATE sleeping past the timeout first. Each rank records what its call
gave, how long it took, and what the group's next call gave; the early rank reads the call's output right after it
returned, on its stream, and leaves a marker file once it has. A rank that the default ends never returns."""
import datetime
import os
import time

import torch
import torch.distributed as dist

OPS = ("all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast", "gather", "scatter", "send_recv")
LATE = 1
ELEMENTS = 1 << 14


def run_op(op, group, rank, world, dev):
    """The op, synchronous, on `group` (its ranks are the world's): its output."""
    x = torch.full((ELEMENTS,), float(rank + 1), device=dev)
    if op == "all_gather_into_tensor":
        out = torch.empty(world * ELEMENTS, device=dev)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    if op == "all_gather":
        outs = [torch.empty(ELEMENTS, device=dev) for _ in range(world)]
        dist.all_gather(outs, x, group=group)
        return torch.cat(outs)
    if op == "all_to_all_single":
        out = torch.empty(world * ELEMENTS, device=dev)
        dist.all_to_all_single(out, x.repeat(world), group=group)
        return out
    if op == "broadcast":
        dist.broadcast(x, src=0, group=group)
        return x
    if op == "gather":
        outs = [torch.empty(ELEMENTS, device=dev) for _ in range(world)] if rank == 0 else None
        dist.gather(x, outs, dst=0, group=group)
        return torch.cat(outs) if rank == 0 else x
    if op == "scatter":
        out = torch.empty(ELEMENTS, device=dev)
        ins = [torch.full((ELEMENTS,), float(q + 1), device=dev) for q in range(world)] if rank == 0 else None
        dist.scatter(out, ins, src=0, group=group)
        return out
    if op == "send_recv":
        if rank == LATE:
            dist.send(x, dst=0, group=group)
            return x
        out = torch.empty(ELEMENTS, device=dev)
        if rank == 0:
            dist.recv(out, src=LATE, group=group)
        return out
    raise ValueError(op)


def expected(op, rank, world):
    """What run_op returns where every rank's call completed: rank q's elements are q + 1."""
    if op in ("all_gather_into_tensor", "all_gather", "all_to_all_single") or (op == "gather" and rank == 0):
        return torch.cat([torch.full((ELEMENTS,), float(q + 1)) for q in range(world)])
    if op == "broadcast":
        return torch.full((ELEMENTS,), 1.0)
    if op in ("scatter", "gather"):
        return torch.full((ELEMENTS,), float(rank + 1))
    return torch.full((ELEMENTS,), float(LATE + 1))  # send_recv: the sender's, received by rank 0


def late_peer_body(ctx, ops, timeout_s):
    rank, world, dev = ctx.rank, ctx.world, ctx.device
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    groups = [dist.new_group(timeout=datetime.timedelta(seconds=timeout_s)) for _ in ops]
    results = {}
    for op, group in zip(ops, groups):
        run_op(op, group, rank, world, dev)  # in time: connects the group's paths
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ctx.barrier_store(f"warm/{op}")
        if rank == LATE:
            time.sleep(timeout_s + 1.5)
        r = {"error": None, "next_error": None}
        t0 = time.monotonic()
        try:
            out = run_op(op, group, rank, world, dev)
            r["exact"] = bool(torch.equal(out.cpu(), expected(op, rank, world)))  # later work that reads the output
            with open(os.path.join(ctx.run_dir, f"read.{rank}.{op}"), "w"):
                pass
        except Exception as e:  # noqa: BLE001 (what the call raised is the result)
            r["error"] = f"{type(e).__name__}: {e}"
        r["elapsed"] = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            out = torch.empty(world, device=dev)
            dist.all_gather_into_tensor(out, torch.zeros(1, device=dev), group=group)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001
            r["next_error"] = f"{type(e).__name__}: {e}"
        r["next_elapsed"] = time.monotonic() - t1
        results[op] = r
        if op != ops[-1]:  # the next op starts on both ranks together; after the last, a peer may have exited
            ctx.barrier_store(f"done/{op}", timeout_s=3 * timeout_s + 60)
    return results


def check_errors_on_every_rank(res, ops, timeout_s, slack_s, returned_exact):
    """Knob 0 (or a CPU group under either setting): every rank raised, from the call or from the group's next call,
    within the timeout plus `slack_s` of its call, and the next call was refused within `slack_s`; every rank is
    alive at the end.
    The late rank too gets an error, not a late completion: the early rank's watchdog publishes its failure mark at
    the timeout, 1.5 s before the late rank calls, and every call's enqueue reads the marks first, so the late call
    is refused. That holds only while the watchdog waits on nothing of the GPU's between finding the timeout and
    publishing it (docs/design.md, "The exit"): a read of the GPU's flags there sits behind the failed call's wait,
    the mark then comes after the late rank's call went through, and that rank gets no error from it or its next call.
    `returned_exact`: a call that returned holds the right bytes (a CPU call returns only complete)."""
    problems = []
    for r in res.ranks:
        if r.status != "ok":
            problems.append(f"rank {r.rank}: exit {r.exitcode}, {r.error or 'no result'}")
            continue
        for op in ops:
            v = r.value[op]
            first = v["error"] or v["next_error"]
            took = v["elapsed"] + (0 if v["error"] else v["next_elapsed"])
            if first is None:
                problems.append(f"rank {r.rank} {op}: no error: {v}")
            elif took > timeout_s + slack_s:
                problems.append(f"rank {r.rank} {op}: the error came after {took:.1f} s: {v}")
            if returned_exact and v["error"] is None and not v["exact"]:
                problems.append(f"rank {r.rank} {op}: the call returned without its bytes: {v}")
            # Refused at the call where this rank's group failed; on a rank whose late call completed, failed at
            # once by the peer's failure mark.
            refused = v["next_error"] is not None and ("refused" in v["next_error"] or "failed" in v["next_error"])
            if not refused or v["next_elapsed"] > slack_s:
                problems.append(f"rank {r.rank} {op}: the next call was not refused at once: {v}")
    assert not problems, "\n".join(problems) + "\n" + res.describe()
