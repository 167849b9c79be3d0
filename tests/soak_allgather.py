"""A randomized all-gather soak: many calls of every form, size, dtype, async depth, stream and group, each output
checked bit-exact against bytes every rank rebuilds locally from (seed, call index, rank).

Under torchrun (GPU when there is one, else CPU):
    torchrun --nproc_per_node 2 tests/soak_allgather.py --calls 100000 --seed 7
    SDMA_TEST_SHARE_GPU=1 torchrun --nproc_per_node 2 tests/soak_allgather.py ...   (two ranks on one GPU)
From a test: run_soak(SoakOptions(...), device) inside an initialised process group (tests/test_soak_cpu.py).

Every rank draws the same schedule from the seed, so the ranks agree on every call without talking; the only
exchange besides the all-gathers is the stop, decided by rank 0 (the time limit) and broadcast over a gloo group
every --stop-every calls. A call's description says everything that was drawn for it; on a wrong byte, an error or a
timeout the soak names the seed, the call's index and its description and fails (exit status 1). On success it
prints one line: calls, calls per form, bytes, seconds.

At the end, file descriptors (/proc/self/fd) and the peers' memory that torch_sdma maps (peer_mapped_bytes) must be
back where they were after the warm-up, within FD_SLACK descriptors and, for the mappings, within what the peers
still hold (see check_resources).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import math
import os
import random
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checks.data import coalescing_manager

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int32, torch.int64,
          torch.float64, torch.bool)
# Forms, in the order their counts are printed. "list_uneven" needs an inner backend that gathers lists of uneven
# sizes (NCCL does, gloo refuses them); "single" needs torch.distributed.all_gather_single (torch >= 2.14).
FORMS = ("into_tensor", "into_tensor_stack", "into_tensor_inplace", "list", "list_uneven", "single", "coalesced",
         "coalesced_legacy")
SIDE_STREAMS = 3
GROUPS = 4  # the world group and three made with new_group, two of them (or more) with the same members
# Descriptors that may open lazily during a soak without being a leak (CUDA's and gloo's first use of something);
# a leak per call or per group made again shows up well beyond this, as groups are made again dozens of times.
FD_SLACK = 8
# Per peer, on top of what the peer holds: mappings are whole allocations, rounded up to the mapping granularity.
MAPPED_SLACK_PER_PEER = 2 << 20


class SoakFailure(AssertionError):
    pass


def _env(name, default, kind):
    v = os.environ.get(name)
    return kind(v) if v not in (None, "") else default


@dataclass
class SoakOptions:
    seed: int = 1
    calls: int = 100_000
    time_limit_s: float = 0.0  # 0: no time limit
    max_bytes: int = 32 << 20  # per rank and call (a coalesced call's tensors share it)
    max_depth: int = 8  # async calls in flight, at most
    stop_every: int = 64  # calls between the ranks' agreement on stopping
    forms: tuple = FORMS
    pg_timeout_s: float = 120.0  # every group's, so that a wait that never ends is an error within it
    verbose: bool = False

    @staticmethod
    def parse(argv=None, on_gpu=False):
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--seed", type=int, default=_env("SOAK_SEED", 1, int), help="schedule and data (SOAK_SEED)")
        p.add_argument("--calls", type=int, default=_env("SOAK_CALLS", 100_000, int), help="SOAK_CALLS")
        p.add_argument("--time-limit-s", type=float, default=_env("SOAK_TIME_LIMIT_S", 0.0, float),
                       help="stop after this long, 0 for none (SOAK_TIME_LIMIT_S)")
        p.add_argument("--max-bytes", type=int,
                       default=_env("SOAK_MAX_BYTES", (32 << 20) if on_gpu else (1 << 20), int),
                       help="largest input per rank and call (SOAK_MAX_BYTES; 32 MiB on GPUs, 1 MiB on CPU)")
        p.add_argument("--max-depth", type=int, default=_env("SOAK_MAX_DEPTH", 8, int),
                       help="async calls in flight, at most (SOAK_MAX_DEPTH)")
        p.add_argument("--stop-every", type=int, default=_env("SOAK_STOP_EVERY", 64, int),
                       help="calls between the ranks' agreement on stopping (SOAK_STOP_EVERY)")
        p.add_argument("--forms", default=_env("SOAK_FORMS", ",".join(FORMS), str),
                       help="comma-separated subset of " + ",".join(FORMS) + " (SOAK_FORMS)")
        p.add_argument("--backend", default=os.environ.get("SOAK_BACKEND"),
                       help="init_process_group's backend (default: cpu:gloo,cuda:sdma on GPUs, sdma on CPU)")
        p.add_argument("--pg-timeout-s", type=float, default=_env("SOAK_PG_TIMEOUT_S", 120.0, float))
        p.add_argument("--verbose", action="store_true")
        a = p.parse_args(argv)
        forms = tuple(f for f in a.forms.split(",") if f)
        unknown = set(forms) - set(FORMS)
        if unknown:
            p.error(f"unknown forms {sorted(unknown)}")
        opts = SoakOptions(seed=a.seed, calls=a.calls, time_limit_s=a.time_limit_s, max_bytes=a.max_bytes,
                           max_depth=a.max_depth, stop_every=max(1, a.stop_every), forms=forms,
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
    stream: int  # 0: the default stream, 1..SIDE_STREAMS: a side stream (GPU only)
    tensors: list  # per tensor: (dtype, [numel per group rank])
    stack: bool = False

    def describe(self, ranks):
        parts = []
        for dt, numels in self.tensors:
            es = torch.empty((), dtype=dt).element_size()
            n = numels if len(set(numels)) > 1 else numels[0]
            parts.append(f"{str(dt).replace('torch.', '')}x{n} ({max(numels) * es} B/rank)")
        return (f"call {self.index}: {self.form} on group {self.group} {ranks} "
                f"{'async' if self.async_op else 'sync'} stream {self.stream}: " + ", ".join(parts))


@dataclass
class Event:
    """What happens before a call: empty_cache, a group made again, a new async depth."""

    empty_cache: bool = False
    remake_group: int | None = None
    depth: int | None = None


def _size(rng, max_bytes, es):
    """Elements for a log-uniform byte count in [es, max_bytes], or 0 now and then."""
    if rng.random() < 0.03 or max_bytes < es:
        return 0
    nbytes = math.exp(rng.uniform(0.0, math.log(max_bytes)))
    return max(1, int(nbytes) // es)


class Schedule:
    def __init__(self, seed, opts, group_sizes, uneven_ok, single_ok):
        self.rng = random.Random(seed)
        self.opts = opts
        forms = [f for f in opts.forms if (f != "list_uneven" or uneven_ok) and (f != "single" or single_ok)]
        if not forms:
            raise ValueError("no form left to run")
        self.forms = forms
        self.group_sizes = group_sizes

    def event(self):
        rng = self.rng
        e = Event()
        if rng.random() < 1 / 200:
            e.empty_cache = True
        if rng.random() < 1 / 150 and len(self.group_sizes) > 1:
            e.remake_group = rng.randrange(1, len(self.group_sizes))
        if rng.random() < 1 / 50:
            e.depth = rng.randint(0, self.opts.max_depth)
        return e

    def call(self, index):
        rng = self.rng
        group = rng.randrange(len(self.group_sizes))
        W = self.group_sizes[group]
        form = rng.choice(self.forms)
        async_op = rng.random() < 0.6
        stream = rng.randrange(SIDE_STREAMS + 1)
        n_tensors = rng.randint(1, 4) if form.startswith("coalesced") else 1
        cap = max(1, self.opts.max_bytes // n_tensors)
        tensors = []
        first_dt = rng.choice(DTYPES)
        for k in range(n_tensors):
            dt = first_dt if form == "coalesced_legacy" or k == 0 else rng.choice(DTYPES)
            es = torch.empty((), dtype=dt).element_size()
            n = _size(rng, cap, es)
            if form == "list_uneven":
                numels = [_size(rng, cap, es) for _ in range(W)]
            else:
                numels = [n] * W
            tensors.append((dt, numels))
        stack = form == "into_tensor_stack"
        return Call(index, group, form, async_op, stream, tensors, stack)


# ------------------------------------------------------------------------------------------------ the data
def _payload(seed, index, global_rank, k, numel, dtype, device):
    """The input of tensor k of call `index` on `global_rank`: any bit pattern (0/1 for bool)."""
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(f"{seed}|{index}|{global_rank}|{k}".encode()) & 0x7FFFFFFFFFFF)
    es = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g, dtype=torch.uint8, device=device).view(torch.bool)
    return torch.randint(0, 256, (numel * es,), generator=g, dtype=torch.uint8, device=device).view(dtype)


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _poisoned_like(expected_bytes, shape, dtype, device):
    """A fresh output holding NOT(expected), so that every byte the all-gather fails to write differs."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel():
        _bytes(out).copy_(torch.bitwise_not(expected_bytes))
    return out


