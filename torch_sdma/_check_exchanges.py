"""The exchanges of torch_sdma.check: every exchange op torch offers, point-to-point among them (a ring by
batch_isend_irecv, as context parallelism makes it, and a one-directional send/recv pipeline), as calls whose outputs
each rank compares byte for byte with what it rebuilds of every rank's input, and the calls its busbw table times.

Each rank's bytes for a peer are a hash of (sender, receiver), so every rank knows what every pair moved. The
uneven all-to-all's splits come from the pair too, zeros among them, so that ranks agree on them without talking."""
import torch
import torch.distributed as dist

ASYNC_IN_FLIGHT = 4
POISON = 0xA5
# The point-to-point ops: name -> method of Exchanges; group_path names their paths by send and recv.
P2P_OPS = {"batch_isend_irecv ring": "ring", "send/recv pipeline": "pipeline"}
P2P_PATH_OPS = ("send", "recv")


def uneven_elements(src, dst, m):
    """Elements `src` sends `dst` in the uneven all-to-all: 0, m or 2m, by the pair (a zero in every group of 2+)."""
    return 0 if (src + 2 * dst) % 3 == 1 else m * (1 + (src + dst) % 2)


class Exchanges:
    """call(n, dtype, group) -> [(got, expected)] uint8 pairs on this rank, for n bytes per rank and pair (the
    uneven all-to-all: up to 2n). The groups span every rank, so group ranks are global ranks."""

    def __init__(self, rank, world, device, hashed_bytes):
        self.rank, self.world, self.device, self.hashed = rank, world, device, hashed_bytes

    def piece(self, src, dst, n):
        """The n bytes rank `src` sends rank `dst`."""
        return self.hashed(1000 + src * self.world + dst, n, self.device)

    def poisoned(self, n):
        return torch.full((n,), POISON, dtype=torch.uint8, device=self.device)

    def ops(self):
        """(name, ops for group_path, call); the point-to-point ones only where there is a peer."""
        ops = [("all_to_all_single", ("all_to_all_single",), self.all_to_all_even),
               ("all_to_all_single uneven", ("all_to_all_single",), self.all_to_all_uneven),
               (f"all_to_all_single x{ASYNC_IN_FLIGHT} async", ("all_to_all_single",), self.all_to_all_in_flight),
               ("all_to_all", ("all_to_all",), self.all_to_all_lists),
               ("broadcast", ("broadcast",), self.broadcast),
               ("gather", ("gather",), self.gather),
               ("scatter", ("scatter",), self.scatter)]
        if self.world > 1:
            ops += [(name, P2P_PATH_OPS, getattr(self, method)) for name, method in P2P_OPS.items()]
        return ops

    def _all_to_all_single(self, send, recv, dtype, group, splits, async_op=False):
        """send[p] / recv[p]: bytes to / from rank p. Returns (output, work, expected)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        inp = torch.cat([self.piece(self.rank, p, send[p]) for p in range(self.world)])
        out = self.poisoned(sum(recv))
        work = dist.all_to_all_single(out.view(dtype), inp.view(dtype),
                                      output_split_sizes=[b // elem for b in recv] if splits else None,
                                      input_split_sizes=[b // elem for b in send] if splits else None,
                                      group=group, async_op=async_op)
        return out, work, torch.cat([self.piece(p, self.rank, recv[p]) for p in range(self.world)])

    def all_to_all_even(self, n, dtype, group):
        out, _, want = self._all_to_all_single([n] * self.world, [n] * self.world, dtype, group, splits=False)
        return [(out, want)]

    def all_to_all_uneven(self, n, dtype, group):
        elem = torch.tensor([], dtype=dtype).element_size()
        m = n // elem
        send = [uneven_elements(self.rank, p, m) * elem for p in range(self.world)]
        recv = [uneven_elements(p, self.rank, m) * elem for p in range(self.world)]
        out, _, want = self._all_to_all_single(send, recv, dtype, group, splits=True)
        return [(out, want)]

    def all_to_all_in_flight(self, n, dtype, group):
        calls = [self._all_to_all_single([n] * self.world, [n] * self.world, dtype, group, splits=False,
                                         async_op=True) for _ in range(ASYNC_IN_FLIGHT)]
        for _, work, _ in calls:
            work.wait()
        return [(out, want) for out, _, want in calls]

    def all_to_all_lists(self, n, dtype, group):
        outs = [self.poisoned(n) for _ in range(self.world)]
        dist.all_to_all([o.view(dtype) for o in outs],
                        [self.piece(self.rank, p, n).view(dtype) for p in range(self.world)], group=group)
        return [(outs[p], self.piece(p, self.rank, n)) for p in range(self.world)]

    def broadcast(self, n, dtype, group):
        root = self.world - 1
        t = self.piece(root, root, n) if self.rank == root else self.poisoned(n)
        dist.broadcast(t.view(dtype), src=root, group=group)
        return [(t, self.piece(root, root, n))]

    def gather(self, n, dtype, group):
        root = 0
        t = self.piece(self.rank, root, n)
        outs = [self.poisoned(n) for _ in range(self.world)] if self.rank == root else None
        dist.gather(t.view(dtype), [o.view(dtype) for o in outs] if outs else None, dst=root, group=group)
        if outs is None:  # a sender: its input is untouched
            return [(t, self.piece(self.rank, root, n))]
        return [(outs[p], self.piece(p, root, n)) for p in range(self.world)]

    def scatter(self, n, dtype, group):
        root = self.world - 1
        out = self.poisoned(n)
        pieces = [self.piece(root, p, n).view(dtype) for p in range(self.world)] if self.rank == root else None
        dist.scatter(out.view(dtype), pieces, src=root, group=group)
        return [(out, self.piece(root, self.rank, n))]

    def ring(self, n, dtype, group):
        """Each rank sends to the next and receives from the previous in one batch (context parallelism's ring)."""
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        out = self.poisoned(n)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, self.piece(self.rank, nxt, n).view(dtype), nxt, group),
                                        dist.P2POp(dist.irecv, out.view(dtype), prev, group)])
        for work in works:
            work.wait()
        return [(out, self.piece(prev, self.rank, n))]

    def pipeline(self, n, dtype, group):
        """Rank r receives from r-1, then sends to r+1 (pipeline parallelism's forward pass)."""
        pairs = []
        if self.rank > 0:
            out = self.poisoned(n)
            dist.recv(out.view(dtype), src=self.rank - 1, group=group)
            pairs.append((out, self.piece(self.rank - 1, self.rank, n)))
        if self.rank < self.world - 1:
            t = self.piece(self.rank, self.rank + 1, n)
            dist.send(t.view(dtype), dst=self.rank + 1, group=group)
            pairs.append((t, self.piece(self.rank, self.rank + 1, n)))  # a sender's input is untouched
        return pairs

    def timed_call(self, op, n, group):
        """A call of `op` that moves n bytes per rank and pair (bf16), for the busbw table, and the bytes its busbw
        counts: what one rank sends or receives across the links, as nccl-tests count it (sendrecv: the bytes each
        rank sends, for the ring and the pipeline alike)."""
        w = self.world
        dtype = torch.bfloat16
        if op in P2P_OPS:
            nxt, prev = (self.rank + 1) % w, (self.rank - 1) % w
            inp, out = self.piece(self.rank, nxt, n).view(dtype), self.poisoned(n).view(dtype)
            if P2P_OPS[op] == "ring":
                def ring():
                    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt, group),
                                                        dist.P2POp(dist.irecv, out, prev, group)]):
                        work.wait()
                return ring, n

            def pipeline():
                if self.rank > 0:
                    dist.recv(out, src=prev, group=group)
                if self.rank < w - 1:
                    dist.send(inp, dst=nxt, group=group)
            return pipeline, n
        if op == "all_to_all_single":
            inp, out = self.piece(self.rank, 0, w * n).view(dtype), self.poisoned(w * n).view(dtype)
            return (lambda: dist.all_to_all_single(out, inp, group=group)), w * n * (w - 1) / w
        if op == "broadcast":
            t = self.piece(0, 0, n).view(dtype)
            return (lambda: dist.broadcast(t, src=0, group=group)), n
        t = self.piece(self.rank, 0, n).view(dtype)
        pieces = [self.poisoned(n).view(dtype) for _ in range(w)] if self.rank == 0 else None
        if op == "gather":
            return (lambda: dist.gather(t, pieces, dst=0, group=group)), w * n * (w - 1) / w
        if op == "scatter":
            return (lambda: dist.scatter(t, pieces, src=0, group=group)), w * n * (w - 1) / w
        raise ValueError(op)
