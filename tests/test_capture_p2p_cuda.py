"""GPU (2 GPUs, or one with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): point-to-point captured into a CUDA graph, on
the copy engines (docs/design.md, "Captured point-to-point").
- One graph (torch.cuda.graph, global capture mode) holding, on ranks 0 and 1, a blocking send and recv each way,
  isend/irecv waited inside the capture, a batch_isend_irecv with two sends and two recvs with one peer (listed in
  other orders on the two ranks), and on every rank a batch_isend_irecv ring (each rank to the next, from the
  previous; with two ranks both directions with one peer), beside a captured all_gather_into_tensor and an
  all_to_all_single of the same group; in every dtype of EVERY_DTYPE; replayed 4 times with new input bytes copied
  into the captured inputs and every output poisoned first, compared bit-exactly with bytes rebuilt locally from
  every rank's seed (NCCL is never the reference: it refuses two ranks on one GPU).
- Three ranks: the ring of three (each pair's steps in the order every rank shares, so the ring does not wait in a
  cycle).
- At the default staging and at 1 MiB (a pair of several MiB takes more chunks than slots).
- The first op of a group captured, with no eager op before it: the pair connects inside the capture.
- No kernel in a replay (profiler).
- Sizes that disagree at capture: both ranks refuse the op in the eager point-to-point's words before anything is
  enqueued."""
import pytest
import torch
import torch.distributed as dist
from test_capture_exchange_cuda import _kernels_in

from checks.data import EVERY_DTYPE, assert_bytes_equal, poison_, rand, raw
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None,
       "TORCH_SDMA_TEST_FAULT": None}