def _first_difference(got, expected):
    bad = (got != expected).nonzero().flatten()
    i = int(bad[0])
    return (f"{bad.numel()} of {expected.numel()} bytes differ, first at byte {i}: got 0x{int(got[i]):02x} "
            f"expected 0x{int(expected[i]):02x}; unwritten (still poison): "
            f"{int((got[bad] == torch.bitwise_not(expected[bad])).sum())}")


@dataclass
class Issued:
    """A call on its way: what to wait for and what to compare once it is done."""

    call: Call
    work: object  # Work or coalescing manager (async), None (sync)
    checks: list = field(default_factory=list)  # (what, output tensor, expected bytes)
    keep: list = field(default_factory=list)  # inputs, held until checked


class Soak:
    def __init__(self, opts, device, ctrl):
        self.opts = opts
        self.device = device
        self.ctrl = ctrl  # gloo group over every rank: the stop and the resource check
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.cuda = device.type == "cuda"
        self.streams = [torch.cuda.current_stream(device)] + [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)] \
            if self.cuda else [None]
        # Members of each group slot, the same on every rank: the world, then the same members twice (all of them),
        # then a random subset of at least two where there are more than two ranks.
        rng = random.Random(opts.seed ^ 0x5A5A)
        every = list(range(self.world))
        subset = sorted(rng.sample(every, max(2, self.world - 1))) if self.world > 2 else every
        self.members = [every, every, every, subset][:GROUPS]
        self.groups = [dist.group.WORLD] + [self._new_group(m) for m in self.members[1:]]
        self.pending = []
        self.depth = min(2, opts.max_depth)
        self.per_form = {}
        self.bytes = 0
        self.remade = 0

    def _new_group(self, members):
        # new_group's own default timeout is torch's (minutes), not the default group's
        return dist.new_group(members, timeout=datetime.timedelta(seconds=self.opts.pg_timeout_s))

    # --- one call
    def _ctx(self, call):
        if self.cuda:
            return torch.cuda.stream(self.streams[call.stream % len(self.streams)])
        return contextlib.nullcontext()

    def issue(self, call):
        g = self.groups[call.group]
        members = self.members[call.group]
        me = members.index(self.rank)
        W = len(members)
        dev, seed = self.device, self.opts.seed
        item = Issued(call, None)
        with self._ctx(call):
            xs, outs, exps = [], [], []
            for k, (dt, numels) in enumerate(call.tensors):
                parts = [_payload(seed, call.index, r, k, numels[j], dt, dev) for j, r in enumerate(members)]
                xs.append(parts[me])
                exps.append(parts)
                self.bytes += sum(p.numel() * p.element_size() for p in parts)
            form, a = call.form, call.async_op
            if form in ("into_tensor", "into_tensor_stack", "into_tensor_inplace", "single"):
                x, parts = xs[0], exps[0]
                exp = torch.cat([_bytes(p) for p in parts])
                shape = (W, x.numel()) if call.stack else (W * x.numel(),)
                out = _poisoned_like(exp, shape, x.dtype, dev)
                if form == "into_tensor_inplace":
                    slot = out.narrow(0, me * x.numel(), x.numel())
                    slot.copy_(x)
                    x = slot
                fn = dist.all_gather_single if form == "single" else dist.all_gather_into_tensor
                item.work = fn(out, x, group=g, async_op=a)
                item.checks.append(("output", out, exp))
            elif form in ("list", "list_uneven"):
                x, parts = xs[0], exps[0]
                outs = [_poisoned_like(_bytes(p), p.shape, p.dtype, dev) for p in parts]
                item.work = dist.all_gather(outs, x, group=g, async_op=a)
                item.checks += [(f"output[{j}]", o, _bytes(p)) for j, (o, p) in enumerate(zip(outs, parts))]
            elif form == "coalesced":
                for k, (x, parts) in enumerate(zip(xs, exps)):
                    exp = torch.cat([_bytes(p) for p in parts])
                    outs.append(_poisoned_like(exp, (W * x.numel(),), x.dtype, dev))
                    item.checks.append((f"tensor {k}", outs[-1], exp))
                with coalescing_manager(g, dev, a) as cm:
                    for x, o in zip(xs, outs):
                        dist.all_gather_into_tensor(o, x, group=g)
                item.work = cm if a else None
            elif form == "coalesced_legacy":
                rows = [[_poisoned_like(_bytes(exps[k][j]), exps[k][j].shape, exps[k][j].dtype, dev)
                         for k in range(len(xs))] for j in range(W)]
                item.work = dist.all_gather_coalesced(rows, xs, group=g, async_op=a)
                item.checks += [(f"output[{j}][{k}]", rows[j][k], _bytes(exps[k][j]))
                                for j in range(W) for k in range(len(xs))]
            else:
                raise ValueError(form)
            item.keep = xs
        if not a:
            item.work = None
        self.per_form[form] = self.per_form.get(form, 0) + 1
        return item

    def settle(self, item):
        """Waits for `item` (on the stream it was issued from) and compares its outputs."""
        with self._ctx(item.call):
            if item.work is not None:
                item.work.wait()
            for what, out, exp in item.checks:
                got = _bytes(out)
                if not torch.equal(got, exp):
                    raise SoakFailure(f"{what}: {_first_difference(got.cpu(), exp.cpu())}")

    def _fail(self, call, e):
        desc = call.describe(self.members[call.group])
        msg = f"soak failed on rank {self.rank}: seed {self.opts.seed}, call {call.index}: {desc}: " \
              f"{type(e).__name__}: {e}"
        raise SoakFailure(msg) from e

    def _settle_where(self, pred):
        keep = []
        for item in self.pending:
            if pred(item):
                try:
                    self.settle(item)
                except Exception as e:  # noqa: BLE001
                    self._fail(item.call, e)
            else:
                keep.append(item)
        self.pending = keep

    def drain(self, group=None):
        self._settle_where(lambda item: group is None or item.call.group == group)

    # --- events
    def apply(self, ev):
        if ev.depth is not None:
            self.depth = ev.depth
        if ev.empty_cache and self.cuda:
            torch.cuda.empty_cache()
        if ev.remake_group is not None:
            slot = ev.remake_group
            self.drain(slot)  # a group's calls finish before it goes
            if self.cuda:
                torch.cuda.synchronize(self.device)
            if self.rank in self.members[slot]:
                dist.destroy_process_group(self.groups[slot])
            self.groups[slot] = self._new_group(self.members[slot])
            self.remade += 1

    # --- the stop
    def should_stop(self, started):
        flag = torch.zeros(1, dtype=torch.int32)
        if self.rank == 0 and self.opts.time_limit_s and time.monotonic() - started > self.opts.time_limit_s:
            flag[0] = 1
        dist.broadcast(flag, 0, group=self.ctrl)
        return bool(flag[0])

    # --- resources
    def warm_up(self):
        """One small call on every group, so that every group has connected before the resources are counted; and one
        that the inner backend runs, where it can, since NCCL opens descriptors of its own at its first call (NCCL
        refuses two ranks on one GPU)."""
        inner_ok = not self.cuda or torch.cuda.device_count() >= self.world
        for i, g in enumerate(self.groups):
            if self.rank not in self.members[i]:
                continue
            W = len(self.members[i])
            x = torch.full((16,), self.rank, dtype=torch.int32, device=self.device)
            out = torch.empty(W * 16, dtype=torch.int32, device=self.device)
            dist.all_gather_into_tensor(out, x, group=g)
            if inner_ok:
                dist.all_reduce(x, group=g)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.ctrl)

    def resources(self):
        self.fd_kinds0 = getattr(self, "fd_kinds0", None) or _fd_kinds()
        return _fd_count(), [_peer_mapped(g) if self.rank in m else 0 for g, m in zip(self.groups, self.members)]

    def run(self):
        opts = self.opts
        sched = self.schedule()
        self.warm_up()
        fds0, mapped0 = self.resources()
        started = time.monotonic()
        done = 0
        for index in range(opts.calls):
            if index % opts.stop_every == 0 and index and self.should_stop(started):
                break
            ev = sched.event()
            call = sched.call(index)
            self.apply(ev)
            if self.rank in self.members[call.group]:
                try:
                    self.pending.append(self.issue(call))
                except Exception as e:  # noqa: BLE001
                    self._fail(call, e)
                while len(self.pending) > self.depth:
                    self._settle_oldest_one()
            done += 1
            if opts.verbose and self.rank == 0 and index % 1000 == 0:
                print(f"soak: {index} calls, {time.monotonic() - started:.1f} s", flush=True)
        self.drain()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.monotonic() - started
        self.check_resources(fds0, mapped0)
        return {"calls": done, "forms": self.form_counts(), "bytes": self.bytes,
                "world_paths": _paths(dist.group.WORLD),
                "seconds": round(seconds, 2), "calls_per_s": round(done / seconds, 1) if seconds else 0.0,
                "groups_remade": self.remade, "forms_run": sched.forms}

    def schedule(self):
        # Uneven lists go to the inner backend: NCCL gathers them, gloo refuses them, and NCCL refuses two ranks on
        # one GPU.
        uneven_ok = self.cuda and torch.cuda.device_count() >= self.world
        single_ok = hasattr(dist, "all_gather_single")
        return Schedule(self.opts.seed, self.opts, [len(m) for m in self.members], uneven_ok, single_ok)

    def form_counts(self):
        return dict(sorted(self.per_form.items()))

    def _settle_oldest_one(self):
        item = self.pending.pop(0)
        try:
            self.settle(item)
        except Exception as e:  # noqa: BLE001
            self._fail(item.call, e)

    def check_resources(self, fds0, mapped0, rounds=4):
        """Descriptors: at most FD_SLACK more than after the warm-up. Peer mappings: after every rank emptied its
        cache and every group gathered again, a group maps at most what its other members still hold (reserved by
        their caching allocators, plus their staging and bounce areas), MAPPED_SLACK_PER_PEER each: more would be
        memory the peers freed and can never get back. A rank reports what it freed at its next all-gather and a peer
        unmaps it at the all-gather after it reads the report, so a free may take two gathers to come back: up to
        `rounds` rounds, the verdict taken alike on every rank."""
        problems = []
        for _ in range(rounds):
            if self.cuda:
                torch.cuda.empty_cache()
            dist.barrier(group=self.ctrl)
            self.warm_up()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            fds, mapped = self.resources()
            held = [None] * self.world
            mine = {"reserved": torch.cuda.memory_reserved(self.device) if self.cuda else 0,
                    "staging": [_staging(g) if self.rank in m else 0 for g, m in zip(self.groups, self.members)]}
            dist.all_gather_object(held, mine, group=self.ctrl)
            problems = []
            if fds > fds0 + FD_SLACK:
                grown = _fd_kinds() - self.fd_kinds0
                problems.append(f"{fds - fds0} more file descriptors than after the warm-up ({fds0} -> {fds}; "
                                f"more of: {dict(grown.most_common(8))})")
            for i, m in enumerate(mapped):
                peers = [r for r in self.members[i] if r != self.rank]
                allowed = max(mapped0[i], sum(held[r]["reserved"] + held[r]["staging"][i] + MAPPED_SLACK_PER_PEER
                                              for r in peers))
                if m > allowed:
                    problems.append(f"group {i} maps {m} B of its peers' memory, more than the {allowed} B they hold")
            verdicts = [None] * self.world
            dist.all_gather_object(verdicts, bool(problems), group=self.ctrl)
            if not any(verdicts):
                return
        if problems:
            raise SoakFailure(f"soak on rank {self.rank}, seed {self.opts.seed}: " + "; ".join(problems))
        raise SoakFailure(f"soak on rank {self.rank}, seed {self.opts.seed}: a peer's resources did not come back")


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


