"""A fault soak: two real ranks (tests/mp_harness.py) run a group's all-gathers while the seed picks a fault, and every
rank checks what the fault rules promise (docs/errors.md): a call returns bit-exact bytes or raises, nothing of ours
writes into memory after the call that owned it ended, no process dies by a signal, and the group's failure stays
in that group.

    python tests/soak_faults.py --faults 20 --seed 7 [--device cpu|cuda] [--only late_cpu,sigkill] [--hardware-queues N]
    SDMA_TEST_SHARE_GPU=1 make soak-faults SOAK_ARGS="--faults 40 --seed 7"     (two ranks on the one GPU)

Each fault is one episode: two fresh processes, a faulted group (the default one, its timeout --timeout seconds, so
that a fault costs seconds) and another group over the same ranks; --calls all-gathers on the faulted group, each of
a size, form and async-ness drawn from (seed, episode, call), on inputs every rank rebuilds from (seed, episode,
call, rank), into outputs poisoned first. The faults (FAULTS; the seed picks one per episode, the rank and the call):
    late_cpu        the rank's CPU reaches the call later than the group's timeout
    stream_held     (GPU) the rank's stream is held beyond the timeout by a spin kernel (torch.cuda._sleep)
    zero_size       the rank passes a zero-size input and output to the call
    other_form      the rank calls the list form (all_gather) where the peer calls all_gather_into_tensor
    other_call      the rank calls broadcast (src 0, its input as the buffer) where the peer all-gathers: by the
                    copy engines or shared memory on the direct path, else by the inner backend; in half the
                    episodes the all-gathers below 1 MiB go to the inner backend (on one GPU shared by two ranks
                    always the direct path and no inner all-gather: NCCL refuses two ranks on one GPU)
    two_threads     every rank's first calls come from two threads at once, each on a group of its own (on GPUs,
                    each on a stream of its own)
    exit_in_flight  the rank issues an async call and exits (os._exit) with it in flight
    sigkill         the rank issues an async call and is killed by SIGKILL
    graph_destroy   (GPU) a CUDA graph of all-gathers is replayed and the group destroyed with the replay in flight
Checked on every rank that lives: every call returned bit-exact bytes or raised (on GPU, where a failure may surface
only with a later call of the group, wrong bytes are accepted only if a later call, or a last probe call, raises);
tensors allocated after a call raised (canaries, of its output's size, where the allocator puts the memory the output
gave back) and the outputs of calls that returned (refilled with a canary) are unwritten after a delay longer than the
timeout; after the fault, the other group gathers bit-exact (not after a rank died: the other group has it too). Checked
by the parent: no rank ended by a signal except the one killed, no rank hung past the episode's limit. Prints one line
per episode and exits 1 if any failed.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import signal
import sys
import threading
import time
import traceback
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
for path in (HERE, os.path.dirname(HERE)):  # mp_harness, and the torch_sdma of this checkout
    if path not in sys.path:
        sys.path.insert(0, path)

from mp_harness import run_group  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")

CPU_FAULTS = ("late_cpu", "zero_size", "other_form", "two_threads", "exit_in_flight", "sigkill", "other_call")
GPU_FAULTS = CPU_FAULTS + ("stream_held", "graph_destroy")
# Faults after which the faulted rank's process is gone on purpose.
LEAVING = ("exit_in_flight", "sigkill")
POISON = 0xA5
CANARY = 0x3C
CANARIES_PER_CALL = 4
# Outputs stay under glibc's mmap threshold (128 KiB), so that the allocator gives their memory to the canaries.
MAX_ELEMENTS = 24 << 10


def _data(seed, episode, call, rank, n, device):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{episode}/{call}/{rank}".encode()))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _plan(seed, episode, calls):
    """What every rank draws for the episode's calls: (elements per rank, async, list form, async calls in flight at
    most before they are waited for)."""
    rng = random.Random(f"plan/{seed}/{episode}")
    return [(rng.randint(1, MAX_ELEMENTS), rng.random() < 0.6, rng.random() < 0.25, rng.randint(1, 4))
            for _ in range(calls)]


def pick_episode(seed, episode, faults, calls):
    rng = random.Random(f"fault/{seed}/{episode}")
    kind = faults[episode % len(faults)] if episode < len(faults) else rng.choice(faults)
    fault = {"kind": kind, "rank": rng.randint(0, 1), "at": rng.randint(1, calls - 1), "direct": rng.random() < 0.5}
    # A broadcast may meet an all-gather that the inner backend runs (below TORCH_SDMA_MIN_BYTES) as well.
    fault["inner_allgathers"] = kind == "other_call" and rng.random() < 0.5
    return fault


def fit_to_device(fault, device):
    """The fault as it can run on `device`: off the direct path a CUDA broadcast goes to NCCL, which refuses two
    ranks on one GPU."""
    if fault["kind"] == "other_call" and device == "cuda" and os.environ.get("SDMA_TEST_SHARE_GPU") == "1":
        return dict(fault, direct=True, inner_allgathers=False)
    return fault


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _issue(group, n, seed, episode, call, rank, device, async_op=False, list_form=False, inp=None, out=None):
    """Issues one all-gather on `group`; returns (work or None, output, expected) without waiting or checking."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if inp is None:
        inp = _data(seed, episode, call, rank, n, device)
    if out is None:
        out = torch.full((world * n,), POISON, dtype=torch.uint8, device=device)
    if list_form:
        parts = list(out.chunk(world)) if out.numel() else [out[:0] for _ in range(world)]
        work = dist.all_gather(parts, inp, group=group, async_op=async_op)
    else:
        work = dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    expected = torch.cat([_data(seed, episode, call, q, n, device) for q in range(world)])
    return work, out, expected


