"""Every all-gather a user could pick instead of sdma, for examples/bench_allgather.py --peers.

Each peer is set up the way its own documentation asks, checked for the bytes it produces, and timed in the same
run as sdma, out of place and in place where it has the form. A peer the installed torch, NCCL or machine lacks
shows "n/a" and why.

- nccl:        torch's NCCL backend as it comes (the bench's baseline group).
- nccl-ce:     NCCL's zero-CTA copy-engine all-gather (NCCL >= 2.28): NCCL_CTA_POLICY=2, cta_policy ZERO in the
               group's config, input and output from NCCL's memory pool registered as symmetric windows, issued from
               a side stream. NCCL reads the variable once per process, so this peer runs in processes of its own:
               every bench rank starts this file as a script and waits for it.
- symm-mem-ce: torch symmetric memory's copy-engine all-gather (torch.ops.symm_mem._low_contention_all_gather):
               input in symmetric memory, waited for with wait_tensor (it runs on a stream of its own);
               out of place only, it returns a new tensor.
- ce-limit:    not an all-gather: the raw copy-engine schedules (torch_sdma.check.RAW_SCHEDULES) between the ranks'
               buffers (mapped by torch symmetric memory, VMM), plain copies, no ordering between ranks: each rank
               pushes its input into every peer's memory in rank order or rotated on one stream, or with a stream
               per peer, or pulls every peer's part with a stream per peer. Each is timed, checked and reported;
               the fastest is ce-limit: what these links and engines do with these bytes.
- ce-limit-ipc: the pushes with a stream per peer into peers' caching-allocator memory mapped with legacy CUDA IPC,
               the mapping a direct path into users' own buffers would use.
Data: bytes hashed from (position, rank), so every rank checks every rank's part.
"""
import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

FORMS = ("out", "in")
# torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single (the same call underneath). Not taken
# from torch_sdma: the nccl-ce processes must not load it (the import sets CUDA_DEVICE_MAX_CONNECTIONS).
GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def hashed_bytes(rank, n, device):
    """Rank `rank`'s input of n bytes: a hash of (position, rank), so that every rank rebuilds every rank's input."""
    x = torch.arange(n, dtype=torch.int64, device=device) * 0x9E3779B1 + 7919 * (rank + 1)
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x ^= x >> 12
    return (x & 0xFF).to(torch.uint8)


def gpu_seconds_per_call(fn, iters):
    """Seconds per call of `fn` (which enqueues on the current stream), by CUDA events around `iters` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def expected_output(world, n_bytes, device):
    return torch.cat([hashed_bytes(r, n_bytes, device) for r in range(world)])


def as_bf16(t):
    return t.view(torch.bfloat16)


class Buffers:
    """One size's input and output, filled for a form: out of place, or in place (the input is the output's own
    slot)."""

    def __init__(self, rank, world, n_bytes, alloc):
        self.rank, self.world, self.n = rank, world, n_bytes
        self.out = alloc(world * n_bytes)
        self.inp = alloc(n_bytes)

    def input_for(self, form):
        return self.out[self.rank * self.n:(self.rank + 1) * self.n] if form == "in" else self.inp

    def fill(self, form):
        self.out.fill_(0xA5)  # poison: an unwritten byte shows
        self.input_for(form).copy_(hashed_bytes(self.rank, self.n, self.out.device))


def symm_mem_unavailable():
    if not torch.cuda.is_available():
        return "needs CUDA tensors"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    return ""


class InProcessPeer:
    """A peer that runs in the bench's own processes: name, forms, why it is n/a, and one call per form."""

    def __init__(self, name, forms, why_not=""):
        self.name, self.forms, self.why_not = name, forms, why_not

    def prepare(self, n_bytes):
        """Buffers for one size; returns {form: (call, check)}: call() enqueues one all-gather, check() -> bool."""
        raise NotImplementedError


class GroupPeer(InProcessPeer):
    """A process group's all_gather_single (all_gather_into_tensor before torch 2.14), both forms."""

    def __init__(self, name, group, rank, world, device):
        super().__init__(name, FORMS)
        self.group, self.rank, self.world, self.device = group, rank, world, device

    def prepare(self, n_bytes):
        bufs = Buffers(self.rank, self.world, n_bytes, lambda k: torch.empty(k, dtype=torch.uint8, device=self.device))
        expected = expected_output(self.world, n_bytes, self.device)
        calls = {}
        for form in self.forms:
            def call(form=form):
                GATHER_SINGLE(as_bf16(bufs.out), as_bf16(bufs.input_for(form)), group=self.group)

            def check(form=form, call=call):
                bufs.fill(form)
                call()
                return torch.equal(bufs.out, expected)
            calls[form] = (call, check)
        return calls


