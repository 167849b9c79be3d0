"""Checks torch_sdma on one node and prints a report to paste into a bug.

    torchrun --nproc_per_node <GPUs on the node, or 2 without a GPU> -m torch_sdma.check
    torch-sdma-check          # the same; started outside torchrun, it launches torchrun itself

Any number of ranks and devices. In order:
- registration: where torch_sdma was loaded from, its entry point, the backend string used;
- paths: which path (torch_sdma.stats) each all-gather form takes in each group;
- hardware queues (GPU): CUDA_DEVICE_MAX_CONNECTIONS in effect and what to do when it is low;
- a bit-exact sweep: every all-gather form torch offers, a few dtypes and sizes, async calls in flight, in four
  groups (the defaults, and every size on DMA: default schedule, direct, staging); each output is compared byte for
  byte with what every rank rebuilds of every rank's input;
- the same for the exchanges (all_to_all_single even, uneven with zero splits and async, all_to_all, broadcast,
  gather, scatter, a batch_isend_irecv ring and a send/recv pipeline) in the defaults and the every-size-on-DMA
  group, with the path each took (group_path(op=...), "send" and "recv" for point-to-point);
- a short busbw table: sdma against NCCL (gloo on CPU tensors) and, on GPUs, the copy-engine limit: the fastest of
  the raw schedules (plain copies of the same bytes between the ranks' buffers, unordered: in rank order or rotated
  on one stream, a stream per peer, pulls), in a table of their own; then the exchanges, point-to-point included,
  against NCCL (gloo).

Exit 1 on a wrong byte (the report names the group, form, dtype, size and rank), a step that outlasts --timeout
(a hang: every rank's stacks go to stderr), or a misconfiguration it can name; 0 otherwise.
TORCH_SDMA_CHECK_PLANT_WRONG_BYTE=<form or exchange> (a test knob) flips one output byte of that form's first call
on the last rank, to show that the check catches it.
"""
import argparse
import datetime
import faulthandler
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

# Imported before CUDA starts (set_device below): the import chooses the hardware-queue count.
import torch_sdma

from . import _hw_queues
from ._check_exchanges import P2P_OPS, Exchanges

KIB, MIB = 1 << 10, 1 << 20
PLANT_KNOB = "TORCH_SDMA_CHECK_PLANT_WRONG_BYTE"
# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (the same call underneath).
GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
SINGLE = GATHER_SINGLE.__name__
DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int64)
# Bytes per rank: one element, an odd count, and sizes that need several chunks of staging.
SWEEP_BYTES = (1, 4099, 256 * KIB, 4 * MIB)
# Bytes per rank and pair of the exchanges.
EXCHANGE_BYTES = (1, 4099, 256 * KIB)
ASYNC_IN_FLIGHT = 4


