"""The exchanges of examples/bench_exchange.py (all_to_all_single with even splits, broadcast, gather, scatter, and
point-to-point: a ring by batch_isend_irecv, a send/recv pipeline): their buffers, the bytes each rank must end with,
and the peers that run in processes of their own.

Data: bytes hashed from (position, rank) (allgather_peers.hashed_bytes), so every rank rebuilds what it must receive;
outputs are poisoned before a checked call. The root of broadcast, gather and scatter is rank 0. Per-rank bytes n:
all_to_all_single sends n/world to each rank, broadcast moves n from the root, gather brings n from each rank to the
root, scatter sends n to each rank from the root. batch_isend_irecv_ring: each rank sends n to rank+1 and receives n
from rank-1 in one batch (context parallelism's ring); send_recv_pipeline: rank r receives n from r-1, then sends n
to r+1 (a pipeline's forward pass; the first rank only sends, the last only receives).

Run as a script, this file is one of two peers, in processes of their own, one per bench rank (each reads its
settings once per process, and neither may share a process with torch_sdma, whose import sets
CUDA_DEVICE_MAX_CONNECTIONS):
- nccl-ce:  NCCL's zero-CTA (copy-engine) policy: NCCL_CTA_POLICY=2, cta_policy ZERO in the group's config, buffers
            from NCCL's memory pool registered as symmetric windows (torch symmetric memory, backend NCCL), calls
            from a side stream. NCCL (>= 2.28) has copy-engine AlltoAll, Gather and Scatter, no Broadcast;
            torch's NCCL backend calls ncclAlltoAll (even splits) and ncclGather, and scatter as send/recv.
- symm-mem: torch symmetric memory's own collectives on NVSHMEM (torch.ops.symm_mem.nvshmem_all_to_all and
            nvshmem_broadcast, kernels on SMs); it has no gather or scatter.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from allgather_peers import gpu_seconds_per_call, hashed_bytes, symm_mem_unavailable

P2P_OPS = ("batch_isend_irecv_ring", "send_recv_pipeline")
OPS = ("all_to_all_single", "broadcast", "gather", "scatter", *P2P_OPS)
ROOT = 0
POISON = 0xA5
# Never let a launched process touch NVLink multicast (it can take a shared host's GPUs out of service).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def bus_bytes(op, n, world):
    """Bytes per rank that cross between ranks in one call, as nccl-tests counts bus bandwidth: (world-1)/world of
    the whole buffer for all-to-all, gather and scatter (world * n at the root), n for broadcast and for
    point-to-point (sendrecv's count: the bytes each rank sends)."""
    if op == "broadcast" or op in P2P_OPS:
        return n
    whole = n if op == "all_to_all_single" else n * world
    return whole * (world - 1) // world


class OpBuffers:
    """One op's buffers for n bytes per rank (n a multiple of world for all_to_all_single), from alloc(bytes)."""

    def __init__(self, op, rank, world, n, device, alloc):
        self.op, self.rank, self.world, self.n, self.device = op, rank, world, n, device
        self.root = rank == ROOT
        # Every rank allocates the same buffers, root or not (the root's list of gather or scatter is unused
        # elsewhere): symmetric memory's rendezvous needs the same allocations in the same order on every rank.
        in_bytes, out_bytes = {"gather": (n, n * world), "scatter": (n * world, n)}.get(op, (n, n))
        self.inp = alloc(in_bytes)
        self.out = self.inp if op == "broadcast" else alloc(out_bytes)
        self.registered = [self.inp] if op == "broadcast" else [self.inp, self.out]

    @property
    def prev(self):
        return (self.rank - 1) % self.world

    @property
    def next(self):
        return (self.rank + 1) % self.world

    def receives(self):
        return self.op != "send_recv_pipeline" or self.rank > 0

    def source_bytes(self):
        """What this rank sends: its own hashed bytes; for broadcast and scatter only the root's count."""
        if self.op == "scatter":
            return hashed_bytes(ROOT, self.n * self.world, self.device)
        return hashed_bytes(ROOT if self.op == "broadcast" else self.rank, self.n, self.device)

    def expected(self):
        if self.op in P2P_OPS:  # from the previous rank; the pipeline's first rank receives nothing
            return hashed_bytes(self.prev, self.n, self.device) if self.receives() else None
        if self.op == "all_to_all_single":
            c = self.n // self.world
            return torch.cat([hashed_bytes(q, self.n, self.device)[self.rank * c:(self.rank + 1) * c]
                              for q in range(self.world)])
        if self.op == "broadcast":
            return hashed_bytes(ROOT, self.n, self.device)
        if self.op == "gather":  # only the root receives
            return torch.cat([hashed_bytes(q, self.n, self.device) for q in range(self.world)]) if self.root else None
        return hashed_bytes(ROOT, self.n * self.world, self.device)[self.rank * self.n:(self.rank + 1) * self.n]

    def fill(self):
        """Poison the output, then write the input (for broadcast, the root's buffer is both)."""
        self.out.fill_(POISON)
        if self.op != "broadcast" or self.root:
            self.inp.copy_(self.source_bytes())

    def matches(self):
        expected = self.expected()
        return expected is None or torch.equal(self.out, expected)

    def call(self, group=None, async_op=False):
        """The op through torch.distributed on `group`."""
        kw = {"group": group, "async_op": async_op}
        if self.op in P2P_OPS:
            return self.p2p_call(group, async_op)
        if self.op == "all_to_all_single":
            return dist.all_to_all_single(self.out, self.inp, **kw)
        if self.op == "broadcast":
            return dist.broadcast(self.out, src=self.global_root(group), **kw)
        if self.op == "gather":
            outs = list(self.out.chunk(self.world)) if self.root else None
            return dist.gather(self.inp, outs, dst=self.global_root(group), **kw)
        ins = list(self.inp.chunk(self.world)) if self.root else None
        return dist.scatter(self.out, ins, src=self.global_root(group), **kw)

    def p2p_call(self, group, async_op):
        """The ring or the pipeline; async, a Work-like whose wait() waits for every op of this rank."""
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        if self.op == "batch_isend_irecv_ring":
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, self.inp, peer(self.next), group),
                                            dist.P2POp(dist.irecv, self.out, peer(self.prev), group)])
        elif async_op:
            works = ([dist.irecv(self.out, src=peer(self.prev), group=group)] if self.rank > 0 else []) + \
                    ([dist.isend(self.inp, dst=peer(self.next), group=group)] if self.rank < self.world - 1 else [])
        else:
            if self.rank > 0:
                dist.recv(self.out, src=peer(self.prev), group=group)
            if self.rank < self.world - 1:
                dist.send(self.inp, dst=peer(self.next), group=group)
            return None
        if async_op:
            return AllWorks(works)
        for work in works:
            work.wait()
        return None

    @staticmethod
    def global_root(group):
        return ROOT if group is None else dist.get_global_rank(group, ROOT)

    def check(self, call):
        """Fill, run `call` once, wait for the device, compare: True when this rank holds the right bytes."""
        self.fill()
        call()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return self.matches()