class SymmMemAllGather(InProcessPeer):
    def __init__(self, group, rank, world, device):
        why = symm_mem_unavailable()
        if not why and not hasattr(getattr(torch.ops, "symm_mem", None), "_low_contention_all_gather"):
            why = f"torch {torch.__version__} has no torch.ops.symm_mem._low_contention_all_gather"
        if not why and not hasattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor"):
            why = f"torch {torch.__version__} has no torch.ops._c10d_functional.wait_tensor to wait for the op"
        super().__init__("symm-mem-ce", ("out",), why)
        self.group, self.rank, self.world, self.device = group, rank, world, device
        if not why:
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            enable_symm_mem_for_group(group.group_name)

    def prepare(self, n_bytes):
        import torch.distributed._symmetric_memory as symm_mem
        name = self.group.group_name
        # The input in symmetric memory, as the op's documentation asks: then every rank pulls straight from the
        # peers' inputs with copy-engine copies. Given any other tensor, the op finds no symmetric allocation
        # (and warns at every call), copies the input into a workspace of its own first, and gathers from there.
        inp = symm_mem.empty(n_bytes, dtype=torch.uint8, device=self.device)
        symm_mem.rendezvous(inp, name)
        # No barrier needed before peers read it: the op's backend stream waits for this stream, then for a
        # barrier of all ranks, before it pulls.
        inp.copy_(hashed_bytes(self.rank, n_bytes, self.device))
        expected = expected_output(self.world, n_bytes, self.device)

        def call():
            # The op enqueues its barriers and copies on symmetric memory's own backend stream, not the current one,
            # and registers them as the output's work: wait_tensor makes the current stream wait for them (and
            # retires the work). Without it a check reads the output before its bytes arrive, and the timing events
            # on the current stream see only the enqueueing.
            out = torch.ops.symm_mem._low_contention_all_gather(as_bf16(inp), name)
            return torch.ops._c10d_functional.wait_tensor(out)

        def check():
            return torch.equal(call().view(torch.uint8), expected)
        return {"out": (call, check)}


class CopyEngineLimit(InProcessPeer):
    """The raw copy-engine schedules (torch_sdma.check.RAW_SCHEDULES), one form each, between the ranks' buffers
    mapped by torch symmetric memory; the bench reports the fastest as ce-limit. `schedules` narrows them (the
    subclass keeps one, as its form "out")."""

    def __init__(self, group, rank, world, device, name="ce-limit", why_not=None, schedules=None):
        why = symm_mem_unavailable() if why_not is None else why_not
        if not why and world < 2:
            why = "one rank, no peers"
        # torch_sdma.check here, not at the top: the nccl-ce processes run this file and must not import torch_sdma.
        from torch_sdma.check import RAW_SCHEDULES
        self.schedules = schedules or tuple(RAW_SCHEDULES)
        super().__init__(name, self.schedules, why)
        self.group, self.rank, self.world, self.device = group, rank, world, device

    def map_peers(self, nbytes):
        """This rank's buffer of `nbytes`, every peer's mapped here ({peer: buffer}), and what keeps them mapped."""
        from torch_sdma.check import symm_mem_peer_buffers
        return symm_mem_peer_buffers(self.group, self.rank, self.world, nbytes, self.device)

    def prepare(self, n_bytes):
        from torch_sdma.check import RawCopies
        buf, peers, keep = self.map_peers(self.world * n_bytes)
        raw = RawCopies(self.rank, self.world, n_bytes, buf, peers, keep)
        calls = {}
        for form, schedule in zip(self.forms, self.schedules):
            call = raw.call(schedule)
            calls[form] = (call, lambda call=call: raw.check(call, lambda: dist.barrier(group=self.group)))
        return calls