def parse_bytes(text):
    """'64K', '16M', '1G' or a plain number of bytes."""
    units = {"K": KIB, "M": MIB, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def human_bytes(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def hashed_bytes(rank, n, device):
    """Rank `rank`'s input of n bytes: a hash of (position, rank), so that every rank rebuilds every rank's input."""
    x = torch.arange(n, dtype=torch.int64, device=device) * 0x9E3779B1 + 7919 * (rank + 1)
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x ^= x >> 12
    return (x & 0xFF).to(torch.uint8)


def expected_output(world, n_bytes, device):
    return torch.cat([hashed_bytes(r, n_bytes, device) for r in range(world)])


def first_wrong_byte(got, want):
    """None where the uint8 tensors are equal; else the first differing index and 'got 0x.., expected 0x..'."""
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero()[0].item()
    return bad, f"0x{got[bad].item():02x}, expected 0x{want[bad].item():02x}"


def seconds_per_call(fn, iters, gpu):
    """Seconds per call of `fn` (which blocks, or on a GPU enqueues on the current stream), averaged over `iters`."""
    if gpu:
        return gpu_seconds_per_call(fn, iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def gpu_seconds_per_call(fn, iters):
    """Seconds per call of `fn` (which enqueues on the current stream), by CUDA events around `iters` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def path_moved(before, after):
    """Which all-gather path(s) torch_sdma's counters moved on between two torch_sdma.stats() snapshots."""
    moved = [k for k, v in after.items()
             if k.startswith(("dma", "inner:")) and v["calls"] > before.get(k, {}).get("calls", 0)]
    return "+".join(sorted(moved)) or "none"


def new_group_with_env(**env):
    """A group of the default backend created while `env` is set (torch_sdma reads its knobs at group creation)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return dist.new_group()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def gather_json(obj, world, group):
    """`obj` from every rank of `group` (a CPU group), as JSON text in uint8 tensors: lengths first, then the
    bytes padded to the longest."""
    mine = json.dumps(obj).encode()
    length = torch.tensor([len(mine)], dtype=torch.int64)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    lengths = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[:len(mine)] = torch.tensor(list(mine), dtype=torch.uint8)
    texts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(texts, padded, group=group)
    return [json.loads(bytes(t[:n].tolist())) for t, n in zip(texts, lengths)]


# Raw copy-engine schedules: not all-gathers, the bytes of one moved between the ranks' own buffers with plain copies
# (cudaMemcpyAsync, a copy engine) and nothing else, no ordering between ranks. Each rank's n bytes go into its slot
# of every peer's buffer of world * n (pulls: each rank fetches every peer's own slot). How a rank orders its copies
# decides what the links give: in rank order on one stream every rank writes to the same peer first (incast, one
# peer's links busy, the others idle); rotated (rank+1, rank+2, ...) every peer has one writer at each step; with a
# stream per peer all copies run at once. The fastest of them is the copy-engine limit of the reports.
RAW_SCHEDULES = {"same-order": "same order, one stream", "rotated": "rotated, one stream",
                 "per-peer": "a stream per peer", "pull-per-peer": "pulls, a stream per peer"}


def peer_order(rank, world, schedule):
    """The peers in the order `rank` copies to them under `schedule`: rank order, or rotated from rank + 1."""
    if schedule == "same-order":
        return [p for p in range(world) if p != rank]
    return [(rank + k) % world for k in range(1, world)]


class RawCopies:
    """The raw schedules of one size on this rank. `buf` is this rank's buffer of world * n bytes; peer_bufs[p] is
    peer p's, mapped into this process; `keep` holds whatever keeps those mappings valid (a symmetric-memory
    handle), for as long as this object lives."""

    def __init__(self, rank, world, n, buf, peer_bufs, keep=None):
        self.rank, self.world, self.n, self.buf, self.keep = rank, world, n, buf, keep

        def slot(t, q):
            return t[q * n:(q + 1) * n]
        self.inp = hashed_bytes(rank, n, buf.device)
        # Pushes: this rank's input into its slot of each peer's buffer. Pulls: each peer's own slot into this rank's
        # slot for that peer (the peer's input, in place, as an in-place all-gather has it).
        self.push = {p: (slot(b, rank), self.inp) for p, b in peer_bufs.items()}
        self.pull = {p: (slot(buf, p), slot(b, p)) for p, b in peer_bufs.items()}
        self.streams = {p: torch.cuda.Stream(device=buf.device) for p in peer_bufs}

    def call(self, schedule):
        """One round of `schedule`'s copies, enqueued on the current stream (side streams joined back into it)."""
        order = peer_order(self.rank, self.world, schedule)
        copies = [(self.pull if schedule.startswith("pull") else self.push)[p] for p in order]
        if schedule in ("same-order", "rotated"):
            def one_stream():
                for dst, src in copies:
                    dst.copy_(src)  # contiguous, one dtype, one device as torch sees it: cudaMemcpyAsync, a copy engine
            return one_stream
        streams = [self.streams[p] for p in order]

        def stream_per_peer():
            cur = torch.cuda.current_stream()
            for (dst, src), s in zip(copies, streams):
                s.wait_stream(cur)  # after whatever wrote the buffers on the current stream
                with torch.cuda.stream(s):
                    dst.copy_(src)
            for s in streams:
                cur.wait_stream(s)
        return stream_per_peer

    def check(self, call, barrier):
        """True when, after one `call` on every rank, this rank's buffer holds every peer's input in its slot.
        `barrier()` lines the ranks up (after this rank's device work is done)."""
        n = self.n
        self.buf.fill_(0xA5)
        self.buf[self.rank * n:(self.rank + 1) * n].copy_(self.inp)  # what the peers pull
        torch.cuda.synchronize()
        barrier()
        call()
        torch.cuda.synchronize()
        barrier()
        return all(torch.equal(self.buf[q * n:(q + 1) * n], hashed_bytes(q, n, self.buf.device))
                   for q in range(self.world) if q != self.rank)


def symm_mem_peer_buffers(group, rank, world, nbytes, device):
    """This rank's buffer of `nbytes` in torch symmetric memory (VMM), every peer's mapped here, and the handle that
    keeps the mappings valid: (buf, {peer: its buffer}, handle)."""
    import torch.distributed._symmetric_memory as symm_mem
    buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    return buf, {p: handle.get_buffer(p, (nbytes,), torch.uint8) for p in range(world) if p != rank}, handle


class Watchdog:
    """Bounds every step: past the timeout a rank prints the step and its stacks, and exits 1."""

    def __init__(self, rank, timeout_s):
        self.rank, self.timeout_s, self.step, self.deadline = rank, timeout_s, "start", time.monotonic() + timeout_s
        threading.Thread(target=self._watch, daemon=True).start()

    def enter(self, step):
        self.step, self.deadline = step, time.monotonic() + self.timeout_s

    def _watch(self):
        while True:
            time.sleep(0.5)
            if time.monotonic() > self.deadline:
                print(f"torch_sdma.check: rank {self.rank}: FAIL: '{self.step}' did not finish within "
                      f"{self.timeout_s:.0f} s (a hang); stacks follow", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(1)


class _StopSweep(Exception):
    pass


class Check:
    def __init__(self, args):
        self.args = args
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.watchdog = Watchdog(self.rank, args.timeout)
        self.failures, self.warnings, self.lines, self.errors = [], [], [], []
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.mode = args.mode if args.mode != "auto" else ("gpu" if gpus else "cpu")
        timeout = datetime.timedelta(seconds=args.timeout)
        if self.mode == "gpu":
            if self.local_rank >= gpus and not args.share_gpu:
                raise SystemExit(f"torch_sdma.check: FAIL: local rank {self.local_rank} but {gpus} visible GPUs: "
                                 f"run one process per GPU (--nproc_per_node {gpus}), or --share-gpu")
            torch.cuda.set_device(self.local_rank % gpus)
            self.device = torch.device("cuda", self.local_rank % gpus)
            self.backend, self.base_name = "cpu:gloo,cuda:sdma", "nccl"
        else:
            self.device, self.backend, self.base_name = torch.device("cpu"), "cpu:sdma", "gloo"
        self.watchdog.enter("init_process_group")
        dist.init_process_group(self.backend, timeout=timeout)
        # Results travel on gloo, apart from the groups under test.
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.base_group = dist.new_group(backend=self.base_name, timeout=timeout)
        quiet = {"TORCH_SDMA_LOG": "0"}
        self.groups = [("defaults", None),
                       ("dma", new_group_with_env(TORCH_SDMA_MIN_BYTES="0", **quiet)),
                       ("direct", new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_DIRECT="1", **quiet)),
                       ("staging", new_group_with_env(TORCH_SDMA_MIN_BYTES="0", TORCH_SDMA_DIRECT="0", **quiet))]
        self.plant = os.environ.get(PLANT_KNOB, "")
        self.planted = False

    def say(self, line=""):
        """A report line (rank 0 prints it as it goes)."""
        self.lines.append(line)
        if self.rank == 0:
            print(line, flush=True)

    def fail(self, what):
        self.failures.append(what)

    def sync(self):
        if self.mode == "gpu":
            torch.cuda.synchronize()
        dist.barrier(group=self.control)

    def gather_all(self, obj):
        """`obj` (anything JSON holds) from every rank, in rank order, over the control group. Not
        all_gather_object: it unpickles through numpy, which torch does not require, and the check must run where
        only torch and torch_sdma are installed."""
        return gather_json(obj, self.world, self.control)

    # ------------------------------------------------------------------------------------------ registration
    def registration(self):
        self.watchdog.enter("registration")
        try:
            version = importlib.metadata.version("torch_sdma")
        except importlib.metadata.PackageNotFoundError:
            version = "not installed (a source tree)"
        eps = [ep for ep in importlib.metadata.entry_points(group="torch.distributed.backends") if ep.name == "sdma"]
        where = os.path.dirname(torch_sdma.__file__)
        self.say(f"# torch_sdma.check: {self.world} ranks, {self.mode} mode, {self.where()}")
        self.say(f"torch {torch.__version__}, python {platform.python_version()}, {platform.platform()}")
        self.say(f"torch_sdma {version} from {where}")
        self.say("entry point torch.distributed.backends: "
                 + (", ".join(f"{ep.name} = {ep.value}" for ep in eps) if eps else "absent (import torch_sdma "
                                                                                  "before init_process_group)"))
        try:
            numpy = f"numpy {importlib.metadata.version('numpy')}"
        except importlib.metadata.PackageNotFoundError:
            numpy = ("numpy: not installed, which torch_sdma and this check do not need (torch warns 'Failed to "
                     "initialize NumPy' at import)")
        self.say(numpy)
        registered = "SDMA" in dist.Backend._plugins
        self.say(f"backend 'sdma' registered: {'yes' if registered else 'NO'}; groups use {self.backend!r}")
        if not registered:
            self.fail("the backend name 'sdma' is not registered after import torch_sdma")
        # Every rank must run the same code: a mixed install fails in ways no single rank can explain.
        mine = [torch.__version__, version, where]  # a list: what JSON gives back, to compare with
        versions = self.gather_all(mine)
        if any(v[:2] != mine[:2] for v in versions):
            self.fail("ranks run different torch / torch_sdma versions: "
                      + "; ".join(f"rank {r}: {v[0]} / {v[1]}" for r, v in enumerate(versions)))

    def where(self):
        if self.mode == "gpu":
            return f"{torch.cuda.get_device_name(self.device)} x{torch.cuda.device_count()} visible"
        return f"{platform.machine()} CPU, {os.cpu_count()} cores"

    def hardware_queues(self):
        if self.mode != "gpu":
            return
        hint = _hw_queues.hint()
        queues = _hw_queues.queues_in_effect()
        how = {"set": "set by torch_sdma", "user": "set by the user", "late": "CUDA started first"}
        self.say(f"hardware queues: {queues} ({how.get(_hw_queues.decision, _hw_queues.decision)})"
                 + (f"; WARNING: {hint}" if hint else ""))
        if hint:
            self.warnings.append(hint)

    # ------------------------------------------------------------------------------------------------- sweep
    def forms(self):
        """(name, call) per all-gather form torch offers: call(out_bytes_view, n_bytes, dtype, group) fills the
        output (uint8 bytes of world * n) and returns nothing."""
        rank, world = self.rank, self.world

        def typed(buf, dtype):
            return buf.view(dtype)

        def single(out, inp, dtype, group):
            GATHER_SINGLE(typed(out, dtype), typed(inp, dtype), group=group)

        def in_place(out, inp, dtype, group):
            n = inp.numel()
            out[rank * n:(rank + 1) * n].copy_(inp)
            GATHER_SINGLE(typed(out, dtype), typed(out[rank * n:(rank + 1) * n], dtype), group=group)

        def stacked(out, inp, dtype, group):
            GATHER_SINGLE(typed(out, dtype).view(world, -1), typed(inp, dtype), group=group)

        def as_list(out, inp, dtype, group):
            n = inp.numel()
            dist.all_gather([typed(out[r * n:(r + 1) * n], dtype) for r in range(world)], typed(inp, dtype),
                            group=group)

        def in_flight(out, inp, dtype, group):
            # Several async calls in flight on the same input, then waited for; the last one lands in `out`.
            spares = [torch.empty_like(out) for _ in range(ASYNC_IN_FLIGHT - 1)]
            works = [GATHER_SINGLE(typed(o, dtype), typed(inp, dtype), group=group, async_op=True)
                     for o in spares + [out]]
            for w in works:
                w.wait()
            for o in spares:  # the others are checked too: each must equal the last
                if not torch.equal(o, out):
                    out.fill_(0x5A)

        def coalesced(out, inp, dtype, group):
            n = inp.numel()
            elem = torch.tensor([], dtype=dtype).element_size()
            half = n // elem // 2 * elem  # whole elements in each half
            if half == 0:
                return single(out, inp, dtype, group)
            # Two gathers of the two halves, issued as one coalesced call (Megatron, DeepSpeed), then interleaved.
            outs = [torch.empty(world * half, dtype=torch.uint8, device=out.device),
                    torch.empty(world * (n - half), dtype=torch.uint8, device=out.device)]
            with dist._coalescing_manager(group=group, device=out.device, async_ops=True) as cm:
                GATHER_SINGLE(typed(outs[0], dtype), typed(inp[:half], dtype), group=group)
                GATHER_SINGLE(typed(outs[1], dtype), typed(inp[half:], dtype), group=group)
            cm.wait()
            for r in range(world):
                out[r * n:r * n + half].copy_(outs[0][r * half:(r + 1) * half])
                out[r * n + half:(r + 1) * n].copy_(outs[1][r * (n - half):(r + 1) * (n - half)])

        def list_coalesced(out, inp, dtype, group):
            n = inp.numel()
            # all_gather_coalesced is deprecated by torch; it is still a form users call, so it is checked quietly.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                # One list per rank, each with one tensor per input.
                dist.all_gather_coalesced([[typed(out[r * n:(r + 1) * n], dtype)] for r in range(world)],
                                          [typed(inp, dtype)], group=group)

        return [(SINGLE, single), (f"{SINGLE} in place", in_place), (f"{SINGLE} stacked", stacked),
                (f"{SINGLE} x{ASYNC_IN_FLIGHT} async", in_flight), (f"{SINGLE} coalesced", coalesced),
                ("all_gather", as_list), ("all_gather_coalesced", list_coalesced)]

    def sweep(self, body):
        """Runs a sweep (`body`); it stops at the first call that raises, since the ranks may then disagree on what
        comes next. True when no call raised on any rank."""
        try:
            body()
        except _StopSweep:
            pass
        for e in sum(self.gather_all(self.errors), []):
            self.fail(f"ERROR: {e}")
        return not self.errors

    def swept_call(self, key, call, *args):
        """`call(*args)`, which ends the sweep if it raises (reported with `key`, the call's name)."""
        self.watchdog.enter(f"sweep: {key}")
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001  (reported with the call; the ranks may now disagree)
            self.errors.append(f"{key}, rank {self.rank}: {type(e).__name__}: {e}"[:400])
            raise _StopSweep() from None

    def plants(self, name):
        """Whether this call is the one TORCH_SDMA_CHECK_PLANT_WRONG_BYTE names (its first, on the last rank)."""
        if self.plant == name and not self.planted and self.rank == self.world - 1:
            self.planted = True
            return True
        return False

    def _sweep(self):
        forms = self.forms()
        self.say(f"\n## Bit-exact sweep: {len(forms)} forms x {len(DTYPES)} dtypes x {len(SWEEP_BYTES)} sizes per "
                 f"group, {self.world} ranks")
        expected, inputs = {}, {}  # per byte count; every rank rebuilds every rank's input
        for group_name, group in self.groups:
            self.watchdog.enter(f"sweep, group {group_name}")
            paths, wrong = {}, []
            for form, call in forms:
                before = torch_sdma.stats(group)
                for dtype in DTYPES:
                    elem = torch.tensor([], dtype=dtype).element_size()
                    for size in SWEEP_BYTES:
                        n = max(1, size // elem) * elem
                        key = f"group {group_name}, {form}, {str(dtype).removeprefix('torch.')}, {n} B per rank"
                        if n not in expected:
                            expected[n] = expected_output(self.world, n, self.device)
                            inputs[n] = expected[n][self.rank * n:(self.rank + 1) * n].clone()
                        out = torch.full((self.world * n,), 0xA5, dtype=torch.uint8, device=self.device)
                        self.swept_call(key, call, out, inputs[n], dtype, group)
                        if self.plants(form):
                            out[0] ^= 0xFF
                        bad = first_wrong_byte(out, expected[n])
                        if bad:
                            wrong.append(f"{key}, rank {self.rank}: first wrong byte at {bad[0]} (from rank "
                                         f"{bad[0] // n}): {bad[1]}")
                paths[form] = path_moved(before, torch_sdma.stats(group))
            all_wrong = sum(self.gather_all(wrong), [])
            for w in all_wrong:
                self.fail(f"WRONG BYTES: {w}")
            verdict = "all bytes right" if not all_wrong else f"{len(all_wrong)} WRONG"
            # The path the group reports for the device it serves, as a user asks for it (no device named).
            reported = torch_sdma.group_path(group)
            self.say(f"group {group_name}: {verdict}; torch_sdma.group_path: {reported}")
            if group_name != "defaults" and not reported.startswith("dma"):
                self.fail(f"group {group_name} (TORCH_SDMA_MIN_BYTES=0): torch_sdma.group_path says {reported}")
            for form, path in paths.items():
                self.say(f"  {form:<34} -> {path}")
                if group_name != "defaults" and not path.startswith("dma"):
                    self.fail(f"group {group_name} (TORCH_SDMA_MIN_BYTES=0): {form} took {path}, not the DMA path")

    def exchange_sweep(self):
        """Every exchange op in the defaults and the every-size-on-DMA group."""
        ops = [op for op in Exchanges(self.rank, self.world, self.device, hashed_bytes).ops()
               if op[0] not in P2P_OPS or not self.p2p_skipped()]
        self.say(f"\n## Exchange sweep: {len(ops)} ops x {len(DTYPES)} dtypes x {len(EXCHANGE_BYTES)} sizes per "
                 f"group, {self.world} ranks")
        if self.p2p_skipped():
            self.say(f"point-to-point: skipped, {self.p2p_skipped()}")
        for group_name, group in self.groups[:2]:
            wrong, paths = [], {}
            for name, path_ops, call in ops:
                for dtype in DTYPES:
                    elem = torch.tensor([], dtype=dtype).element_size()
                    for size in EXCHANGE_BYTES:
                        n = max(1, size // elem) * elem
                        key = f"group {group_name}, {name}, {str(dtype).removeprefix('torch.')}, {n} B per pair"
                        pairs = self.swept_call(key, call, n, dtype, group)
                        if self.plants(name):
                            pairs[0][0][0] ^= 0xFF
                        for got, want in pairs:
                            bad = first_wrong_byte(got, want)
                            if bad:
                                wrong.append(f"{key}, rank {self.rank}: first wrong byte at {bad[0]}: {bad[1]}")
                                break
                paths[name] = {op: torch_sdma.group_path(group, op=op) for op in path_ops}
            all_wrong = sum(self.gather_all(wrong), [])
            for w in all_wrong:
                self.fail(f"WRONG BYTES: {w}")
            self.say(f"group {group_name}: {'all bytes right' if not all_wrong else f'{len(all_wrong)} WRONG'}")
            # A pipeline's first rank never receives: each op's path as the ranks that made it report it.
            every_rank = self.gather_all(paths)
            took = set()
            for name, path_ops in paths.items():
                per_op = {}
                for op in path_ops:
                    seen = [r[name][op] for r in every_rank if r[name][op] != "unknown"]
                    per_op[op] = " | ".join(dict.fromkeys(seen)) or "unknown"
                    took.add((name, per_op[op]))
                shown = (next(iter(per_op.values())) if len(per_op) == 1
                         else ", ".join(f"{op} {path}" for op, path in per_op.items()))
                self.say(f"  {name:<34} -> {shown}")
            inner = sorted({p for name, p in took if not p.startswith("dma")})
            if group_name != "defaults" and inner:
                # Not a failure: a machine may keep the exchanges off the DMA path for a reason it names.
                self.warnings.append(f"group {group_name}: exchanges took {', '.join(inner)}")
                self.say(f"  WARNING: with TORCH_SDMA_MIN_BYTES=0 the exchanges took {', '.join(inner)}")

    def p2p_skipped(self):
        """Why this run has no point-to-point ("" when it has)."""
        if self.world < 2:
            return "one rank"
        return ""

    # ------------------------------------------------------------------------------------------------- busbw
    def time_calls(self, fn, iters):
        return seconds_per_call(fn, iters, self.mode == "gpu")

    def slowest_medians(self, calls, iters):
        """Seconds per call of each of `calls` (name -> fn): the slowest rank's median over --rounds timed rounds,
        after one round that warms up, the calls alternating in order so that neither always runs first."""
        times = {k: [] for k in calls}
        for r in range(self.args.rounds + 1):
            for name, fn in (calls.items() if r % 2 == 0 else reversed(calls.items())):
                self.sync()
                t = self.time_calls(fn, iters if r else 1)
                if r:
                    times[name].append(t)
        # A collective ends when its last rank does.
        return {k: max(self.gather_all(statistics.median(v))) for k, v in times.items()}

    def raw_copies(self, n):
        """(RawCopies of n bytes per rank, ""), or (None, why) where the raw schedules cannot run."""
        if self.mode != "gpu":
            return None, "no GPUs (CPU tensors have no copy engines)"
        if self.world < 2:
            return None, "one rank, no peers"
        try:
            buf, peers, handle = symm_mem_peer_buffers(self.base_group, self.rank, self.world, self.world * n,
                                                       self.device)
        except Exception as e:  # an older torch or a machine without peer access
            return None, f"symmetric memory unavailable ({type(e).__name__})"
        return RawCopies(self.rank, self.world, n, buf, peers, keep=handle), ""

    def busbw(self):
        sizes = self.args.sizes or ([MIB, 64 * MIB, 256 * MIB] if self.mode == "gpu" else [64 * KIB, MIB, 16 * MIB])
        budget = (4 << 30) if self.mode == "gpu" else 256 * MIB
        w = self.world
        self.say(f"\n## busbw, {SINGLE} out of place, bf16; GB/s = out*(w-1)/w/t, median of {self.args.rounds} rounds; "
                 "ce-limit: the fastest raw schedule (below)")
        self.say(f"| output | sdma | {self.base_name} | sdma / {self.base_name} | ce-limit | sdma / ce-limit | path |")
        self.say("|---|---|---|---|---|---|---|")
        no_limit, raw_rows = "", []
        for size in sizes:
            self.watchdog.enter(f"busbw {human_bytes(size)}")
            n = max(2, size // w // 2 * 2)
            inp = hashed_bytes(self.rank, n, self.device).view(torch.bfloat16)
            out = torch.empty(w * n, dtype=torch.uint8, device=self.device).view(torch.bfloat16)
            iters = max(3, min(50, budget // (w * n)))
            calls = {"sdma": lambda: GATHER_SINGLE(out, inp),
                     self.base_name: lambda: GATHER_SINGLE(out, inp, group=self.base_group)}
            raw, why = self.raw_copies(n)
            match = {}
            if raw:
                for key in RAW_SCHEDULES:
                    calls[key] = raw.call(key)
                    match[key] = raw.check(calls[key], lambda: dist.barrier(group=self.control))
            else:
                no_limit = why
            before = torch_sdma.stats()
            med = self.slowest_medians(calls, iters)
            path = path_moved(before, torch_sdma.stats())
            bw = {k: w * n * (w - 1) / w / t / 1e9 for k, t in med.items()}
            lim_cells = "n/a | "
            if raw:
                right = self.raw_right(match)
                best = max(right, key=bw.get) if right else None
                if best:
                    lim_cells = f"{bw[best]:.3g} | {bw['sdma'] / bw[best]:.2f}"
                raw_rows.append((w * n, {k: bw[k] for k in RAW_SCHEDULES}, right, best))
            self.say(f"| {human_bytes(w * n)} | {bw['sdma']:.3g} | {bw[self.base_name]:.3g} | "
                     f"{bw['sdma'] / bw[self.base_name]:.2f} | {lim_cells} | {path} |")
            del raw
        self.raw_schedules_table(raw_rows, no_limit)
        self.exchange_busbw(sizes, budget)

    def raw_right(self, match):
        """The raw schedules whose copies left the right bytes on every rank; a warning names the others (a fault of
        the machine's peer copies, not of sdma)."""
        every_rank = self.gather_all(match)
        right = [k for k in RAW_SCHEDULES if all(r[k] for r in every_rank)]
        for k in RAW_SCHEDULES:
            if k not in right:
                self.warnings.append(f"raw schedule {RAW_SCHEDULES[k]}: wrong bytes after plain peer copies")
        return right

    def raw_schedules_table(self, rows, why):
        """busbw of each raw schedule per size, and which was the fastest (the ce-limit column above)."""
        if not rows:
            self.say(f"raw copy-engine schedules (ce-limit): n/a, {why}")
            return
        self.say("\n## Raw copy-engine schedules: each rank's n bytes into every peer's buffer, no ordering between "
                 "ranks, plain copies; busbw as an all-gather's, GB/s")
        self.say("| output | " + " | ".join(RAW_SCHEDULES.values()) + " | fastest |")
        self.say("|---|" + "---|" * (len(RAW_SCHEDULES) + 1))
        for out_bytes, bw, right, best in rows:
            cells = [f"{bw[k]:.3g}" + ("" if k in right else " WRONG") for k in RAW_SCHEDULES]
            self.say(f"| {human_bytes(out_bytes)} | " + " | ".join(cells) + f" | {RAW_SCHEDULES.get(best, 'none')} |")

    def exchange_busbw(self, sizes, budget):
        """The exchanges against the inner backend's own, in the every-size-on-DMA group: GB/s = the bytes one rank
        sends or receives across the links / t (nccl-tests' busbw)."""
        exchanges = Exchanges(self.rank, self.world, self.device, hashed_bytes)
        dma_group = self.groups[1][1]
        self.say(f"\n## busbw, exchanges, bf16; bytes: to each peer (all_to_all_single), the tensor (broadcast), each "
                 f"rank's piece (gather, scatter), each rank's send (point-to-point); median of {self.args.rounds} "
                 f"rounds")
        self.say(f"| op | bytes | sdma | {self.base_name} | sdma / {self.base_name} | path |")
        self.say("|---|---|---|---|---|---|")
        ops = ["all_to_all_single", "broadcast", "gather", "scatter"] + (list(P2P_OPS) if not self.p2p_skipped()
                                                                         else [])
        for op in ops:
            for size in sizes:
                self.watchdog.enter(f"busbw {op} {human_bytes(size)}")
                n = max(2, size // self.world // 2 * 2)
                sdma, moved = exchanges.timed_call(op, n, dma_group)
                base, _ = exchanges.timed_call(op, n, self.base_group)
                iters = max(3, min(50, budget // (self.world * n)))
                med = self.slowest_medians({"sdma": sdma, self.base_name: base}, iters)
                bw = {k: moved / t / 1e9 for k, t in med.items()}
                if op in P2P_OPS:  # the first rank of a pipeline only sends
                    path = ", ".join(f"{p} {torch_sdma.group_path(dma_group, op=p)}" for p in ("send", "recv"))
                else:
                    path = torch_sdma.group_path(dma_group, op=op)
                self.say(f"| {op} | {human_bytes(n)} | {bw['sdma']:.3g} | {bw[self.base_name]:.3g} | "
                         f"{bw['sdma'] / bw[self.base_name]:.2f} | {path} |")

    def run(self):
        self.registration()
        self.hardware_queues()
        if self.sweep(self._sweep) and self.sweep(self.exchange_sweep) and not self.args.skip_busbw:
            if self.args.share_gpu and self.mode == "gpu":
                # NCCL refuses two ranks on one GPU, and ranks that time-slice one GPU's engines time nothing.
                self.say("busbw: skipped, ranks share GPUs (--share-gpu)")
            else:
                self.busbw()
        self.watchdog.enter("report")
        failures = self.gather_all(self.failures)
        unique = list(dict.fromkeys(sum(failures, [])))
        self.say("")
        for f in unique:
            self.say(f"FAIL: {f}")
        self.say(f"torch_sdma.check: {'FAIL' if unique else 'PASS'}" + (f", {len(self.warnings)} warning(s)"
                                                                      if self.warnings else ""))
        if self.args.report and self.rank == 0:
            with open(self.args.report, "w") as f:
                f.write("\n".join(self.lines) + "\n")
        dist.destroy_process_group()
        return 1 if unique else 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m torch_sdma.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu: CUDA tensors against NCCL; cpu: CPU tensors against gloo; auto: gpu if one is visible")
    p.add_argument("--timeout", type=float, default=120, help="seconds any one step may take before it is a hang")
    p.add_argument("--sizes", type=lambda s: [parse_bytes(x) for x in s.split(",")],
                   help="busbw output sizes, e.g. 64K,1M,16M (default: 1M,64M,256M on GPUs, 64K,1M,16M on CPU)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per size and backend")
    p.add_argument("--skip-busbw", action="store_true", help="the registration, paths and bit-exact sweep only")
    p.add_argument("--share-gpu", action="store_true", default=os.environ.get("SDMA_TEST_SHARE_GPU") == "1",
                   help="more ranks than GPUs, ranks placed round-robin (correctness only: no busbw, since NCCL "
                        "refuses two ranks on one GPU); also set by SDMA_TEST_SHARE_GPU=1")
    p.add_argument("--report", help="also write the report to this file (rank 0)")
    p.add_argument("--nproc", type=int, help="outside torchrun: ranks to start (default: GPUs, or 2 without)")
    return p.parse_args(argv)


def launch(args, argv):
    """Outside torchrun: start one rank per GPU (2 on CPU) under torchrun, with the same arguments."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or gpus or 2
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "torch_sdma.check", *argv]
    print("torch_sdma.check: " + " ".join(["torchrun"] + cmd[3:]), flush=True)
    # One thread per rank unless the caller chose: torchrun otherwise prints a banner saying it set that.
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env).returncode


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" not in os.environ:
        return launch(args, argv)
    return Check(args).run()


if __name__ == "__main__":
    sys.exit(main())