class AllWorks:
    """The Works of one rank's point-to-point ops as one."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for work in self.works:
            work.wait()
        return True


def peer_unavailable(peer, op):
    """Why `peer` cannot run `op` on this machine ("" when it can)."""
    why = symm_mem_unavailable()
    if why:
        return why
    if op in P2P_OPS:
        return ("not run: NCCL's own send/recv is the nccl row" if peer == "nccl-ce"
                else "torch symmetric memory has no send/recv op")
    if peer == "nccl-ce":
        if not hasattr(dist, "ProcessGroupNCCL") or not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
            return f"torch {torch.__version__} cannot ask NCCL for its zero-CTA policy"
        version = torch.cuda.nccl.version()
        if tuple(version[:2]) < (2, 28):
            return f"NCCL {'.'.join(map(str, version))} has no copy-engine collectives (2.28 or later)"
        if op == "broadcast":
            return "NCCL has no copy-engine broadcast"
        if op == "scatter":
            # Seen in torch 2.14's libtorch_cuda: it links ncclGather and ncclAlltoAll, no ncclScatter.
            return (f"torch {torch.__version__}'s NCCL backend issues scatter as NCCL send/recv, not ncclScatter: "
                    f"outside NCCL's copy-engine path")
        return ""
    import torch.distributed._symmetric_memory as symm_mem
    if not symm_mem.is_nvshmem_available():
        return "torch symmetric memory's NVSHMEM backend is not available"
    if op in ("gather", "scatter"):
        return f"torch symmetric memory has no {op}"
    return ""


def run_peer(peer, rank, world, local_rank, ops, sizes, iters, rounds, out_json, port, timeout_s=600):
    """Starts this file as `peer` in a process of its own (one per bench rank, all at once) and waits. Returns its
    results on rank 0 ({op: {size: {"seconds", "match"}}}), {} on the others, or {"error": why}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")} | NO_MULTICAST
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    if peer == "nccl-ce":
        env["NCCL_CTA_POLICY"] = "2"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--peer", peer, "--ops", ",".join(ops),
           "--sizes", ",".join(map(str, sizes)), "--iters", ",".join(map(str, iters)), "--rounds", str(rounds),
           "--out", str(out_json)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"{peer} processes did not finish within {timeout_s} s"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"{peer} processes exited with {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(Path(out_json).read_text()) if rank == 0 else {}


