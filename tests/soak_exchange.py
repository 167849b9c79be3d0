"""A randomized soak of the exchange collectives among all-gathers: all_to_all_single (even, and uneven with zero
splits), all_to_all lists, broadcast, gather and scatter with random roots, all_gather_into_tensor between them,
point-to-point between them (a send/recv of one pair, the rest of the group idle, and a batch_isend_irecv ring over
the group), sync and async at a random depth, on the current
stream or a side one (GPU), on two groups; every output checked bit-exact against bytes every rank rebuilds locally
from (seed, call index, rank).

Under torchrun (GPU when there is one, else CPU):
    torchrun --nproc_per_node 2 tests/soak_exchange.py --calls 100000 --seed 7
    SDMA_TEST_SHARE_GPU=1 torchrun --nproc_per_node 2 tests/soak_exchange.py ...   (two ranks on one GPU)
    torchrun --nproc_per_node 3 tests/soak_exchange.py --device cpu --calls 20000
From a test: run_soak(SoakOptions(...), device) inside an initialised process group (tests/test_soak_exchange_cpu.py).

It shares the all-gather soak's machinery (soak_allgather.py): every rank draws the same schedule from the seed, rank
0 decides the time-limit stop, a failure names the seed, the call's index and its description (exit status 1), and at
the end descriptors and peer mappings must be back where they were after the warm-up. Success prints one line: calls,
calls per form, bytes, seconds.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import warnings
from dataclasses import dataclass

import soak_allgather
import torch
import torch.distributed as dist
from soak_allgather import (
    SIDE_STREAMS,
    Event,
    Issued,
    Soak,
    _bytes,
    _env,
    _payload,
    _poisoned_like,
    run_rank,
)

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")

# Forms, in the order their counts are printed.
FORMS = ("all_to_all_single", "all_to_all_single_uneven", "all_to_all", "broadcast", "gather", "scatter",
         "all_gather", "send_recv", "p2p_ring")
# The ops move bytes: any bit pattern of any dtype must arrive as it left (NaN payloads, fp8, unsigned wide ints).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64, torch.float64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32)
GROUPS = 2  # the world, and one more: the same members with two ranks, else a random subset of at least two


@dataclass
class SoakOptions:
    seed: int = 1
    calls: int = 100_000
    time_limit_s: float = 0.0  # 0: no time limit
    max_bytes: int = 16 << 20  # per rank and call
    max_depth: int = 8  # async calls in flight, at most
    stop_every: int = 64  # calls between the ranks' agreement on stopping
    forms: tuple = FORMS
    dtypes: tuple = DTYPES
    pg_timeout_s: float = 120.0  # every group's, so that a wait that never ends is an error within it
    verbose: bool = False

    @staticmethod
    def parse(argv=None):
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--seed", type=int, default=_env("SOAK_SEED", 1, int), help="schedule and data (SOAK_SEED)")
        p.add_argument("--calls", type=int, default=_env("SOAK_CALLS", 100_000, int), help="SOAK_CALLS")
        p.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get("SOAK_DEVICE"),
                       help="the tensors' device (SOAK_DEVICE; default cuda where there is a GPU)")
        p.add_argument("--time-limit-s", type=float, default=_env("SOAK_TIME_LIMIT_S", 0.0, float),
                       help="stop after this long, 0 for none (SOAK_TIME_LIMIT_S)")
        p.add_argument("--max-bytes", type=int, default=_env("SOAK_MAX_BYTES", 0, int),
                       help="largest input per rank and call (SOAK_MAX_BYTES; 16 MiB on GPUs, 1 MiB on CPU)")
        p.add_argument("--max-depth", type=int, default=_env("SOAK_MAX_DEPTH", 8, int),
                       help="async calls in flight, at most (SOAK_MAX_DEPTH)")
        p.add_argument("--stop-every", type=int, default=_env("SOAK_STOP_EVERY", 64, int),
                       help="calls between the ranks' agreement on stopping (SOAK_STOP_EVERY)")
        p.add_argument("--forms", default=_env("SOAK_FORMS", ",".join(FORMS), str),
                       help="comma-separated subset of " + ",".join(FORMS) + " (SOAK_FORMS)")
        p.add_argument("--dtypes", default=_env("SOAK_DTYPES", "", str),
                       help="comma-separated dtype names, e.g. float32,uint8 (SOAK_DTYPES; default: a wide mix)")
        p.add_argument("--backend", default=os.environ.get("SOAK_BACKEND"),
                       help="init_process_group's backend (default: cpu:gloo,cuda:sdma on GPUs, sdma on CPU)")
        p.add_argument("--pg-timeout-s", type=float, default=_env("SOAK_PG_TIMEOUT_S", 120.0, float))
        p.add_argument("--verbose", action="store_true")
        a = p.parse_args(argv)
        if a.device is None:
            a.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        forms = tuple(f for f in a.forms.split(",") if f)
        unknown = set(forms) - set(FORMS)
        if unknown or not forms:
            p.error(f"unknown forms {sorted(unknown)}" if unknown else "no form")
        dtypes = DTYPES
        if a.dtypes:
            try:
                dtypes = tuple(getattr(torch, n) for n in a.dtypes.split(",") if n)
            except AttributeError as e:
                p.error(f"unknown dtype: {e}")
            if not dtypes or not all(isinstance(d, torch.dtype) for d in dtypes):
                p.error(f"not dtypes: {a.dtypes}")
        max_bytes = a.max_bytes or ((16 << 20) if a.device == "cuda" else (1 << 20))
        opts = SoakOptions(seed=a.seed, calls=a.calls, time_limit_s=a.time_limit_s, max_bytes=max_bytes,
                           max_depth=a.max_depth, stop_every=max(1, a.stop_every), forms=forms, dtypes=dtypes,
                           pg_timeout_s=a.pg_timeout_s, verbose=a.verbose)
        return opts, a


# ------------------------------------------------------------------------------------------------ the schedule
@dataclass
class Call:
    """One drawn call: everything the ranks agree on, from the seed alone."""

    index: int
    group: int  # slot in the soak's groups
    form: str
    async_op: bool
    stream: int  # 0: the current stream, 1..SIDE_STREAMS: a side stream (GPU only)
    dtype: torch.dtype
    root: int = 0  # group rank: broadcast's and scatter's src, gather's dst
    numel: int = 0  # per rank: broadcast, gather, scatter, all_gather
    cols: int = 1  # elements per row of the all-to-all inputs
    splits: list = None  # all-to-all: rows group rank i sends to group rank j

    def describe(self, ranks):
        dt = str(self.dtype).replace("torch.", "")
        es = torch.empty((), dtype=self.dtype).element_size()
        if self.splits is not None:
            what = f"{dt} rows of {self.cols} ({self.cols * es} B), splits {self.splits}"
        else:
            what = f"{dt}x{self.numel} ({self.numel * es} B/rank), root {self.root}"
        return (f"call {self.index}: {self.form} on group {self.group} {ranks} "
                f"{'async' if self.async_op else 'sync'} stream {self.stream}: {what}")


def _count(rng, cap, unit):
    """Units for a log-uniform byte count in [unit, cap], or 0 now and then."""
    if rng.random() < 0.05 or cap < unit:
        return 0
    return max(1, int(math.exp(rng.uniform(0.0, math.log(cap)))) // unit)


class Schedule:
    def __init__(self, seed, opts, group_sizes):
        self.rng = random.Random(seed)
        self.opts = opts
        self.forms = list(opts.forms)
        self.group_sizes = group_sizes

    def event(self):
        rng = self.rng
        e = Event()
        if rng.random() < 1 / 200:
            e.empty_cache = True
        if rng.random() < 1 / 150:
            e.remake_group = 1
        if rng.random() < 1 / 50:
            e.depth = rng.randint(0, self.opts.max_depth)
        return e

    def call(self, index):
        rng = self.rng
        group = rng.randrange(len(self.group_sizes))
        W = self.group_sizes[group]
        form = rng.choice(self.forms)
        c = Call(index, group, form, rng.random() < 0.6, rng.randrange(SIDE_STREAMS + 1), rng.choice(self.opts.dtypes))
        es = torch.empty((), dtype=c.dtype).element_size()
        cap = self.opts.max_bytes
        c.root = rng.randrange(W)
        if form.startswith("all_to_all"):
            c.cols = rng.choice((1, 1, 3, 8))
            row = c.cols * es
            if form == "all_to_all_single":  # even: the same rows to every peer
                k = _count(rng, cap // W, row)
                c.splits = [[k] * W for _ in range(W)]
            else:
                zeros = rng.choice((0.0, 0.25, 0.6))
                c.splits = [[0 if rng.random() < zeros else _count(rng, cap // W, row) for _ in range(W)]
                            for _ in range(W)]
        else:
            per_rank = cap // W if form in ("gather", "scatter", "all_gather", "p2p_ring") else cap
            c.numel = _count(rng, per_rank, es)
        return c


# ------------------------------------------------------------------------------------------------ the soak
class _AllOf:
    """The works of one batch_isend_irecv, waited on as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args):
        for w in self.works:
            w.wait(*args)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


