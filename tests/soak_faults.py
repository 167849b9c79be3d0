"""A fault soak: two real ranks (tests/mp_harness.py) run a group's all-gathers while the seed picks a fault, and every
rank checks what the fault rules promise (docs/errors.md): a call returns bit-exact bytes or raises, nothing of ours
writes into memory after the call that owned it ended, no process dies by a signal, and the group's failure stays
in that group.

    python tests/soak_faults.py --faults 20 --seed 7 [--device cpu|cuda] [--only late_cpu,sigkill] [--calls N]
                                [--mix auto|on|off] [--hardware-queues N]
    SDMA_TEST_SHARE_GPU=1 make soak-faults SOAK_ARGS="--faults 40 --seed 7"     (two ranks on the one GPU)

Each fault is one episode: two fresh processes, a faulted group (the default one, its timeout --timeout seconds, so
that a fault costs seconds) and another group over the same ranks; --calls calls on the faulted group, each of a size,
form and async-ness drawn from (seed, episode, call), on inputs every rank rebuilds from (seed, episode, call, rank),
into outputs poisoned first. The calls are all-gathers; with the mix (--mix, on by default on CPU ranks) half of them
are instead send/recv, batch_isend_irecv (both directions), all_to_all_single (uneven splits), broadcast, scatter or
gather, roots drawn too, each checked bit-exact like an all-gather (a sender's input must come back unchanged). The
faults (CPU_FAULTS, GPU_FAULTS; the seed picks one per episode, the rank and the call):
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
The faults of point-to-point calls and exchanges (CPU; on GPUs only where --only names them, and but for refused_local
always on the direct path, since off it CUDA point-to-point ops and exchanges go to NCCL), made at the call on both
ranks, each with its own checks besides the rules below:
    p2p_size_mismatch  the rank sends n + 1 bytes where its peer receives n, by a lone isend/irecv or inside a
                    batch_isend_irecv of both directions: both ranks raise within the timeout plus SLACK_S (on
                    GPUs the rank whose watchdog finds the peer's post may return first, its output undefined, and
                    a later call of the group raises)
    send_meets_send both ranks isend, then irecv (a halo exchange posted send-first on both): right bytes on both or
                    an error on both, within the timeout plus SLACK_S
    p2p_backlog     the rank isends 50 to 200 buffers before its peer, asleep for part of the timeout, posts the
                    irecvs; then an all-gather: every one bit-exact, no call of the episode raises
    late_sync_exchange  the rank reaches a synchronous all_to_all_single, broadcast, scatter or gather later than
                    the timeout: the early rank's call raises (on CPU, from the call), naming the late rank, or
                    (on GPUs) returns with its output undefined and a later call of the group raises; the late
                    rank gets the right bytes or a refusal
    refused_local   the rank's all_to_all_single (split sizes that do not sum to its input) or
                    all_gather_into_tensor (an output one byte too large) is refused on its own arguments; its
                    script catches the error and makes an all-gather: the refusal is the local ValueError or
                    RuntimeError, the peer's call fails naming the refusing rank (on GPUs it may return first,
                    its output undefined), and the next all-gather raises on both ranks with its output unwritten,
                    naming the refusing rank where the peer's call returned
After any of these fails the group, no later call of it returns on that rank (nothing pairs with a peer's other
call).
Checked on every rank that lives: every call returned bit-exact bytes or raised (on GPU, where a failure may surface
only with a later call of the group, wrong bytes are accepted only if a later call, or a last probe call, raises);
tensors allocated after a call raised (canaries, of its output's size, where the allocator puts the memory the output
gave back) and the outputs of calls that returned (refilled with a canary) are unwritten after a delay longer than the
timeout; after the fault, the other group gathers bit-exact (not after a rank died: the other group has it too). Checked
by the parent: no rank ended by a signal except the one killed, no rank hung past the episode's limit. Prints one line
per episode, then a summary line (calls on the faulted groups, errors, wrong bytes, signals, hangs), and exits 1 if
any episode failed.
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

ALLGATHER_FAULTS = ("late_cpu", "zero_size", "other_form", "two_threads", "exit_in_flight", "sigkill", "other_call")
# Faults of point-to-point calls and exchanges; their checks hold CPU ranks to what a CPU call gives (its error from
# the call), so they are drawn on CPU ranks only unless --only names them.
EXCHANGE_FAULTS = ("p2p_size_mismatch", "send_meets_send", "p2p_backlog", "late_sync_exchange", "refused_local")
CPU_FAULTS = ALLGATHER_FAULTS + EXCHANGE_FAULTS
GPU_FAULTS = ALLGATHER_FAULTS + ("stream_held", "graph_destroy")
# The ordinary calls of an episode with the mix on: half all-gathers, the rest these.
MIXED_OPS = ("send_recv", "batch", "all_to_all_single", "broadcast", "scatter", "gather")
LATE_SYNC_OPS = ("all_to_all_single", "broadcast", "scatter", "gather")
# An error that the fault rules bound by the group's timeout may come this much later on a loaded 2-core machine.
SLACK_S = 6.0
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


def _plan(seed, episode, calls, mix=False):
    """What every rank draws for the episode's calls, a dict each: op, elements per rank n, async_op, list_form (an
    all-gather's), depth (async calls in flight at most before they are waited for), root (a send's, broadcast's,
    scatter's or gather's rank), splits (an all_to_all_single's elements that rank q sends rank p, splits[q][p]),
    recv_first (the order of a batch's two ops). Without the mix every op is an all-gather, drawn as before the mix
    existed, so that a seed's all-gather episodes stay what they were."""
    rng = random.Random(f"plan/{seed}/{episode}")
    base = [(rng.randint(1, MAX_ELEMENTS), rng.random() < 0.6, rng.random() < 0.25, rng.randint(1, 4))
            for _ in range(calls)]
    mrng = random.Random(f"mix/{seed}/{episode}")
    plan = []
    for n, async_op, list_form, depth in base:
        op = "all_gather" if not mix or mrng.random() < 0.5 else mrng.choice(MIXED_OPS)
        plan.append({"op": op, "n": n, "async_op": async_op, "list_form": list_form, "depth": depth,
                     "root": mrng.randint(0, 1), "recv_first": mrng.random() < 0.5,
                     "splits": [[mrng.randint(1, n) for _ in range(2)] for _ in range(2)]})
    return plan


def pick_episode(seed, episode, faults, calls):
    rng = random.Random(f"fault/{seed}/{episode}")
    kind = faults[episode % len(faults)] if episode < len(faults) else rng.choice(faults)
    fault = {"kind": kind, "rank": rng.randint(0, 1), "at": rng.randint(1, calls - 1), "direct": rng.random() < 0.5}
    # A broadcast may meet an all-gather that the inner backend runs (below TORCH_SDMA_MIN_BYTES) as well.
    fault["inner_allgathers"] = kind == "other_call" and rng.random() < 0.5
    # Drawn after the keys above, so that the all-gather faults of a seed stay what they were.
    if kind == "p2p_size_mismatch":
        fault["variant"] = rng.choice(("lone", "batch"))
    elif kind == "p2p_backlog":
        fault["count"] = rng.randint(50, 200)
        fault["delay"] = rng.uniform(0.2, 0.5)  # of the group's timeout: late, but in time
    elif kind == "late_sync_exchange":
        fault["op"] = rng.choice(LATE_SYNC_OPS)
    elif kind == "refused_local":
        fault["op"] = rng.choice(("all_to_all_single", "all_gather_into_tensor"))
    return fault


def fit_to_device(fault, device):
    """The fault as it can run on `device`: off the direct path a CUDA broadcast goes to NCCL, which refuses two
    ranks on one GPU; and so do CUDA point-to-point ops and exchanges, whose faults then meet NCCL's own rules (no
    size check, a send that meets a send waits until its watchdog aborts the process), not the copy engines'. A call
    refused on one rank's arguments fails its peers' call on any path (the call board carries the refusal), so that
    fault keeps both."""
    if device != "cuda":
        return fault
    if fault["kind"] == "other_call" and os.environ.get("SDMA_TEST_SHARE_GPU") == "1":
        return dict(fault, direct=True, inner_allgathers=False)
    if fault["kind"] in EXCHANGE_FAULTS and fault["kind"] != "refused_local":
        return dict(fault, direct=True)
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


def _prepare_op(spec, group, seed, episode, call, rank, device):
    """One call of any op of the mix between ranks 0 and 1 of `group`, prepared: (output, expected, start), where
    output is what the call writes on this rank (a sender's input, which must come back unchanged), expected its
    bytes once the call ends, and start() issues the call and returns its works (none for a synchronous call)."""
    import torch
    import torch.distributed as dist

    op, n, async_op, root = spec["op"], spec["n"], spec["async_op"], spec["root"]
    peer = 1 - rank

    def data(q, k, part=""):
        return _data(seed, episode, f"{call}{part}", q, k, device)

    def poisoned(k):
        return torch.full((k,), POISON, dtype=torch.uint8, device=device)

    def works(w):
        return [w] if async_op and w is not None else []

    if op == "all_gather":
        out = poisoned(2 * n)

        def start():
            w, _, _ = _issue(group, n, seed, episode, call, rank, device, async_op, spec["list_form"], out=out)
            return works(w)
        return out, torch.cat([data(q, n) for q in range(2)]), start
    if op == "send_recv":
        if rank == root:
            out = data(rank, n)
            return out, out.clone(), lambda: works((dist.isend if async_op else dist.send)(out, peer, group=group))
        out = poisoned(n)
        return out, data(root, n), lambda: works((dist.irecv if async_op else dist.recv)(out, peer, group=group))
    if op == "batch":
        send, out = data(rank, n), poisoned(n)
        ops = [dist.P2POp(dist.isend, send, peer, group=group), dist.P2POp(dist.irecv, out, peer, group=group)]
        if spec["recv_first"]:
            ops.reverse()
        return out, data(peer, n), lambda: list(dist.batch_isend_irecv(ops))
    if op == "all_to_all_single":
        splits = spec["splits"]
        inp = data(rank, sum(splits[rank]))
        out = poisoned(sum(splits[q][rank] for q in range(2)))
        expected = torch.cat([data(q, sum(splits[q]))[sum(splits[q][:rank]):sum(splits[q][:rank + 1])]
                              for q in range(2)])
        return out, expected, lambda: works(dist.all_to_all_single(
            out, inp, [splits[q][rank] for q in range(2)], splits[rank], group=group, async_op=async_op))
    if op == "broadcast":
        out = data(root, n) if rank == root else poisoned(n)
        return out, data(root, n), lambda: works(dist.broadcast(out, src=root, group=group, async_op=async_op))
    if op == "scatter":
        out, chunks = poisoned(n), data(root, 2 * n)
        parts = list(chunks.chunk(2)) if rank == root else None
        return out, chunks[rank * n:(rank + 1) * n].clone(), lambda: works(
            dist.scatter(out, parts, src=root, group=group, async_op=async_op))
    if op == "gather":
        inp = data(rank, n)
        if rank == root:
            out = poisoned(2 * n)
            parts, expected = list(out.chunk(2)), torch.cat([data(q, n) for q in range(2)])
        else:
            out, parts, expected = inp, None, inp.clone()
        return out, expected, lambda: works(dist.gather(inp, parts, dst=root, group=group, async_op=async_op))
    raise ValueError(op)


def _full_error(e):
    """The error's whole paragraph, without the C++ frames c10d may append."""
    return f"{type(e).__name__}: {e}".split("\nException raised from")[0]


def _first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def episode_body(ctx, seed, episode, fault, calls, timeout_s, device_kind, mix=False):
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

    plan = _plan(seed, episode, calls, mix)
    pending = []  # async calls in flight: (call, works, output, expected, description)
    fault_index = None  # where the fault's own outcomes start (the kinds of EXCHANGE_FAULTS)
    fault_result = {}  # what the fault's call gave this rank, for the checks across ranks (run_episode)

    def place_canaries(c, held):
        """The output goes back to the allocator; tensors of its size take memory now, where the allocator gives
        it (often the output's own), and must stay as written. Counts those that did land on the output's bytes.
        `held` is a list holding the output, its last reference once the caller dropped its own (and the failed
        call's work and error): emptied here, so that the memory is free when the canaries are made."""
        out = held.pop() if held else None
        at, size = (out.data_ptr(), out.numel()) if out is not None else (0, 0)
        del out
        for _ in range(CANARIES_PER_CALL):
            t = torch.full((size,), CANARY, dtype=torch.uint8, device=device)
            landed[0] += 1
            landed[1] += bool(size) and t.data_ptr() < at + size and at < t.data_ptr() + size
            canaries.append((c, t))

    def wait_all(works):
        """Waits for every work, even after one raised (a batch's works end together); raises the first error."""
        first = None
        for w in works:
            try:
                w.wait()
            except Exception as e:  # noqa: BLE001
                first = first or e
        _sync(device)
        if first is not None:
            raise first

    def settle(entry):
        """Waits for one call, entry [call, works, output, expected, description] (emptied here); checks its bytes,
        or where it raised puts canaries where its output was."""
        try:
            wait_all(entry[1])
            error = None
        except Exception as e:  # noqa: BLE001
            error = _first_line(e)
        if error is not None:
            # Out of the except block: its traceback holds the waited works, which hold the output.
            outcomes.append(error)
            c, held = entry[0], [entry[2]]
            entry.clear()
            place_canaries(c, held)
            return
        c, works, out, expected, what = entry
        entry.clear()
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
            settle(pending.pop(0))

    def timed(start):
        """Runs a synchronous call, or issues one and waits for its works: (seconds, None or the whole error)."""
        t0 = time.monotonic()
        try:
            works = start()
            wait_all(works or [])
            return time.monotonic() - t0, None
        except Exception as e:  # noqa: BLE001
            return time.monotonic() - t0, _full_error(e)

    def record(c, what, out, expected, dt, err, must_raise=False, limit_s=timeout_s + SLACK_S, fails_later=False):
        """The fault's call on this rank: its outcome, its bytes where it returned, canaries where it raised.
        `fails_later`: a GPU call whose failure may be found after it returned (a peer's post read by the watchdog,
        a timeout): under TORCH_SDMA_ASYNC_ERROR_HANDLING=0 its output is undefined and the group's next call says
        so, so there it may return with wrong bytes, or without the error `must_raise` wants, if a later call raises."""
        fault_result.update(what=what, seconds=round(dt, 2), error=err)
        later = fails_later and device.type == "cuda"
        if err is None:
            outcomes.append("ok")
            if must_raise:
                found = f"{what}: returned without error"
                if later:
                    suspects.append((c, len(outcomes), found))
                else:
                    violations.append(found)
            if expected is not None:
                fault_result["exact"] = torch.equal(out.cpu(), expected.cpu())
                check(out, expected, what, call=c if later else None)
            # Returned, failed or not: nothing may write into its output from now on (a late peer's copies above
            # all, once a timeout released this rank).
            out.fill_(CANARY)
            done_outputs.append((c, out))
            return
        outcomes.append(err.splitlines()[0][:300])
        if dt > limit_s:
            violations.append(f"{what}: the error came after {dt:.1f} s (the group's timeout is {timeout_s} s): "
                              f"{err[:300]}")
        place_canaries(c, [out])

    def exchange_fault(c, spec):
        """The call `c` that the fault of EXCHANGE_FAULTS replaces, on both ranks."""
        import torch.distributed as dist

        nonlocal fault_index
        fault_index = len(outcomes)
        n, peer = spec["n"], 1 - me
        if kind == "p2p_size_mismatch":
            # The faulted rank sends n + 1 bytes where its peer receives n; in a batch the peer's send of n bytes
            # to it meets a matching recv, and the batch fails all the same.
            send = _data(seed, episode, c, me, n + 1 if faulted else n, device)
            got = torch.full((n,), POISON, dtype=torch.uint8, device=device)
            if fault["variant"] == "batch":
                start = lambda: list(dist.batch_isend_irecv([  # noqa: E731
                    dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, got, peer)]))
            else:
                start = (lambda: [dist.isend(send, peer)]) if faulted else (lambda: [dist.irecv(got, peer)])
            dt, err = timed(start)
            # The rank that reads the other's post raises from the call; on GPUs the other's watchdog finds it.
            record(c, f"p2p_size_mismatch ({fault['variant']}, {'sends' if faulted else 'receives'} of "
                      f"{n + 1 if faulted else n} B)", got, None, dt, err, must_raise=True, fails_later=True)
        elif kind == "send_meets_send":
            # A halo exchange posted send-first on both ranks: NCCL completes it; here it may raise, on both.
            send = _data(seed, episode, c, me, n, device)
            got = torch.full((n,), POISON, dtype=torch.uint8, device=device)
            dt, err = timed(lambda: [dist.isend(send, peer), dist.irecv(got, peer)])
            record(c, f"send_meets_send ({n} B)", got, _data(seed, episode, c, peer, n, device), dt, err)
        elif kind == "p2p_backlog":
            sizes = [random.Random(f"backlog/{seed}/{episode}/{i}").randint(1, 4096) for i in range(fault["count"])]
            sender = fault["rank"]
            if me == sender:
                bufs = [_data(seed, episode, f"{c}/{i}", me, k, device) for i, k in enumerate(sizes)]
                works = [dist.isend(b, peer) for b in bufs]
                expected = [b.clone() for b in bufs]
            else:
                time.sleep(fault["delay"] * timeout_s)
                bufs = [torch.full((k,), POISON, dtype=torch.uint8, device=device) for k in sizes]
                works = [dist.irecv(b, peer) for b in bufs]
                expected = [_data(seed, episode, f"{c}/{i}", sender, k, device) for i, k in enumerate(sizes)]
            for i, (w, b, e) in enumerate(zip(works, bufs, expected)):
                try:
                    w.wait()
                    outcomes.append("ok")
                    check(b, e, f"p2p_backlog: {'isend' if me == sender else 'irecv'} {i} of {len(sizes)}")
                except Exception as ex:  # noqa: BLE001
                    outcomes.append(_first_line(ex))
            # The group goes on after the backlog: an all-gather, bit-exact.
            try:
                check(*_gather(world, n, seed, episode, f"{c}/after", me, device), "p2p_backlog: the all-gather after")
                outcomes.append("ok")
            except Exception as ex:  # noqa: BLE001
                outcomes.append(_first_line(ex))
        elif kind == "late_sync_exchange":
            late = fault["rank"]
            op_spec = dict(spec, op=fault["op"], async_op=False)
            if faulted:
                time.sleep(timeout_s * 1.5 + 1.0)
            out, expected, start = _prepare_op(op_spec, world, seed, episode, c, me, device)
            dt, err = timed(start)
            what = f"late_sync_exchange ({fault['op']}, root {spec['root']}, {'late' if faulted else 'early'} rank)"
            if faulted:
                record(c, what, out, expected, dt, err, limit_s=SLACK_S)
                if err is not None and "refused" not in err:
                    violations.append(f"{what}: neither the right bytes nor a refusal: {err[:300]}")
            else:
                # A CPU call's failure is the call's exception (docs/api.md); a GPU call's may come later.
                record(c, what, out, expected, dt, err, must_raise=True, fails_later=True)
                # "peers that never reached it: [1]", or "waiting for group ranks [1]" at a pair's first call
                if err is not None and f"[{late}]" not in err:
                    violations.append(f"{what}: the error does not name the late rank: {err[:300]}")
        elif kind == "refused_local":
            refuser = fault["rank"]
            op_spec = dict(spec, op="all_to_all_single" if fault["op"] == "all_to_all_single" else "all_gather",
                           async_op=False, list_form=False)
            out, expected, start = _prepare_op(op_spec, world, seed, episode, c, me, device)
            what = f"refused_local ({fault['op']}, {'refusing' if faulted else 'peer'} rank)"
            if faulted:
                if fault["op"] == "all_to_all_single":
                    splits = op_spec["splits"]
                    inp = _data(seed, episode, c, me, sum(splits[me]), device)
                    bad = [splits[me][0], splits[me][1] + 1]  # sums to one more than the input holds
                    start = lambda: dist.all_to_all_single(  # noqa: E731
                        out, inp, [splits[q][me] for q in range(2)], bad)
                else:
                    inp = _data(seed, episode, c, me, n, device)
                    out = torch.full((2 * n + 1,), POISON, dtype=torch.uint8, device=device)
                    start = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
            dt, err = timed(start)
            # A GPU call returns once enqueued: the peer's may return before the refusal is posted, its output
            # undefined; the refusal then fails its group, and the next all-gather below raises naming it.
            record(c, what, out, expected, dt, err, must_raise=True, fails_later=not faulted)
            if err is not None and faulted and not err.startswith(("ValueError", "RuntimeError")):
                violations.append(f"{what}: the refusal is not the local error: {err[:300]}")
            if err is not None and not faulted and (f"group rank {refuser}" not in err or "refused" not in err):
                violations.append(f"{what}: the error does not name the refusing rank: {err[:300]}")
            # The refusing rank's next call must not pair with the peer's refused one: it raises on both ranks and
            # leaves its output as it was.
            nxt = torch.full((2 * n,), POISON, dtype=torch.uint8, device=device)
            try:
                dist.all_gather_into_tensor(nxt, _data(seed, episode, f"{c}/next", me, n, device))
                outcomes.append("ok")
                violations.append(f"{what}: the next all-gather returned without error")
            except Exception as ex:  # noqa: BLE001
                outcomes.append(_first_line(ex))
                if err is None and f"group rank {refuser}" not in str(ex):
                    violations.append(f"{what}: returned, and the next all-gather's error does not name the "
                                      f"refusing rank: {str(ex)[:300]}")
            if bool((nxt != POISON).any()):
                violations.append(f"{what}: the next all-gather, which raised, wrote {int((nxt != POISON).sum())} "
                                  f"bytes of its output")

    for c, spec in enumerate(plan):
        if c == fault["at"] and kind in ALLGATHER_FAULTS + GPU_FAULTS:
            spec = dict(spec, op="all_gather")  # these faults are an all-gather's
        n, async_op, list_form, depth = spec["n"], spec["async_op"], spec["list_form"], spec["depth"]
        if c == fault["at"] and kind in EXCHANGE_FAULTS:
            settle_pending()
            exchange_fault(c, spec)
            continue
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
        if spec["op"] == "all_gather":
            if out is None:
                out = torch.full((2 * n,), POISON, dtype=torch.uint8, device=device)
            what = (f"call {c} ({n} B a rank, {'async' if async_op else 'sync'}, "
                    f"{'list' if list_form else 'into tensor'})")
            try:
                work, out, expected = _issue(world, n, seed, episode, c, me, device, async_op, list_form, inp, out)
                error = None
            except Exception as e:  # noqa: BLE001  (a sync call's error, or a refusal)
                error = _first_line(e)
            if error is not None:
                outcomes.append(error)
                held = [out]
                del out, inp
                place_canaries(c, held)
                continue
            works = [work] if work is not None else []
        else:
            out, expected, start = _prepare_op(spec, world, seed, episode, c, me, device)
            what = f"call {c} ({spec['op']}, {n} B, {'async' if async_op else 'sync'}, root {spec['root']})"
            try:
                works, error = start(), None
            except Exception as e:  # noqa: BLE001  (a sync call's error, or a refusal)
                error = _first_line(e)
            del start  # it holds the output too
            if error is not None:
                outcomes.append(error)
                held = [out]
                del out, expected
                place_canaries(c, held)
                continue
        pending.append([c, works, out, expected, what])
        del works, out, expected
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
    if fault_index is not None:
        # After a failed call the group refuses every later call (docs/errors.md): nothing after the fault's call
        # may pair with a peer's call. A backlog is no mistake: nothing of it, or after it, may raise.
        first_after = fault_index + 1
        if kind == "p2p_backlog":
            raised = [o for o in outcomes if not o.startswith("ok")]
            if raised:
                violations.append(f"p2p_backlog: {len(raised)} calls raised, the first: {raised[0]}")
        elif kind != "send_meets_send" or fault_result.get("error") is not None:
            returned = [i for i, o in enumerate(outcomes[first_after:]) if o.startswith("ok")]
            if returned:
                violations.append(f"{kind}: {len(returned)} calls after the fault's call returned (the first "
                                  f"{returned[0] + 1} after it), though the group had failed")

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
    return {"violations": violations, "outcomes": outcomes, "canaries": landed, "fault": fault_result}


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


def run_episode(seed, episode, fault, calls=8, timeout_s=2.5, device="cpu", env=None, mix=None):
    """One episode in two fresh processes; `mix` (default: on CPU ranks) mixes point-to-point calls and exchanges
    among the all-gathers. Returns (problems, per-rank outcomes, [canaries, of them on memory a failed call's output
    gave back])."""
    if mix is None:
        mix = device == "cpu"
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
                            "device_kind": device, "mix": mix})
    problems, outcomes, landed, fault_results = [], {}, [0, 0], {}
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
        fault_results[r.rank] = r.value["fault"]
        landed = [a + b for a, b in zip(landed, r.value["canaries"])]
        problems.extend(f"rank {r.rank}: {v}" for v in r.value["violations"])
        if r.teardown_error:
            problems.append(f"rank {r.rank}: destroy_process_group raised: {r.teardown_error.splitlines()[-1]}")
    if fault["kind"] == "send_meets_send" and len(fault_results) == 2:
        # Completed on both ranks, or raised on both: one rank's exchange never ends alone.
        errors = [fault_results[q].get("error") for q in (0, 1)]
        if (errors[0] is None) != (errors[1] is None):
            problems.append(f"send_meets_send: raised on one rank only: {errors}")
    return problems, outcomes, landed