class CapturedP2p:
    """Static buffers of one graph's point-to-point and collectives on this rank: fill(name) writes new inputs and
    poisons the outputs, enqueue() issues every call on the current stream, check(name) compares every output with the
    bytes rebuilt from (name, sender)."""

    def __init__(self, g, dev, rank, world, dtype, n):
        self.g, self.dev, self.me, self.world, self.dtype, self.n = g, dev, rank, world, dtype, n
        self.nxt, self.prv = (rank + 1) % world, (rank - 1) % world
        # (name, sender, receiver, elements): the transfers this graph makes; zero elements included
        self.transfers = [(f"ring{r}", r, (r + 1) % world, n + r) for r in range(world)]
        self.transfers += [("sync01", 0, 1, n), ("sync10", 1, 0, n + 3), ("async01", 0, 1, 0),
                           ("async10", 1, 0, n + 5)]
        self.transfers += [(f"both{k}{s}", s, 1 - s, n + 7 * k + s) for k in range(2) for s in range(2)]
        self.tensors = {}
        for name, s, d, m in self.transfers:
            if self.me in (s, d):
                self.tensors[name] = torch.empty(m, dtype=dtype, device=dev)
        self.ag_in = torch.empty(n, dtype=dtype, device=dev)
        self.ag_out = torch.empty(world * n, dtype=dtype, device=dev)
        self.a2a_in = torch.empty(world * n, dtype=dtype, device=dev)
        self.a2a_out = torch.empty(world * n, dtype=dtype, device=dev)

    def _r(self, name, rank, m):
        return rand(name, rank, (m,), self.dtype)

    def expected(self, name):
        """[(what, tensor, expected bytes, is an output)] for every tensor of the graph on this rank."""
        out = []
        for t, s, d, m in self.transfers:
            if self.me in (s, d):
                out.append((f"{t} {s}->{d}", self.tensors[t], raw(self._r(f"{name}/{t}", s, m)), self.me == d))
        each = [raw(self._r(f"{name}/ag", i, self.n)) for i in range(self.world)]
        out += [("all_gather_into_tensor output", self.ag_out, torch.cat(each), True),
                ("all_gather_into_tensor input", self.ag_in, each[self.me], False)]
        a2a = [self._r(f"{name}/a2a", i, self.world * self.n) for i in range(self.world)]
        out += [("all_to_all_single output", self.a2a_out,
                 torch.cat([raw(a2a[i].narrow(0, self.me * self.n, self.n)) for i in range(self.world)]), True),
                ("all_to_all_single input", self.a2a_in, raw(a2a[self.me]), False)]
        return out

    def fill(self, name):
        with torch.no_grad():
            for _, t, e, is_output in self.expected(name):
                if is_output:
                    poison_(t, e)
                else:
                    t.view(-1).view(torch.uint8).copy_(e.to(t.device))

    def enqueue(self):
        g, me, T = self.g, self.me, self.tensors
        works = []
        dist.all_gather_into_tensor(self.ag_out, self.ag_in, group=g)
        if me == 0:
            dist.send(T["sync01"], 1, group=g)
            dist.recv(T["sync10"], 1, group=g)
            works = [dist.isend(T["async01"], 1, group=g), dist.irecv(T["async10"], 1, group=g)]
        elif me == 1:
            dist.recv(T["sync01"], 0, group=g)
            dist.send(T["sync10"], 0, group=g)
            works = [dist.irecv(T["async01"], 0, group=g), dist.isend(T["async10"], 0, group=g)]
        for w in works:  # inside the capture: joins the capturing stream
            w.wait()
        ring_ops = [dist.P2POp(dist.isend, T[f"ring{me}"], self.nxt, g),
                    dist.P2POp(dist.irecv, T[f"ring{self.prv}"], self.prv, g)]
        for w in dist.batch_isend_irecv(ring_ops):
            w.wait()
        if me in (0, 1):
            peer = 1 - me
            ops = [dist.P2POp(dist.isend, T[f"both{k}{me}"], peer, g) for k in range(2)]
            ops += [dist.P2POp(dist.irecv, T[f"both{k}{peer}"], peer, g) for k in range(2)]
            if me == 1:  # the k-th send and the k-th recv with a peer meet, whatever the listing
                ops = [ops[2], ops[0], ops[3], ops[1]]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        dist.all_to_all_single(self.a2a_out, self.a2a_in, group=g)

    def check(self, name, what):
        bad = []
        for label, t, e, _ in self.expected(name):
            try:
                assert_bytes_equal(t, e, f"{what}: {label}")
            except AssertionError as ex:
                bad.append(str(ex))
        assert not bad, f"{len(bad)} wrong:\n" + "\n".join(bad[:8])