def _fd_kinds():
    """Open descriptors by what they are ("socket", "pipe", "anon_inode:[eventfd]", "/dev/shm/...", a path), for
    saying what leaked."""
    kinds = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":[")[0] if ":[" in target and not target.startswith("anon_inode") else target] += 1
    return kinds


def _sdma():
    try:
        import torch_sdma
    except ImportError:
        return None
    return torch_sdma


def _peer_mapped(g):
    sdma = _sdma()
    return sdma.peer_mapped_bytes(g) if sdma else 0


def _paths(g):
    """Calls per path ("dma", "dma:direct", "inner:<why>") of group g in this process."""
    sdma = _sdma()
    return {k: v["calls"] for k, v in sdma.stats(g).items()} if sdma else {}


def _staging(g):
    sdma = _sdma()
    return sdma.staging_bytes(g) if sdma else 0


def run_soak(opts, device, kind=None):
    """Runs the soak (`kind`, a Soak class; the all-gather soak by default) in an initialised default group (every
    rank must call it with the same options); returns the summary, raises SoakFailure naming the seed, the call and
    its description."""
    ctrl = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=opts.pg_timeout_s))
    soak = (kind or Soak)(opts, device, ctrl)
    try:
        return soak.run()
    finally:
        soak.pending.clear()