def describe(fault):
    extra = "".join(f" {k} {fault[k]}" for k in ("variant", "op", "count") if k in fault)
    return (f"{fault['kind']}{extra} on rank {fault['rank']} at call {fault['at']} "
            f"({'direct' if fault['direct'] else 'staging'}"
            f"{', all-gathers below 1 MiB on the inner backend' if fault.get('inner_allgathers') else ''})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=len(CPU_FAULTS), help="episodes, one fault each")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda where there is one")
    p.add_argument("--calls", type=int, default=8, help="calls on the faulted group per episode")
    p.add_argument("--mix", choices=("auto", "on", "off"), default="auto",
                   help="point-to-point calls and exchanges among the all-gathers (auto: on CPU ranks)")
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
    mix = None if args.mix == "auto" else args.mix == "on"
    failed = calls = rank_calls = errors = wrong = signals = hangs = 0
    t0 = time.monotonic()
    for i in range(args.faults):
        fault = fit_to_device(pick_episode(args.seed, i, faults, args.calls), args.device)
        t = time.monotonic()
        problems, outcomes, landed = run_episode(args.seed, i, fault, args.calls, args.timeout, args.device, env,
                                                 mix=mix)
        status = "FAIL" if problems else "ok"
        failed += bool(problems)
        made = {r: len(v) for r, v in outcomes.items()}
        raised = {r: sum(not o.startswith("ok") for o in v) for r, v in outcomes.items()}
        # A call of the group counts once, made by both ranks; a rank that left counts none of its own.
        calls += max(made.values(), default=0)
        rank_calls += sum(made.values())
        errors += sum(raised.values())
        wrong += sum("bytes wrong" in pr or "wrote" in pr or "was written" in pr or "right bytes" in pr
                     for pr in problems)
        signals += sum("ended by signal" in pr for pr in problems)
        hangs += sum("hung (killed by the harness" in pr for pr in problems)
        print(f"seed {args.seed} episode {i}: {describe(fault)}: {status} in {time.monotonic() - t:.1f} s "
              f"(calls per rank {made}, raised {raised}; canaries on a failed call's memory {landed[1]} of "
              f"{landed[0]})", flush=True)
        for pr in problems:
            print("    " + pr.replace("\n", "\n    "), flush=True)
    print(f"{args.faults - failed} of {args.faults} episodes ok in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"summary: seed {args.seed}, {args.faults} episodes, {failed} failed; {calls} calls on the faulted groups "
          f"({rank_calls} made by the ranks, {errors} of those raised); wrong or late-written bytes {wrong}, "
          f"signals {signals}, hangs {hangs}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