def capture_p2p_body(ctx, dtypes, n):
    from torch.profiler import ProfilerActivity, profile

    import torch_sdma

    rank, dev, world = ctx.rank, ctx.device, ctx.world
    g = dist.group.WORLD
    info = {}

    def replay(dtype, label, warm=True):
        def fn():
            x = CapturedP2p(g, dev, rank, world, dtype, n)
            if warm:
                # Warm-up on a side stream, as torch.cuda.graph asks: the eager calls connect the pairs' direct state.
                side = torch.cuda.Stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    x.fill(f"{label}/warm")
                    x.enqueue()
                torch.cuda.synchronize()
                x.check(f"{label}/warm", "eager warm-up")
            graph = torch.cuda.CUDAGraph()
            torch_sdma.reset_stats(g)
            with torch.cuda.graph(graph):
                x.enqueue()
            s = torch_sdma.stats(g)
            info[f"stats[{label}]"] = sorted(s)
            for op in ("send", "recv"):
                assert s.get(f"{op}:dma:captured", {}).get("calls", 0) > 0, f"{op} not captured on the DMA path: {s}"
            assert not [k for k in s if "inner:" in k or k.endswith("dma:direct")], f"not all captured: {s}"
            for rep in range(4):
                x.fill(f"{label}/rep{rep}")
                graph.replay()
                torch.cuda.synchronize()
                x.check(f"{label}/rep{rep}", f"replay {rep}")
            ctx.barrier_store(f"{label}/prof")
            x.fill(f"{label}/prof")
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            kernels, names = _kernels_in(prof)
            info[f"replay_gpu_events[{label}]"] = sorted(set(names))[:12]
            assert not kernels, f"a replay of captured point-to-point ran kernels: {sorted(set(kernels))[:8]}"
            x.check(f"{label}/prof", "profiled replay")
            del graph

        return fn

    cases = [(f"capture_replay_p2p[{dt}]", replay(dt, f"d{dt}")) for dt in dtypes]

    def first_op_of_a_group_captured():
        # A group of its own, whose pairs connect inside the capture (no eager op before it).
        sub = dist.new_group(list(range(world)))
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        send = torch.empty(n, device=dev)
        got = torch.empty(n, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, sub),
                                             dist.P2POp(dist.irecv, got, prv, sub)]):
                w.wait()
        for rep in range(2):
            send.copy_(rand(f"fresh/{rep}", rank, (n,), torch.float32, dev))
            want = rand(f"fresh/{rep}", prv, (n,), torch.float32)
            poison_(got, raw(want))
            graph.replay()
            torch.cuda.synchronize()
            assert_bytes_equal(got, want, f"ring captured as the group's first op, replay {rep}")
        del graph

    cases.append(("first_op_of_a_group_captured", first_op_of_a_group_captured))

    def sizes_that_disagree_refused_at_capture():
        # On a group of its own, which the refusal fails (as an eager refusal would); WORLD goes on.
        sub = dist.new_group(list(range(world)))
        graph = torch.cuda.CUDAGraph()
        if rank in (0, 1):
            with pytest.raises(Exception) as e:
                with torch.cuda.graph(graph):
                    if rank == 0:
                        dist.send(torch.ones(4, device=dev), 1, group=sub)
                    else:
                        dist.recv(torch.empty(5, device=dev), 0, group=sub)
            words = str(e.value)
            for part in ("do not match", "a send of 16 bytes", "a recv of 20 bytes", "nothing was copied"):
                assert part in words, words
        del graph
        torch.cuda.synchronize()
        y = rand("after-refusal", rank, (world * 64,), torch.float32, dev)
        o = poison_(torch.empty(world * 64, device=dev))
        dist.all_to_all_single(o, y, group=g)
        torch.cuda.synchronize()
        want = torch.cat([raw(rand("after-refusal", i, (world * 64,), torch.float32).narrow(0, rank * 64, 64))
                          for i in range(world)])
        assert_bytes_equal(o, want, "WORLD after the refusal on another group")

    cases.append(("sizes_that_disagree_refused_at_capture_on_both_ranks", sizes_that_disagree_refused_at_capture))
    failed = ctx.run_cases(cases)
    return {"failed": failed, "info": info}


@pytest.mark.parametrize("staging", [None, "1M"])
def test_captured_p2p_replays_bit_exact_in_every_dtype(staging):
    env = dict(ENV, TORCH_SDMA_STAGING_BYTES=staging)
    res = run_group(capture_p2p_body, 2, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=540, pg_timeout_s=60,
                    kwargs={"dtypes": EVERY_DTYPE, "n": 4099})
    print(res.ranks[0].value["info"] if res.ranks[0].value else None)
    res.check()


def test_captured_p2p_large_pairs_take_many_chunks():
    """1 MiB of staging: pairs of about 2 MB turn the credits over inside a replay."""
    env = dict(ENV, TORCH_SDMA_STAGING_BYTES="1M")
    res = run_group(capture_p2p_body, 2, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=540, pg_timeout_s=60,
                    kwargs={"dtypes": (torch.bfloat16,), "n": 1_000_003})
    res.check()


def test_captured_p2p_ring_of_three():
    """Three ranks (two on one GPU where there are two): the ring's steps run in the pairs' shared order."""
    env = dict(ENV, TORCH_SDMA_STAGING_BYTES="1M")
    res = run_group(capture_p2p_body, 3, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=540, pg_timeout_s=60,
                    kwargs={"dtypes": (torch.float32, torch.uint8), "n": 300_001})
    res.check()