def _gather(group, n, seed, episode, call, rank, device, async_op=False, list_form=False, inp=None, out=None):
    """One all-gather on `group`, waited for; returns (output, expected) without checking."""
    work, out, expected = _issue(group, n, seed, episode, call, rank, device, async_op, list_form, inp, out)
    if work is not None:
        work.wait()
    _sync(device)
    return out, expected


def _first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def episode_body(ctx, seed, episode, fault, calls, timeout_s, device_kind):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = ctx.device if device_kind == "cuda" else torch.device("cpu")
    backend = "cpu:gloo,cuda:sdma" if device.type == "cuda" else "sdma"
    ctx.init_pg(backend, timeout_s=timeout_s)
    me, kind = ctx.rank, fault["kind"]
    faulted = me == fault["rank"]
    world = dist.group.WORLD
    violations, outcomes, canaries, done_outputs, suspects = [], [], [], [], []
    landed = [0, 0]  # canaries placed, and of those on memory a failed call's output gave back
    other = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=max(30.0, 4 * timeout_s)))

    def check(out, expected, what, call=None):
        if not torch.equal(out.cpu(), expected.cpu()):
            bad = (out.cpu() != expected.cpu()).nonzero()
            found = f"{what}: returned without error but {bad.numel()} bytes wrong (first at {bad[0].item()})"
            if call is not None and device.type == "cuda":
                # A GPU call's failure may surface only with a later call of the group (its stream ran on):
                # acceptable only if a later call raises.
                suspects.append((call, len(outcomes), found))
            else:
                violations.append(found)

    # The other group connects before the fault, so that its later use checks that it survives, not its connect.
    check(*_gather(other, 64, seed, episode, -1, me, device), "other group before the fault")

    if kind == "two_threads":
        groups = [dist.new_group([0, 1], timeout=datetime.timedelta(seconds=timeout_s)) for _ in range(2)]
        errors = []

        def first_calls(t):
            # On GPUs each thread issues on a stream of its own: two groups' calls interleaved on one stream in
            # different orders on the two ranks wait for each other, as NCCL's communicators do (as in
            # test_first_calls_from_threads_cpu.py).
            stream = torch.cuda.Stream(device) if device.type == "cuda" else None
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for c in range(3):
                        out, expected = _gather(groups[t], 1000 + 7 * c + t, seed, episode, 100 * (t + 1) + c, me,
                                                device, async_op=c == 1)
                        check(out, expected, f"thread {t} call {c}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"thread {t}: {_first_line(e)}")

        threads = [threading.Thread(target=first_calls, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Nothing here is a user mistake: a call from either thread must not raise either.
        violations.extend(f"first calls from two threads: {e}" for e in errors)

    plan = _plan(seed, episode, calls)
    pending = []  # async calls in flight: (call, work, output, expected, description)

    def place_canaries(c, out):
        """The output goes back to the allocator; tensors of its size take memory now, where the allocator gives
        it (often the output's own), and must stay as written. Counts those that did land on the output's bytes."""
        at, size = (out.data_ptr(), out.numel()) if out is not None else (0, 0)
        del out
        for _ in range(CANARIES_PER_CALL):
            t = torch.full((size,), CANARY, dtype=torch.uint8, device=device)
            landed[0] += 1
            landed[1] += bool(size) and t.data_ptr() < at + size and at < t.data_ptr() + size
            canaries.append((c, t))

    def settle(c, work, out, expected, what):
        """Waits for one call; checks its bytes, or where it raised puts canaries where its output was."""
        try:
            if work is not None:
                work.wait()
            _sync(device)
        except Exception as e:  # noqa: BLE001
            outcomes.append(_first_line(e))
            del work
            place_canaries(c, out)
            return
        if out.numel() == 0 and faulted and kind == "zero_size":
            outcomes.append("ok (zero-size, nothing to check)")
            return
        outcomes.append("ok")
        check(out, expected, what, call=c)
        # The call ended without error: nothing may write into its output from now on.
        out.fill_(CANARY)
        done_outputs.append((c, out))

    def settle_pending():
        while pending:
            settle(*pending.pop(0))

    for c, (n, async_op, list_form, depth) in enumerate(plan):
        inp = out = None
        if faulted and c == fault["at"]:
            if kind == "late_cpu":
                time.sleep(timeout_s * 1.5 + 1.0)
            elif kind == "stream_held":
                torch.cuda._sleep(int(2e9 * (timeout_s * 1.5 + 1.0)))  # about 2 GHz of cycles a second
            elif kind == "zero_size":
                inp = torch.empty(0, dtype=torch.uint8, device=device)
                out = torch.empty(0, dtype=torch.uint8, device=device)
            elif kind == "other_form":
                list_form = not list_form
            elif kind == "other_call":
                # Its buffer's bytes are not checked: a call that differs across ranks must raise, on this rank or
                # (a GPU stream having run on) with a later call of the group, which the fault's test asks for.
                try:
                    work = dist.broadcast(_data(seed, episode, c, me, n, device), src=0, async_op=async_op)
                    if work is not None:
                        work.wait()
                    _sync(device)
                    outcomes.append("ok (a broadcast where the peer all-gathers)")
                except Exception as e:  # noqa: BLE001
                    outcomes.append(_first_line(e))
                continue
            elif kind in LEAVING:
                x = _data(seed, episode, c, me, n, device)
                y = torch.full((2 * n,), POISON, dtype=torch.uint8, device=device)
                dist.all_gather_into_tensor(y, x, async_op=True)
                sys.stdout.flush()
                if kind == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(0)
        if out is None:
            out = torch.full((2 * n,), POISON, dtype=torch.uint8, device=device)
        what = (f"call {c} ({n} B a rank, {'async' if async_op else 'sync'}, "
                f"{'list' if list_form else 'into tensor'})")
        try:
            work, out, expected = _issue(world, n, seed, episode, c, me, device, async_op, list_form, inp, out)
        except Exception as e:  # noqa: BLE001  (a sync call's error, or a refusal)
            outcomes.append(_first_line(e))
            place_canaries(c, out)
            continue
        pending.append((c, work, out, expected, what))
        del work, out, expected
        if not async_op or len(pending) >= depth:
            settle_pending()
    settle_pending()
    # One more call on the faulted group: where an earlier call failed unseen (a GPU stream ran on), it raises.
    try:
        check(*_gather(world, 16, seed, episode, calls, me, device), "the last call on the faulted group",
              call=calls)
        outcomes.append("ok (last call)")
    except Exception as e:  # noqa: BLE001
        outcomes.append(_first_line(e))
    for c, index, found in suspects:
        if all(o.startswith("ok") for o in outcomes[index:]):
            violations.append(found + ", and no later call of the group raised")

    if kind == "graph_destroy" and device.type == "cuda":
        violations.extend(_graph_destroy(seed, episode, me, device))
    # Longer than the group's timeout: a late peer's copies would have landed by now.
    time.sleep(timeout_s + 2.0)
    _sync(device)
    for c, t in canaries:
        if not bool((t == CANARY).all()):
            violations.append(f"a canary allocated after call {c} raised was written: "
                              f"{int((t != CANARY).sum())} bytes changed")
    for c, t in done_outputs:
        if not bool((t == CANARY).all()):
            violations.append(f"the output of call {c}, which had returned without error, was written afterwards: "
                              f"{int((t != CANARY).sum())} bytes changed")
    if kind not in LEAVING:
        for c in range(3):
            try:
                check(*_gather(other, 500 + 13 * c, seed, episode, 1000 + c, me, device, async_op=c == 1),
                      f"other group after the fault, call {c}")
            except Exception as e:  # noqa: BLE001
                violations.append(f"other group after the fault, call {c} raised: {_first_line(e)}")
    return {"violations": violations, "outcomes": outcomes, "canaries": landed}


def _graph_destroy(seed, episode, me, device):
    """A graph of all-gathers on a group of its own, replayed, then the group destroyed with the replay in flight:
    the replay ends (bit-exact or not at all readable) and nothing dies."""
    import torch
    import torch.distributed as dist

    found = []
    try:
        g = dist.new_group([0, 1])
        n = 4096
        x = _data(seed, episode, 500, me, n, device)
        y = torch.full((2 * n,), POISON, dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(y, x, group=g)  # connect outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            for _ in range(4):
                dist.all_gather_into_tensor(y, x, group=g)
        graph.replay()
        dist.destroy_process_group(g)
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        found.append(f"graph_destroy raised: {_first_line(e)}\n{traceback.format_exc()}")
    return found


def run_episode(seed, episode, fault, calls=8, timeout_s=2.5, device="cpu", env=None):
    """One episode in two fresh processes. Returns (problems, per-rank outcomes, [canaries, of them on memory a
    failed call's output gave back])."""
    e = {"TORCH_SDMA_MIN_BYTES": "1M" if fault.get("inner_allgathers") else "0", "TORCH_SDMA_DISABLE": None,
         "TORCH_SDMA_TEST_FAULT": None,
         # Every rank must outlive the fault to report what its calls returned (docs/api.md).
         "TORCH_SDMA_ASYNC_ERROR_HANDLING": "0",
         "TORCH_SDMA_DIRECT": "1" if fault["direct"] else "0"}
    e.update(env or {})
    limit = 60 + 6 * timeout_s
    res = run_group(episode_body, 2, None, env=e, timeout=limit, pg_timeout_s=timeout_s, grace=limit,
                    cuda=device == "cuda",
                    kwargs={"seed": seed, "episode": episode, "fault": fault, "calls": calls, "timeout_s": timeout_s,
                            "device_kind": device})
    problems, outcomes, landed = [], {}, [0, 0]
    for r in res.ranks:
        leaving = fault["kind"] in LEAVING and r.rank == fault["rank"]
        if r.killed_by_harness:
            problems.append(f"rank {r.rank}: hung (killed by the harness after {limit:.0f} s)\n{r.log_tail[-3000:]}")
            continue
        if r.exitcode is not None and r.exitcode < 0 and not (leaving and fault["kind"] == "sigkill"):
            problems.append(f"rank {r.rank}: ended by signal {-r.exitcode}\n{r.log_tail[-3000:]}")
            continue
        if leaving:
            continue
        if r.status != "ok":
            problems.append(f"rank {r.rank}: {r.error or 'no result'}")
            continue
        outcomes[r.rank] = r.value["outcomes"]
        landed = [a + b for a, b in zip(landed, r.value["canaries"])]
        problems.extend(f"rank {r.rank}: {v}" for v in r.value["violations"])
        if r.teardown_error:
            problems.append(f"rank {r.rank}: destroy_process_group raised: {r.teardown_error.splitlines()[-1]}")
    return problems, outcomes, landed


def describe(fault):
    return (f"{fault['kind']} on rank {fault['rank']} at call {fault['at']} "
            f"({'direct' if fault['direct'] else 'staging'}"
            f"{', all-gathers below 1 MiB on the inner backend' if fault.get('inner_allgathers') else ''})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=len(CPU_FAULTS), help="episodes, one fault each")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda where there is one")
    p.add_argument("--calls", type=int, default=8, help="all-gathers on the faulted group per episode")
    p.add_argument("--timeout", type=float, default=2.5, help="the faulted group's timeout, seconds")
    p.add_argument("--only", default="", help="comma-separated fault kinds to draw from (default: all)")
    p.add_argument("--hardware-queues", type=int, default=32,
                   help="GPU: CUDA_DEVICE_MAX_CONNECTIONS in the ranks (default 32, what torch_sdma asks for: the "
                        "ranks start CUDA before they load it, too late for it to set it; 1: Megatron's setting, "
                        "under which two_threads hangs, its groups' calls crossing on one hardware queue, "
                        "docs/errors.md)")
    args = p.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    faults = GPU_FAULTS if args.device == "cuda" else CPU_FAULTS
    if args.only:
        faults = tuple(k for k in args.only.split(",") if k)
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": str(args.hardware_queues)} if args.device == "cuda" else None
    failed = 0
    t0 = time.monotonic()
    for i in range(args.faults):
        fault = fit_to_device(pick_episode(args.seed, i, faults, args.calls), args.device)
        t = time.monotonic()
        problems, outcomes, landed = run_episode(args.seed, i, fault, args.calls, args.timeout, args.device, env)
        status = "FAIL" if problems else "ok"
        failed += bool(problems)
        raised = {r: sum(not o.startswith("ok") for o in v) for r, v in outcomes.items()}
        print(f"seed {args.seed} episode {i}: {describe(fault)}: {status} in {time.monotonic() - t:.1f} s "
              f"(calls raised per rank {raised}; canaries on a failed call's memory {landed[1]} of {landed[0]})",
              flush=True)
        for pr in problems:
            print("    " + pr.replace("\n", "\n    "), flush=True)
    print(f"{args.faults - failed} of {args.faults} episodes ok in {time.monotonic() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