def symm_mem_call(bufs, group_name):
    """The op as torch symmetric memory's NVSHMEM collective (input and output in symmetric memory)."""
    if bufs.op == "all_to_all_single":
        return lambda: torch.ops.symm_mem.nvshmem_all_to_all(bufs.inp, bufs.out, group_name)
    return lambda: torch.ops.symm_mem.nvshmem_broadcast(bufs.out, ROOT, group_name)


def peer_main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=["nccl-ce", "symm-mem"], required=True)
    p.add_argument("--ops", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--iters", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    import torch.distributed._symmetric_memory as symm_mem
    opts = None
    if a.peer == "nccl-ce":
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    dist.init_process_group("nccl", pg_options=opts, device_id=device)
    group_name = dist.group.WORLD.group_name
    symm_mem.set_backend("NCCL" if a.peer == "nccl-ce" else "NVSHMEM")
    if a.peer == "nccl-ce":
        pool = symm_mem.get_mem_pool(device)

        def alloc(k):
            with torch.cuda.use_mem_pool(pool):
                return torch.empty(k, dtype=torch.uint8, device=device)
    else:
        def alloc(k):
            return symm_mem.empty(k, dtype=torch.uint8, device=device)
    # From a side stream: NCCL's copy-engine path refuses the legacy default stream. Everything on it, so that no
    # byte written on another stream is still in flight when a check reads it.
    side = torch.cuda.Stream()
    results = {}
    with torch.cuda.stream(side):
        for op in a.ops.split(","):
            results[op] = {}
            for size, iters in zip(map(int, a.sizes.split(",")), map(int, a.iters.split(","))):
                bufs = OpBuffers(op, rank, world, size, device, alloc)
                for t in bufs.registered:
                    symm_mem.rendezvous(t, group_name)
                call = (lambda b=bufs: b.call()) if a.peer == "nccl-ce" else symm_mem_call(bufs, group_name)
                dist.barrier()
                match = bufs.check(call)
                times = []
                for _ in range(a.rounds):
                    torch.cuda.synchronize()
                    dist.barrier()
                    times.append(gpu_seconds_per_call(call, iters))
                worst = torch.tensor([sorted(times)[len(times) // 2], float(not match)], device=device)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                results[op][str(size)] = {"seconds": worst[0].item(), "match": worst[1].item() == 0}
                del bufs
    if rank == 0:
        Path(a.out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    peer_main()