class ExchangeSoak(Soak):
    """The all-gather soak's waits, checks, events, stop and resource checks, over the exchange forms' calls."""

    def __init__(self, opts, device, ctrl):
        self.opts = opts
        self.device = device
        self.ctrl = ctrl
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.cuda = device.type == "cuda"
        self.streams = [torch.cuda.current_stream(device)] + [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)] \
            if self.cuda else [None]
        rng = random.Random(opts.seed ^ 0x5A5A)
        every = list(range(self.world))
        second = sorted(rng.sample(every, max(2, self.world - 1))) if self.world > 2 else every
        self.members = [every, second][:GROUPS]
        self.groups = [dist.group.WORLD] + [self._new_group(m) for m in self.members[1:]]
        self.pending = []
        self.depth = min(2, opts.max_depth)
        self.per_form = {}
        self.bytes = 0
        self.remade = 0

    def issue(self, call):
        g = self.groups[call.group]
        members = self.members[call.group]
        me = members.index(self.rank)
        W = len(members)
        dev, seed, i, dt = self.device, self.opts.seed, call.index, call.dtype
        item = Issued(call, None)
        form, a = call.form, call.async_op

        def payload(rank_in_group, k, numel):
            return _payload(seed, i, members[rank_in_group], k, numel, dt, dev)

        with self._ctx(call):
            if form in ("all_to_all_single", "all_to_all_single_uneven"):
                S, cols = call.splits, call.cols
                ins = [payload(r, 0, sum(S[r]) * cols).view(-1, cols) for r in range(W)]
                exp = torch.cat([_bytes(ins[r].narrow(0, sum(S[r][:me]), S[r][me])) for r in range(W)])
                out = _poisoned_like(exp, (sum(S[r][me] for r in range(W)), cols), dt, dev)
                kw = {} if form == "all_to_all_single" else {
                    "output_split_sizes": [S[r][me] for r in range(W)], "input_split_sizes": list(S[me])}
                item.work = dist.all_to_all_single(out, ins[me], group=g, async_op=a, **kw)
                item.checks.append(("output", out, exp))
                item.keep = [ins[me]]
                self.bytes += exp.numel()
            elif form == "all_to_all":
                S, cols = call.splits, call.cols
                ins = [payload(me, j, S[me][j] * cols).view(-1, cols) for j in range(W)]
                exps = [_bytes(payload(r, me, S[r][me] * cols)) for r in range(W)]
                outs = [_poisoned_like(e, (S[r][me], cols), dt, dev) for r, e in enumerate(exps)]
                item.work = dist.all_to_all(outs, ins, group=g, async_op=a)
                item.checks += [(f"output[{r}]", o, e) for r, (o, e) in enumerate(zip(outs, exps))]
                item.keep = ins
                self.bytes += sum(e.numel() for e in exps)
            elif form == "broadcast":
                exp = _bytes(payload(call.root, 0, call.numel))
                t = exp.clone().view(dt) if me == call.root else _poisoned_like(exp, (call.numel,), dt, dev)
                item.work = dist.broadcast(t, src=members[call.root], group=g, async_op=a)
                item.checks.append(("tensor", t, exp))
                self.bytes += exp.numel()
            elif form == "gather":
                x = payload(me, 0, call.numel)
                gl = None
                if me == call.root:
                    exps = [_bytes(payload(r, 0, call.numel)) for r in range(W)]
                    gl = [_poisoned_like(e, (call.numel,), dt, dev) for e in exps]
                    item.checks += [(f"gather_list[{r}]", o, e) for r, (o, e) in enumerate(zip(gl, exps))]
                item.work = dist.gather(x, gl, dst=members[call.root], group=g, async_op=a)
                item.keep = [x]
                self.bytes += x.numel() * x.element_size()
            elif form == "scatter":
                exp = _bytes(payload(call.root, me, call.numel))
                out = _poisoned_like(exp, (call.numel,), dt, dev)
                sl = [payload(me, j, call.numel) for j in range(W)] if me == call.root else None
                item.work = dist.scatter(out, sl, src=members[call.root], group=g, async_op=a)
                item.checks.append(("output", out, exp))
                item.keep = sl or []
                self.bytes += exp.numel()
            elif form == "send_recv":  # group rank root sends to the next; the others make no call
                src, dst = call.root, (call.root + 1) % W
                if me == src:
                    x = payload(src, 0, call.numel)
                    item.work = dist.isend(x, members[dst], group=g) if a else dist.send(x, members[dst], group=g)
                    item.keep = [x]
                elif me == dst:
                    exp = _bytes(payload(src, 0, call.numel))
                    out = _poisoned_like(exp, (call.numel,), dt, dev)
                    item.work = dist.irecv(out, members[src], group=g) if a else dist.recv(out, members[src], group=g)
                    item.checks.append(("recv", out, exp))
                    self.bytes += exp.numel()
            elif form == "p2p_ring":  # every member sends to the next and receives from the previous, in one batch
                nxt, prv = (me + 1) % W, (me - 1) % W
                x = payload(me, 0, call.numel)
                exp = _bytes(payload(prv, 0, call.numel))
                out = _poisoned_like(exp, (call.numel,), dt, dev)
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, members[nxt], g),
                                                dist.P2POp(dist.irecv, out, members[prv], g)])
                item.work = works[0] if len(works) == 1 else _AllOf(works)
                if not a:
                    item.work.wait()
                item.checks.append(("recv", out, exp))
                item.keep = [x]
                self.bytes += exp.numel()
            elif form == "all_gather":
                parts = [payload(r, 0, call.numel) for r in range(W)]
                exp = torch.cat([_bytes(p) for p in parts])
                out = _poisoned_like(exp, (W * call.numel,), dt, dev)
                item.work = dist.all_gather_into_tensor(out, parts[me], group=g, async_op=a)
                item.checks.append(("output", out, exp))
                item.keep = [parts[me]]
                self.bytes += exp.numel()
            else:
                raise ValueError(form)
        if not a or item.work is None:
            item.work = None
        self.per_form[form] = self.per_form.get(form, 0) + 1
        return item

    def schedule(self):
        return Schedule(self.opts.seed, self.opts, [len(m) for m in self.members])

    def form_counts(self):
        return {f: self.per_form[f] for f in FORMS if f in self.per_form}


def run_soak(opts, device):
    """Runs the exchange soak in an initialised default group (every rank must call it with the same options);
    returns the summary, raises SoakFailure naming the seed, the call and its description."""
    return soak_allgather.run_soak(opts, device, ExchangeSoak)


def summary_line(s):
    return soak_allgather.summary_line(s, moved="received")


def main(argv=None):
    opts, a = SoakOptions.parse(argv)
    return run_rank(opts, a, a.device == "cuda", run_soak, summary_line)


if __name__ == "__main__":
    sys.exit(main())
