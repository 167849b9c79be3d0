"""Exchange checks (all_to_all_single, all_to_all, broadcast, gather, scatter), shared by the CPU and CUDA tests.

Every rank rebuilds every peer's input from (case name, rank), so expected bytes never come from another backend;
outputs are poisoned first (the bitwise NOT of the expected bytes) and compared bit-exactly, inputs checked unchanged.
A call is issued (`EX.<op>`, returning an `Issued`) and settled later (`settle`): the same code makes the synchronous
calls, the async ones waited later, and many in flight interleaved with all-gathers of the same group.
"""
from __future__ import annotations

import datetime
import random
import re
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checks.data import EVERY_DTYPE, assert_bytes_equal, group_ranks, poison_, rand, raw

OPS = ("all_to_all_single", "all_to_all", "broadcast", "gather", "scatter")
COLS = 3  # elements per row of the 2-D all-to-all inputs: the splits count rows (dim 0), as torch's do
# Split matrices S[i][j] (rows group rank i sends to group rank j) that the all-to-all cases draw from.
SPLIT_KINDS = ("random", "random_with_zeros", "one_rank_sends_nothing", "all_to_one_peer", "only_to_self",
               "all_zero")
QUICK_DTYPES = (torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.complex128, torch.float8_e5m2)


def cross_process_reads():
    """Whether the CPU path may read and write a peer's memory (process_vm_readv: Yama's ptrace scope at most 1, or no
    Yama). Where it may not, the exchange ops on CPU tensors go to the inner backend with the reason."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip()) <= 1
    except (OSError, ValueError):
        return True


def split_matrix(name, W, kind, max_rows=40):
    """S[i][j], the same on every rank (drawn from the case's name only)."""
    rng = random.Random(zlib.crc32(f"splits|{name}".encode()))
    if kind == "random":
        return [[rng.randint(1, max_rows) for _ in range(W)] for _ in range(W)]
    if kind == "random_with_zeros":
        return [[0 if rng.random() < 0.35 else rng.randint(1, max_rows) for _ in range(W)] for _ in range(W)]
    if kind == "one_rank_sends_nothing":
        return [[0 if i == 0 else rng.randint(1, max_rows) for _ in range(W)] for i in range(W)]
    if kind == "all_to_one_peer":
        return [[rng.randint(1, max_rows) if j == (i + 1) % W else 0 for j in range(W)] for i in range(W)]
    if kind == "only_to_self":
        return [[rng.randint(1, max_rows) if j == i else 0 for j in range(W)] for i in range(W)]
    if kind == "all_zero":
        return [[0] * W for _ in range(W)]
    if kind.startswith("even"):  # "even:<rows>"
        k = int(kind.split(":")[1])
        return [[k] * W for _ in range(W)]
    raise ValueError(kind)


def _shape(rows, cols):
    return (rows, cols) if cols else (rows,)


@dataclass
class Issued:
    """A call on its way: its Work (None once a synchronous call returned) and what to compare once it is done."""

    what: str
    work: object
    checks: list = field(default_factory=list)  # (what, tensor, expected bytes on the CPU)


def settle(items, reverse=False):
    """Waits for every item (in reverse order of issue with `reverse`), then compares every output and input. Returns
    the failures (strings): a wrong byte never stops the waits, so the peers are never left inside a collective."""
    for it in reversed(items) if reverse else items:
        if it.work is not None:
            it.work.wait()
    bad = []
    for it in items:
        for what, t, e in it.checks:
            try:
                assert_bytes_equal(t, e, f"{it.what}: {what}")
            except AssertionError as ex:
                bad.append(str(ex))
    return bad


def check(items, reverse=False):
    bad = settle(items if isinstance(items, list) else [items], reverse)
    if bad:
        raise AssertionError(f"{len(bad)} wrong: " + "\n".join(bad[:6]))


class EX:
    """The exchange ops on group g, with inputs rebuilt from (tag/name, global rank) on every rank. Roots are given as
    group ranks and passed to torch as global ranks, as its src/dst arguments take them."""

    def __init__(self, g, dev, tag):
        self.g, self.dev, self.tag = g, dev, tag
        self.W = dist.get_world_size(g)
        self.me = dist.get_rank(g)
        self.ranks = group_ranks(g)
        self.my_global = self.ranks[self.me]
        # A list: the ops only build their tensors and queue their calls here, for run_deferred() (a profile that
        # must hold the calls alone).
        self.deferred = None
        # CUDA: spin the stream this long (cycles) before each input is written on it, so that a call not ordered
        # after the caller's stream reads the poison that stands there before.
        self.late_inputs_cycles = 0

    def _go(self, what, call, checks):
        it = Issued(what, None, checks)
        if self.deferred is not None:
            self.deferred.append((it, call))
        else:
            it.work = call()
        return it

    def run_deferred(self):
        for it, call in self.deferred or ():
            it.work = call()
        self.deferred = None

    def _rand(self, name, group_rank, shape, dtype):
        """Group rank `group_rank`'s tensor of case `name`, on the CPU."""
        return rand(f"{self.tag}/{name}", self.ranks[group_rank], shape, dtype)

    def _mine(self, name, shape, dtype):
        """This rank's input on its device, and its bytes to check it unchanged after the call."""
        t = self._rand(name, self.me, shape, dtype)
        x = t.to(self.dev, copy=True)
        if self.late_inputs_cycles:
            src, x = x, self._poisoned(shape, dtype, raw(t))
            torch.cuda._sleep(self.late_inputs_cycles)
            x.copy_(src)
        return x, raw(t)

    def _poisoned(self, shape, dtype, expected_bytes):
        return poison_(torch.empty(shape, dtype=dtype, device=self.dev), expected_bytes)

    # -------------------------------------------------------------------------------------------- the ops
    def all_to_all_single(self, name, dtype, S, cols=COLS, async_op=False, splits="both"):
        """S: rows each group rank sends to each. splits: "both" (output and input split sizes given), "none" (even:
        torch splits dim 0 in W equal parts), "input_even" or "output_even" (that side's sizes left to torch)."""
        W, me = self.W, self.me
        ins = [self._rand(name, i, _shape(sum(S[i]), cols), dtype) for i in range(W)]
        # the rows rank i sends to me come after those it sends to the ranks before me
        exp = torch.cat([raw(ins[i].narrow(0, sum(S[i][:me]), S[i][me])) for i in range(W)])
        out = self._poisoned(_shape(sum(S[i][me] for i in range(W)), cols), dtype, exp)
        x = self._mine(name, _shape(sum(S[me]), cols), dtype)[0]
        kw = {}
        if splits in ("both", "input_even"):
            kw["output_split_sizes"] = [S[i][me] for i in range(W)]
        if splits in ("both", "output_even"):
            kw["input_split_sizes"] = list(S[me])
        return self._go(f"all_to_all_single {name} ({dtype}, splits {splits})",
                        lambda: dist.all_to_all_single(out, x, group=self.g, async_op=async_op, **kw),
                        [("output", out, exp), ("input", x, raw(ins[me]))])

    def all_to_all(self, name, dtype, S, cols=COLS, async_op=False):
        W, me = self.W, self.me
        ins = [self._mine(f"{name}/to{j}", _shape(S[me][j], cols), dtype) for j in range(W)]
        exps = [raw(self._rand(f"{name}/to{me}", i, _shape(S[i][me], cols), dtype)) for i in range(W)]
        outs = [self._poisoned(_shape(S[i][me], cols), dtype, exps[i]) for i in range(W)]
        checks = [(f"output[{i}]", outs[i], exps[i]) for i in range(W)]
        checks += [(f"input[{j}]", x, b) for j, (x, b) in enumerate(ins)]
        return self._go(f"all_to_all {name} ({dtype})",
                        lambda: dist.all_to_all(outs, [x for x, _ in ins], group=self.g, async_op=async_op), checks)

    def broadcast(self, name, dtype, root, shape, async_op=False):
        exp = raw(self._rand(name, root, shape, dtype))
        t = self._mine(name, shape, dtype)[0] if self.me == root else self._poisoned(shape, dtype, exp)
        return self._go(f"broadcast {name} ({dtype}, root {root})",
                        lambda: dist.broadcast(t, src=self.ranks[root], group=self.g, async_op=async_op),
                        [("tensor", t, exp)])

    def gather(self, name, dtype, root, shape, async_op=False):
        x, xb = self._mine(name, shape, dtype)
        checks = [("input", x, xb)]
        gl = None
        if self.me == root:
            exps = [raw(self._rand(name, i, shape, dtype)) for i in range(self.W)]
            gl = [self._poisoned(shape, dtype, e) for e in exps]
            checks += [(f"gather_list[{i}]", o, e) for i, (o, e) in enumerate(zip(gl, exps))]
        return self._go(f"gather {name} ({dtype}, dst {root})",
                        lambda: dist.gather(x, gl, dst=self.ranks[root], group=self.g, async_op=async_op), checks)

    def scatter(self, name, dtype, root, shape, async_op=False):
        exp = raw(self._rand(f"{name}/to{self.me}", root, shape, dtype))
        out = self._poisoned(shape, dtype, exp)
        checks = [("output", out, exp)]
        sl = None
        if self.me == root:
            ins = [self._mine(f"{name}/to{j}", shape, dtype) for j in range(self.W)]
            sl = [x for x, _ in ins]
            checks += [(f"scatter_list[{j}]", x, b) for j, (x, b) in enumerate(ins)]
        return self._go(f"scatter {name} ({dtype}, src {root})",
                        lambda: dist.scatter(out, sl, src=self.ranks[root], group=self.g, async_op=async_op), checks)

    def all_gather(self, name, dtype, n, async_op=False):
        x, xb = self._mine(name, (n,), dtype)
        exp = torch.cat([raw(self._rand(name, i, (n,), dtype)) for i in range(self.W)])
        out = self._poisoned((self.W * n,), dtype, exp)
        return self._go(f"all_gather_into_tensor {name} ({dtype})",
                        lambda: dist.all_gather_into_tensor(out, x, group=self.g, async_op=async_op),
                        [("output", out, exp), ("input", x, xb)])

    def any_op(self, op, name, dtype, k, async_op=False, n=257):
        """One call of `op` whose splits or root and size vary with k (for the dtype sweeps and the mixes)."""
        if op == "all_to_all_single":
            kind = SPLIT_KINDS[k % len(SPLIT_KINDS)]
            return self.all_to_all_single(name, dtype, split_matrix(name, self.W, kind), async_op=async_op)
        if op == "all_to_all_single_even":
            return self.all_to_all_single(name, dtype, split_matrix(name, self.W, f"even:{1 + k % 5}"), cols=None,
                                          async_op=async_op, splits="none")
        if op == "all_to_all":
            kind = SPLIT_KINDS[k % len(SPLIT_KINDS)]
            return self.all_to_all(name, dtype, split_matrix(name, self.W, kind), async_op=async_op)
        if op == "all_gather":
            return self.all_gather(name, dtype, n + k, async_op=async_op)
        return getattr(self, op)(name, dtype, k % self.W, (n + k,), async_op=async_op)


# ------------------------------------------------------------------------------------------------ the cases
def exchange_cases(g, dev, tag, *, dtypes=EVERY_DTYPE, big=True, quick=False):
    """Every op, sync and async, every root, uneven splits with zeros, every dtype, many in flight among all-gathers."""
    ex = EX(g, dev, tag)
    W = ex.W
    if quick:
        dtypes = [d for d in dtypes if d in QUICK_DTYPES]
    cases = []

    def add(name, fn):
        cases.append((f"{tag}/{name}", fn))

    u8, f32 = torch.uint8, torch.float32
    # all_to_all_single, even (no split sizes) then uneven
    for k in (1, 3, 4097):
        add(f"a2a_single_even_rows={k}", lambda k=k: check(
            ex.all_to_all_single(f"ase{k}", u8, split_matrix("", W, f"even:{k}"), cols=None, splits="none")))
    add("a2a_single_even_2d", lambda: check(
        ex.all_to_all_single("ase2d", f32, split_matrix("", W, "even:7"), splits="none")))
    add("a2a_single_even_zero_elements", lambda: check(
        ex.all_to_all_single("ase0", f32, split_matrix("", W, "even:0"), splits="none")))
    for kind in SPLIT_KINDS:
        add(f"a2a_single_uneven[{kind}]", lambda kind=kind: check(
            ex.all_to_all_single(f"asu{kind}", f32, split_matrix(f"asu{kind}", W, kind))))
    if not quick:
        constant_rows_per_sender = [[3 + i] * W for i in range(W)]
        constant_rows_per_receiver = [[2 + j for j in range(W)] for _ in range(W)]
        add("a2a_single_one_side_even", lambda: check([
            ex.all_to_all_single("aso1", u8, constant_rows_per_sender, splits="input_even"),
            ex.all_to_all_single("aso2", u8, constant_rows_per_receiver, splits="output_even")]))
    if big:
        add("a2a_single_uneven_large", lambda: check(
            ex.all_to_all_single("asl", u8, split_matrix("asl", W, "random_with_zeros", max_rows=1 << 19), cols=1)))
    # all_to_all (lists)
    for kind in SPLIT_KINDS:
        add(f"a2a_list[{kind}]", lambda kind=kind: check(
            ex.all_to_all(f"al{kind}", f32, split_matrix(f"al{kind}", W, kind))))
    sizes = (0, 1, 4097) if quick else (0, 1, 7, 4097, 65537)
    if big and not quick:
        sizes += ((1 << 20) + 3,)
    # broadcast, gather, scatter: every root, several sizes
    for op in ("broadcast", "gather", "scatter"):
        for root in range(W):
            add(f"{op}_root={root}", lambda op=op, root=root: check(
                [getattr(ex, op)(f"{op}{root}_{n}", u8, root, (n,)) for n in sizes]
                + [getattr(ex, op)(f"{op}{root}_2d", f32, root, (5, 11))]))
    # every dtype, sync then all in flight at once
    for op in OPS:
        add(f"dtypes_sync[{op}]", lambda op=op: _dtype_sweep(ex, op, dtypes, async_op=False))
        add(f"dtypes_async[{op}]", lambda op=op: _dtype_sweep(ex, op, dtypes, async_op=True))
    # async: several of one op in flight, a synchronous all-gather while they are, waited later in reverse order
    for op in OPS:
        def wait_later(op=op):
            items = [ex.any_op(op, f"wl{op}{k}", f32, k, async_op=True) for k in range(max(3, W + 1))]
            items.append(ex.all_gather(f"wl{op}ag", f32, 1001))
            check(items, reverse=True)

        add(f"async_wait_later[{op}]", wait_later)
    # every op and all-gathers in flight together, then sync calls among async ones
    mix = ("all_to_all_single", "all_gather", "all_to_all", "broadcast", "all_to_all_single_even", "gather",
           "all_gather", "scatter")
    rounds = 2 if quick else 4
    add("in_flight_with_all_gathers", lambda: check(
        [ex.any_op(op, f"if{r}{op}{i}", (f32, u8, torch.bfloat16)[(r + i) % 3], r + i, async_op=True)
         for r in range(rounds) for i, op in enumerate(mix)]))
    add("sync_among_async", lambda: check(
        [ex.any_op(op, f"sa{r}{op}{i}", f32, r + i, async_op=(r + i) % 2 == 0)
         for r in range(rounds) for i, op in enumerate(mix)], reverse=True))
    return cases


def _dtype_sweep(ex, op, dtypes, async_op):
    """One call of op per dtype (the roots and splits turning with it). A call that raises is recorded and the sweep
    goes on: the list of every dtype that failed is the report."""
    items, bad = [], []
    for k, dt in enumerate(dtypes):
        try:
            it = ex.any_op(op, f"dt{op}{async_op}{dt}", dt, k, async_op=async_op, n=129)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{dt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if async_op:
            items.append(it)
        else:
            bad += settle([it])
    bad += settle(items)
    if bad:
        raise AssertionError(f"{op}, {len(bad)} failure(s) over {len(dtypes)} dtypes:\n" + "\n".join(bad))


def stats_cases(dev, tag, device_name, dma_expected=True):
    """On a fresh group (made and destroyed in the case), with TORCH_SDMA_MIN_BYTES=0: group_path(op=...) says
    "unknown" before an op's first call and "dma:direct" after it; stats() counts each op's calls under
    "<op>:dma:direct" and none on the inner backend. Where the DMA route cannot run (dma_expected=False: the CPU path
    without process_vm_readv between the ranks), every op is counted on "<op>:inner:<reason>" instead."""
    import torch_sdma

    def fn():
        g = dist.new_group()
        try:
            ex = EX(g, dev, tag + "/stats")
            for op in OPS:
                p = torch_sdma.group_path(g, device=device_name, op=op)
                assert p == "unknown", f"group_path(op={op!r}) before its first call: {p!r}"
            made = {"all_to_all_single": 0, "all_to_all": 0, "broadcast": 0, "gather": 0, "scatter": 0}
            items = []
            for k in range(2):
                for op in ("all_to_all_single", "all_to_all_single_even", "all_to_all", "broadcast", "gather",
                           "scatter", "all_gather"):
                    items.append(ex.any_op(op, f"st{op}{k}", torch.float32, k + 1, async_op=k == 1))
                    key = "all_to_all_single" if op == "all_to_all_single_even" else op
                    if key in made:
                        made[key] += 1
            check(items)
            s = torch_sdma.stats(g)
            problems = []
            for op, n in made.items():
                mine = {k: v for k, v in s.items() if k.startswith(op + ":")}
                if dma_expected:
                    got = mine.get(f"{op}:dma:direct", {}).get("calls")
                    if got != n:
                        problems.append(f"{op}: {got} calls on '{op}:dma:direct', expected {n}")
                    elif "bytes" not in mine[f"{op}:dma:direct"]:
                        problems.append(f"{op}: no bytes field: {mine}")
                    if len(mine) != 1:
                        problems.append(f"{op}: calls on other paths: {sorted(mine)}")
                    want = "dma:direct"
                else:
                    if sum(v["calls"] for k, v in mine.items() if k.startswith(op + ":inner:")) != n:
                        problems.append(f"{op}: expected {n} calls on '{op}:inner:<reason>': {mine}")
                    want = "inner:"
                p = torch_sdma.group_path(g, device=device_name, op=op)
                if not p.startswith(want):
                    problems.append(f"group_path(op={op!r}) = {p!r}, expected {want!r}")
            ag = torch_sdma.group_path(g, device=device_name)
            if ag != "dma":
                problems.append(f"the all-gathers' group_path is {ag!r} now, expected 'dma'")
            assert not problems, "\n".join(problems) + f"\nstats: {s}"
        finally:
            dist.destroy_process_group(g)

    return [(f"{tag}/stats_and_group_path", fn)]


# ------------------------------------------------------------------------------------------------ mistakes
# A mistake across ranks: rank 1 calls otherwise than the others. Each is locally valid input (torch and the
# backend's local checks pass on every rank): only the ranks' calls taken together disagree.
MISTAKES = {
    "a2a_single_splits_disagree": "all_to_all_single",  # rank 1 expects one more row from rank 0 than rank 0 sends
    "a2a_list_sizes_disagree": "all_to_all",  # the same with the list form
    "broadcast_src_differs": "broadcast",  # rank 1 names itself the root, the others rank 0
    "broadcast_sizes_differ": "broadcast",  # rank 1's tensor is one element longer
    "gather_dst_differs": "gather",  # rank 1 names itself the destination, the others rank 0
    "scatter_sizes_differ": "scatter",  # rank 1's output is one element longer than what rank 0 scatters
}


def issue_mistake(kind, g, dev):
    """Issues mistake `kind` on group g (async). Returns the Work (or the exception the call itself raised) and the
    tensors to keep alive until it ends."""
    W, me = dist.get_world_size(g), dist.get_rank(g)
    ranks = group_ranks(g)
    odd = me == 1
    n, cols = 64, COLS

    def t(*shape):
        return torch.zeros(shape, dtype=torch.float32, device=dev)

    if kind in ("a2a_single_splits_disagree", "a2a_list_sizes_disagree"):
        S = split_matrix(kind, W, "random")
        recv = [S[i][me] + (1 if odd and i == 0 else 0) for i in range(W)]
        if kind == "a2a_single_splits_disagree":
            out, x = t(sum(recv), cols), t(sum(S[me]), cols)
            keep = (out, x)
            call = lambda: dist.all_to_all_single(out, x, recv, list(S[me]), group=g, async_op=True)  # noqa: E731
        else:
            outs, ins = [t(r, cols) for r in recv], [t(s, cols) for s in S[me]]
            keep = (outs, ins)
            call = lambda: dist.all_to_all(outs, ins, group=g, async_op=True)  # noqa: E731
    elif kind == "broadcast_src_differs":
        x = t(n)
        keep = (x,)
        call = lambda: dist.broadcast(x, src=ranks[1 if odd else 0], group=g, async_op=True)  # noqa: E731
    elif kind == "broadcast_sizes_differ":
        x = t(n + odd)
        keep = (x,)
        call = lambda: dist.broadcast(x, src=ranks[0], group=g, async_op=True)  # noqa: E731
    elif kind == "gather_dst_differs":
        dst = 1 if odd else 0
        x = t(n)
        gl = [t(n) for _ in range(W)] if me == dst else None
        keep = (x, gl)
        call = lambda: dist.gather(x, gl, dst=ranks[dst], group=g, async_op=True)  # noqa: E731
    elif kind == "scatter_sizes_differ":
        out = t(n + odd)
        sl = [t(n) for _ in range(W)] if me == 0 else None
        keep = (out, sl)
        call = lambda: dist.scatter(out, sl, src=ranks[0], group=g, async_op=True)  # noqa: E731
    else:
        raise ValueError(kind)
    try:
        return call(), keep
    except Exception as e:  # noqa: BLE001
        return e, keep


def run_mistakes(ctx, dev, timeout_s, slack_s, kinds=tuple(MISTAKES)):
    """Every mistake at once, each on a group of its own (timeout `timeout_s`), from a store barrier on. Returns per
    kind: the error (type and message) and where it came (the call, its wait, or the group's next call), the seconds
    it took; then whether the world group still exchanges bit-exact and whether the failed groups were destroyed."""
    groups = {k: dist.new_group(timeout=datetime.timedelta(seconds=timeout_s)) for k in kinds}
    ctx.barrier_store("mistakes")
    t0 = time.monotonic()
    state = {k: issue_mistake(k, groups[k], dev) for k in kinds}
    out = {}
    deadline = t0 + timeout_s + slack_s
    pending = set(kinds)
    while pending:
        for k in sorted(pending):
            w = state[k][0]
            if isinstance(w, Exception):
                out[k] = _outcome(w, "call", t0)
            elif w is None or w.is_completed():
                try:
                    if w is not None:
                        w.wait()
                    out[k] = _outcome(None, "wait", t0)
                except Exception as e:  # noqa: BLE001
                    out[k] = _outcome(e, "wait", t0)
            else:
                continue
            pending.discard(k)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for k in pending:
        out[k] = {"error": None, "type": None, "where": "still running", "elapsed": time.monotonic() - t0}
    for k, v in out.items():
        if v["error"] is None and v["where"] == "wait":  # no error from the call: the group's next call must say it
            try:
                x = torch.ones(4, device=dev)
                dist.all_gather_into_tensor(torch.empty(4 * dist.get_world_size(groups[k]), device=dev), x,
                                            group=groups[k])
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                v["where"] = "wait; the next call passed too"
            except Exception as e:  # noqa: BLE001
                out[k] = dict(_outcome(e, "next call", t0))
    # the world group is untouched
    ex = EX(dist.group.WORLD, dev, "after_mistakes")
    try:
        check([ex.broadcast("b", torch.float32, 0, (1000,)), ex.all_gather("ag", torch.float32, 1000),
               ex.all_to_all_single("a", torch.float32, split_matrix("a", ex.W, "random_with_zeros"))])
        world_ok = None
    except Exception as e:  # noqa: BLE001
        world_ok = f"{type(e).__name__}: {e}"

    def destroy():
        for g in groups.values():
            dist.destroy_process_group(g)
        destroyed.append(True)

    destroyed = []
    th = threading.Thread(target=destroy, daemon=True)
    th.start()
    th.join(timeout_s + slack_s)
    state.clear()
    return {"mistakes": out, "world_after": world_ok, "destroyed": bool(destroyed)}


def _outcome(e, where, t0):
    return {"error": None if e is None else str(e), "type": None if e is None else type(e).__name__,
            "is_dist_backend_error": isinstance(e, dist.DistBackendError), "where": where,
            "elapsed": round(time.monotonic() - t0, 2)}


def mistake_problems(values, timeout_s, slack_s):
    """What is wrong in every rank's run_mistakes(): each mistake must raise DistBackendError on every rank, naming the
    op, within the group's timeout (plus slack); the world group goes on; the failed groups are destroyed."""
    problems = []
    for rank, v in enumerate(values):
        if v is None:
            problems.append(f"rank {rank}: no result")
            continue
        for kind, o in sorted(v["mistakes"].items()):
            op = MISTAKES[kind]
            head = f"rank {rank}, {kind}"
            if o["error"] is None:
                problems.append(f"{head}: no error ({o['where']}, {o['elapsed']} s)")
                continue
            if not o["is_dist_backend_error"]:
                problems.append(f"{head}: {o['type']}, not DistBackendError: {o['error'][:300]}")
            if not re.search(rf"(?<![A-Za-z_]){op}(?![A-Za-z_])", o["error"]):
                problems.append(f"{head}: the message does not name {op}: {o['error'][:300]}")
            if o["elapsed"] > timeout_s + slack_s:
                problems.append(f"{head}: raised after {o['elapsed']} s, the group's timeout is {timeout_s} s")
        if v["world_after"] is not None:
            problems.append(f"rank {rank}: the world group failed after the mistakes: {v['world_after'][:300]}")
        if not v["destroyed"]:
            problems.append(f"rank {rank}: destroy_process_group of the failed groups did not return")
    return problems


def mistakes_summary(values):
    lines = []
    for rank, v in enumerate(values):
        for kind, o in sorted((v or {}).get("mistakes", {}).items()):
            msg = (o["error"] or "").splitlines()[0][:160] if o["error"] else "-"
            lines.append(f"rank {rank} {kind}: {o['type']} via {o['where']} in {o['elapsed']} s: {msg}")
    return "\n".join(lines)



# ------------------------------------------------------------------------------------------------ bad input
def bad_input_cases(g, dev, tag):
    """Local bad input made alike on every rank (so that no peer waits for a call that never comes): the call itself
    raises ValueError or RuntimeError on every rank, sync or async, before anything moves (the outputs keep their
    poison), and the group's next calls are bit-exact."""
    ex = EX(g, dev, tag + "/bad")
    W, root = ex.W, ex.ranks[0]

    def t(*shape):
        return poison_(torch.empty(shape, device=dev))

    bad = {  # name: (the outputs, the call)
        "a2a_single_input_splits_not_summing_to_dim0": lambda o, a: dist.all_to_all_single(
            o, t(4 * W), [4] * W, [4] * (W - 1) + [5], group=g, async_op=a),
        "a2a_single_output_splits_not_summing_to_dim0": lambda o, a: dist.all_to_all_single(
            o, t(4 * W), [4] * (W - 1) + [3], [4] * W, group=g, async_op=a),
        "a2a_single_split_lists_one_too_long": lambda o, a: dist.all_to_all_single(
            o, t(4 * W), [4] * W + [0], [4] * W + [0], group=g, async_op=a),
        "a2a_single_even_dim0_not_divisible": lambda o, a: dist.all_to_all_single(
            t(4 * W + 1), t(4 * W + 1), group=g, async_op=a),
        "a2a_single_input_not_contiguous": lambda o, a: dist.all_to_all_single(
            o, t(4 * W, 2)[:, 0], group=g, async_op=a),
        "a2a_list_one_too_long": lambda o, a: dist.all_to_all(
            [o.narrow(0, 0, 4)] * (W + 1), [t(4) for _ in range(W + 1)], group=g, async_op=a),
        "broadcast_not_contiguous": lambda o, a: dist.broadcast(
            o.view(2 * W, 2)[:, 0], src=root, group=g, async_op=a),
    }
    cases = []
    for name, call in bad.items():
        def fn(call=call, name=name):
            problems = []
            for async_op in (False, True):
                out = t(4 * W)
                try:
                    call(out, async_op)
                except (ValueError, RuntimeError) as e:
                    if not str(e).strip():
                        problems.append(f"async_op={async_op}: {type(e).__name__} without a message")
                except Exception as e:  # noqa: BLE001
                    problems.append(f"async_op={async_op}: {type(e).__name__}, not ValueError/RuntimeError: {e}")
                else:
                    problems.append(f"async_op={async_op}: the call raised nothing")
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if not bool((raw(out) == 0xA5).all()):
                    problems.append(f"async_op={async_op}: bytes moved into the output")
            # the group goes on: the next calls are bit-exact
            problems += settle([ex.all_to_all_single(f"after_{name}", torch.float32,
                                                     split_matrix(name, W, "random_with_zeros")),
                                ex.broadcast(f"after_{name}b", torch.float32, W - 1, (100,))])
            assert not problems, "\n".join(problems)

        cases.append((f"{tag}/bad_input/{name}", fn))
    return cases