class CopyEngineLimitLegacyIpc(CopyEngineLimit):
    """The ce-limit pushes again, a stream per peer, into peers' memory from torch's caching allocator (cudaMalloc
    segments) mapped with legacy CUDA IPC (torch.multiprocessing's own sharing): what a direct path into users' own
    buffers would get. The staging area is VMM memory; legacy IPC mappings of it pushed more slowly on H200
    (docs/api.md)."""

    def __init__(self, group, rank, world, device):
        super().__init__(group, rank, world, device, "ce-limit-ipc",
                         "" if torch.cuda.is_available() else "needs CUDA tensors", schedules=("per-peer",))
        self.forms = ("out",)

    def map_peers(self, nbytes):
        from torch.multiprocessing.reductions import reduce_tensor
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        shared = [None] * self.world
        dist.all_gather_object(shared, reduce_tensor(buf), group=self.group)
        peers = {}
        for p in range(self.world):
            if p != self.rank:
                rebuild, args = shared[p]
                args = list(args)
                args[6] = self.device.index  # rebuild_cuda_tensor's storage_device: the peer's memory, seen from here
                peers[p] = rebuild(*args)
        return buf, peers, None


def nccl_ce_unavailable():
    if not torch.cuda.is_available():
        return "needs CUDA tensors"
    if not hasattr(dist, "ProcessGroupNCCL") or not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
        return (f"torch {torch.__version__} cannot ask NCCL for its zero-CTA policy "
                "(ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO)")
    version = torch.cuda.nccl.version()
    if tuple(version[:2]) < (2, 28):
        return f"NCCL {'.'.join(map(str, version))} has no copy-engine collectives (2.28 or later)"
    return symm_mem_unavailable()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nccl_ce(rank, world, local_rank, sizes, rounds, iters_for, out_json, port, timeout_s=300):
    """Starts this file as the nccl-ce peer in a process of its own (one per bench rank, all at once) and waits.
    Returns its results on rank 0 ({size: {form: {"seconds", "match"}}}), {} on the others, or {"error": why}."""
    # Not torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE would make rank 0 wait for a server nobody runs):
    # a store of their own on `port`.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), NCCL_CTA_POLICY="2")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sizes", ",".join(map(str, sizes)),
           "--rounds", str(rounds), "--iters", ",".join(str(iters_for(s)) for s in sizes), "--out", str(out_json)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"nccl-ce processes did not finish within {timeout_s} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"nccl-ce processes exited with {proc.returncode}: {' | '.join(tail)}"}
    # Rank 0 of the peer's processes writes the slowest rank's figures.
    return json.loads(Path(out_json).read_text()) if rank == 0 else {}


def nccl_ce_main():
    """The nccl-ce peer's own processes: NCCL_CTA_POLICY=2 is set for them alone."""
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True)
    p.add_argument("--iters", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    dist.init_process_group("nccl", pg_options=opts, device_id=device)
    import torch.distributed._symmetric_memory as symm_mem
    symm_mem.set_backend("NCCL")
    pool = symm_mem.get_mem_pool(device)
    side = torch.cuda.Stream()  # from the legacy default stream NCCL's copy-engine path refuses ("invalid argument")
    results = {}
    # Everything on `side`, the expected bytes and the buffers too: torch's streams do not wait for the legacy
    # default stream, so bytes written there could still be in flight when a check on `side` reads them.
    with torch.cuda.stream(side):
        for size, iters in zip(map(int, a.sizes.split(",")), map(int, a.iters.split(","))):
            n = size // world
            with torch.cuda.use_mem_pool(pool):
                bufs = Buffers(rank, world, n, lambda k: torch.empty(k, dtype=torch.uint8, device=device))
            symm_mem.rendezvous(bufs.out, dist.group.WORLD.group_name)
            symm_mem.rendezvous(bufs.inp, dist.group.WORLD.group_name)
            expected = expected_output(world, n, device)
            results[str(size)] = {}
            for form in FORMS:
                def call(form=form, bufs=bufs):
                    GATHER_SINGLE(as_bf16(bufs.out), as_bf16(bufs.input_for(form)))
                bufs.fill(form)
                call()
                match = torch.equal(bufs.out, expected)
                times = []
                for _ in range(a.rounds):
                    torch.cuda.synchronize()
                    dist.barrier()
                    times.append(gpu_seconds_per_call(call, iters))
                # A call is done when the slowest rank is; a mismatch on any rank is a mismatch.
                worst = torch.tensor([sorted(times)[len(times) // 2], float(not match)], device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                results[str(size)][form] = {"seconds": worst[0].item(), "match": worst[1].item() == 0}
            del bufs, expected
    if rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    nccl_ce_main()