def summary_line(s, moved="gathered"):
    forms = " ".join(f"{k}={v}" for k, v in s["forms"].items())
    return (f"soak ok: {s['calls']} calls ({s['calls_per_s']}/s) in {s['seconds']} s, "
            f"{s['bytes'] / 2**30:.2f} GiB {moved}, {s['groups_remade']} groups made again; forms: {forms}")


def run_rank(opts, a, on_gpu, run, summary):
    """One rank of a soak under torchrun: `run(opts, device)` on the group `a.backend` (every size on the DMA path),
    `summary(result)` printed by rank 0. Exits the process at once on a failure: the peers may be stuck in a call this
    rank never makes, so nothing is torn down."""
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    backend = a.backend or ("cpu:gloo,cuda:sdma" if on_gpu else "sdma")
    if "sdma" in backend:
        import torch_sdma  # noqa: F401  (registers the backend; before CUDA starts, so that it sets the hardware queues)
    if on_gpu:
        # cuda:<local rank>, wrapping over the visible GPUs: with SDMA_TEST_SHARE_GPU=1 on one GPU both ranks share it.
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("TORCH_SDMA_MIN_BYTES", "0")  # every size on the DMA path
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.pg_timeout_s))
    try:
        s = run(opts, device)
    except SoakFailure as e:
        print(str(e), file=sys.stderr, flush=True)
        os._exit(1)
    except Exception as e:  # noqa: BLE001
        print(f"soak failed on rank {rank}, seed {opts.seed}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    if rank == 0:
        print(summary(s), flush=True)
    dist.destroy_process_group()
    return 0


def main(argv=None):
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    opts, a = SoakOptions.parse(argv, on_gpu)
    return run_rank(opts, a, on_gpu, run_soak, summary_line)


if __name__ == "__main__":
    sys.exit(main())
