"""GPU (2 GPUs, or one with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): the exchanges captured into a CUDA graph, on
the copy engines (docs/design.md, "Captured").
- Every form captured (torch.cuda.graph, global capture mode): all_to_all_single even and uneven with zero splits (a
  pair with nothing either way, a rank that sends nothing, all zero), all_to_all lists, broadcast, gather and scatter
  from either root, one of them async_op=True waited inside the capture, in several dtypes; replayed several times
  with new input bytes copied into the captured inputs and outputs poisoned before each replay, every output and input
  compared bit-exactly with bytes rebuilt locally from every rank's seed (NCCL is never the reference: it refuses two
  ranks on one GPU).
- stats() and group_path(op=...) say "dma:captured" for every exchange of the capture, and nothing went inner.
- A graph mixing all-gathers and exchanges; an eager exchange and all-gather of the same group between replays.
- At the default staging (pairs of one chunk, or two above 8 MiB) and at 1 MiB of staging (512 KiB chunks: a pair of
  several MiB takes more chunks than slots, so the credits turn over inside a replay).
- No kernel but the driver's own memcpy ones in a replay of captured exchanges (profiler).
- Splits that disagree across ranks, captured: every rank refuses the call in the eager exchange's words before
  anything is enqueued, and the other groups go on."""
import pytest
import torch
import torch.distributed as dist

from checks.data import assert_bytes_equal, poison_, rand, raw
from checks.exchange import split_matrix
from conftest import GPU_RANKS, cuda_count
from mp_harness import run_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_count() < GPU_RANKS, reason=f"needs {GPU_RANKS} CUDA devices"),
]

W = GPU_RANKS
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None,
       "TORCH_SDMA_TEST_FAULT": None}
COLS = 3
OPS = ("all_to_all_single", "all_to_all", "broadcast", "gather", "scatter")
SPLITS = ("random_with_zeros", "one_rank_sends_nothing", "only_to_self", "all_zero", "all_to_one_peer")


def _shape(rows, cols):
    return (rows, cols) if cols else (rows,)


class CapturedExchanges:
    """Static buffers of one call per exchange form (and, with `gathers`, two all-gathers), for a graph: fill(name)
    writes new inputs into them and poisons the outputs, enqueue() issues every call on the current stream, check(name)
    compares every output and input with the bytes rebuilt from (name, rank) on this rank."""

    def __init__(self, g, dev, rank, dtype, rows, n, gathers=False):
        self.g, self.dev, self.me, self.dtype, self.rows, self.n = g, dev, rank, dtype, rows, n
        self.gathers = gathers
        me = rank
        self.mats = {k: split_matrix(f"capex/{k}/{rows}", W, k, max_rows=rows) for k in SPLITS}
        self.a2a = {k: (torch.empty(_shape(sum(S[me]), COLS), dtype=dtype, device=dev),
                        torch.empty(_shape(sum(S[i][me] for i in range(W)), COLS), dtype=dtype, device=dev))
                    for k, S in self.mats.items()}
        self.even_in = torch.empty(W * n, dtype=dtype, device=dev)
        self.even_out = torch.empty(W * n, dtype=dtype, device=dev)
        S = self.mats["random_with_zeros"]
        self.list_in = [torch.empty(_shape(S[me][j], COLS), dtype=dtype, device=dev) for j in range(W)]
        self.list_out = [torch.empty(_shape(S[i][me], COLS), dtype=dtype, device=dev) for i in range(W)]
        self.bcast = [torch.empty(n + root, dtype=dtype, device=dev) for root in range(W)]
        self.gather_in = [torch.empty(n + root, dtype=dtype, device=dev) for root in range(W)]
        self.gather_out = [[torch.empty(n + root, dtype=dtype, device=dev) for _ in range(W)] if root == me else None
                           for root in range(W)]
        self.scatter_in = [[torch.empty(n + root, dtype=dtype, device=dev) for _ in range(W)] if root == me else None
                           for root in range(W)]
        self.scatter_out = [torch.empty(n + root, dtype=dtype, device=dev) for root in range(W)]
        self.ag_in = torch.empty(n, dtype=dtype, device=dev)
        self.ag_out = torch.empty(W * n, dtype=dtype, device=dev)
        self.ag_list = [torch.empty(n, dtype=dtype, device=dev) for _ in range(W)]

    def _r(self, name, rank, shape):
        return rand(name, rank, shape, self.dtype)

    def expected(self, name):
        """[(what, tensor, expected bytes, is an output)] for every output and input, rebuilt from (name, rank)."""
        me, out = self.me, []
        for k, S in self.mats.items():
            ins = [self._r(f"{name}/a2a/{k}", i, _shape(sum(S[i]), COLS)) for i in range(W)]
            mine = torch.cat([raw(ins[i].narrow(0, sum(S[i][:me]), S[i][me])) for i in range(W)])
            x, o = self.a2a[k]
            out += [(f"all_to_all_single [{k}] output", o, mine, True),
                    (f"all_to_all_single [{k}] input", x, raw(ins[me]), False)]
        evens = [self._r(f"{name}/even", i, (W * self.n,)) for i in range(W)]
        out.append(("all_to_all_single even output", self.even_out,
                    torch.cat([raw(evens[i].narrow(0, me * self.n, self.n)) for i in range(W)]), True))
        out.append(("all_to_all_single even input", self.even_in, raw(evens[me]), False))
        S = self.mats["random_with_zeros"]
        for i in range(W):
            out.append((f"all_to_all output[{i}]", self.list_out[i],
                        raw(self._r(f"{name}/list/to{me}", i, _shape(S[i][me], COLS))), True))
            out.append((f"all_to_all input[{i}]", self.list_in[i],
                        raw(self._r(f"{name}/list/to{i}", me, _shape(S[me][i], COLS))), False))
        for root in range(W):
            m = self.n + root
            out.append((f"broadcast root {root}", self.bcast[root], raw(self._r(f"{name}/bcast{root}", root, (m,))),
                        root != me))
            out.append((f"gather root {root} input", self.gather_in[root],
                        raw(self._r(f"{name}/gather{root}", me, (m,))), False))
            if root == me:
                for i in range(W):
                    out.append((f"gather root {root} gather_list[{i}]", self.gather_out[root][i],
                                raw(self._r(f"{name}/gather{root}", i, (m,))), True))
                for j in range(W):
                    out.append((f"scatter root {root} scatter_list[{j}]", self.scatter_in[root][j],
                                raw(self._r(f"{name}/scatter{root}/to{j}", me, (m,))), False))
            out.append((f"scatter root {root} output", self.scatter_out[root],
                        raw(self._r(f"{name}/scatter{root}/to{me}", root, (m,))), True))
        if self.gathers:
            each = [raw(self._r(f"{name}/ag", i, (self.n,))) for i in range(W)]
            out.append(("all_gather_into_tensor output", self.ag_out, torch.cat(each), True))
            out.append(("all_gather_into_tensor input", self.ag_in, each[me], False))
            out += [(f"all_gather list output[{i}]", t, each[i], True) for i, t in enumerate(self.ag_list)]
        return out

    def fill(self, name):
        """New inputs, and every output poisoned with the bitwise NOT of the bytes it must receive (written on the
        current stream), for the next replay or eager run."""
        with torch.no_grad():
            for _, t, e, is_output in self.expected(name):
                if is_output:
                    poison_(t, e)
                else:
                    t.view(-1).view(torch.uint8).copy_(e.to(t.device))

    def enqueue(self):
        g, me = self.g, self.me
        if self.gathers:
            dist.all_gather_into_tensor(self.ag_out, self.ag_in, group=g)
        for k, S in self.mats.items():
            x, o = self.a2a[k]
            if k == "all_to_one_peer":  # async inside the capture, waited there: it joins the capturing stream
                dist.all_to_all_single(o, x, [S[i][me] for i in range(W)], list(S[me]), group=g, async_op=True).wait()
            else:
                dist.all_to_all_single(o, x, [S[i][me] for i in range(W)], list(S[me]), group=g)
        dist.all_to_all_single(self.even_out, self.even_in, group=g)
        dist.all_to_all(self.list_out, self.list_in, group=g)
        for root in range(W):
            dist.broadcast(self.bcast[root], src=root, group=g)
            dist.gather(self.gather_in[root], self.gather_out[root], dst=root, group=g)
            dist.scatter(self.scatter_out[root], self.scatter_in[root], src=root, group=g)
        if self.gathers:
            dist.all_gather(self.ag_list, self.ag_in, group=g)

    def check(self, name, what):
        bad = []
        for label, t, e, _ in self.expected(name):
            try:
                assert_bytes_equal(t, e, f"{what}: {label}")
            except AssertionError as ex:
                bad.append(str(ex))
        assert not bad, f"{len(bad)} wrong:\n" + "\n".join(bad[:8])


def _kernels_in(prof):
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if not n.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset", "memcpy"))], names


def capture_exchange_body(ctx):
    from torch.profiler import ProfilerActivity, profile

    import torch_sdma

    rank, dev = ctx.rank, ctx.device
    g = dist.group.WORLD
    info = {}
    cases = []

    def replay(dtype, rows, n, gathers, label):
        def fn():
            ex = CapturedExchanges(g, dev, rank, dtype, rows, n, gathers=gathers)
            side = torch.cuda.Stream(dev)
            # Warm-up on a side stream, as torch.cuda.graph asks: the eager calls connect the direct path first.
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                ex.fill(f"{label}/warm")
                ex.enqueue()
            torch.cuda.synchronize()
            ex.check(f"{label}/warm", "eager warm-up")
            graph = torch.cuda.CUDAGraph()
            torch_sdma.reset_stats(g)
            with torch.cuda.graph(graph):
                ex.enqueue()
            s = torch_sdma.stats(g)
            info[f"stats[{label}]"] = sorted(s)
            for op in OPS:
                assert s.get(f"{op}:dma:captured", {}).get("calls", 0) > 0, f"{op} not captured on the DMA path: {s}"
                assert torch_sdma.group_path(g, op=op) == "dma:captured", (op, torch_sdma.group_path(g, op=op))
            assert not [k for k in s if "inner:" in k or k.endswith("dma:direct")], f"not all captured: {s}"
            if gathers:
                assert s.get("dma:captured", {}).get("calls", 0) == 2, f"the captured all-gathers: {s}"
            for rep in range(4):
                ex.fill(f"{label}/rep{rep}")
                graph.replay()
                torch.cuda.synchronize()
                ex.check(f"{label}/rep{rep}", f"replay {rep}")
                # eager calls of the same group between replays (their flags are not the graph's), themselves checked
                x = rand(f"{label}/eager{rep}", rank, (W * n,), dtype, dev)
                out = poison_(torch.empty(W * n, dtype=dtype, device=dev))
                dist.all_to_all_single(out, x, group=g)
                ag = poison_(torch.empty(W * n, dtype=dtype, device=dev))
                dist.all_gather_into_tensor(ag, x.narrow(0, 0, n), group=g)
                torch.cuda.synchronize()
                want = torch.cat([raw(rand(f"{label}/eager{rep}", i, (W * n,), dtype).narrow(0, rank * n, n))
                                  for i in range(W)])
                assert_bytes_equal(out, want, f"eager all_to_all_single between replays {rep}")
                want = torch.cat([raw(rand(f"{label}/eager{rep}", i, (W * n,), dtype).narrow(0, 0, n))
                                  for i in range(W)])
                assert_bytes_equal(ag, want, f"eager all_gather between replays {rep}")
            ctx.barrier_store(f"{label}/prof")
            ex.fill(f"{label}/prof")
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            kernels, names = _kernels_in(prof)
            info[f"replay_gpu_events[{label}]"] = sorted(set(names))[:12]
            assert not kernels, f"a replay of captured exchanges ran kernels: {sorted(set(kernels))[:8]}"
            ex.check(f"{label}/prof", "profiled replay")
            del graph

        return fn

    for dtype in (torch.bfloat16, torch.float32, torch.uint8, torch.int64, torch.bool):
        cases.append((f"capture_replay_every_exchange[{dtype},small]", replay(dtype, 40, 257, False, f"s{dtype}")))
    # Pairs of up to 10 MB: one or two chunks each at the default staging (cut in two above 8 MiB), many more than the
    # slots at 1 MiB of staging.
    cases.append(("capture_replay_every_exchange[bf16,large]",
                  replay(torch.bfloat16, 300_000, 5_000_000, False, "large")))
    cases.append(("capture_replay_exchanges_and_all_gathers[float32]", replay(torch.float32, 64, 4099, True, "mixed")))
    cases.append(("capture_replay_exchanges_and_all_gathers[bf16,large]",
                  replay(torch.bfloat16, 200_000, 2_500_000, True, "mixedlarge")))
    def splits_that_disagree_refused_at_capture():
        # On a group of its own, which the refusal fails (as an eager exchange's would); WORLD goes on.
        sub = dist.new_group(list(range(W)))
        x = torch.ones((4, COLS), device=dev)
        out = torch.empty((4, COLS), device=dev)
        dist.all_to_all_single(out, x, group=sub)  # connects the group eagerly, as before any capture
        torch.cuda.synchronize()
        # Rank 1 expects 3 rows from rank 0, which sends it 2.
        out = torch.empty((5 if rank == 1 else 4, COLS), device=dev)
        out_splits = [3, 2] if rank == 1 else [2, 2]
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(Exception) as e:
            with torch.cuda.graph(graph):
                dist.all_to_all_single(out, x, out_splits, [2, 2], group=sub)
        words = "group rank 0 sends 24 bytes to group rank 1, which expects 36 bytes from it"
        assert words in str(e.value), str(e.value)
        del graph
        torch.cuda.synchronize()
        y = rand("after-refusal", rank, (W * 64,), torch.float32, dev)
        o = poison_(torch.empty(W * 64, device=dev))
        dist.all_to_all_single(o, y, group=g)
        torch.cuda.synchronize()
        want = torch.cat([raw(rand("after-refusal", i, (W * 64,), torch.float32).narrow(0, rank * 64, 64))
                          for i in range(W)])
        assert_bytes_equal(o, want, "WORLD after the refusal on another group")

    cases.append(("splits_that_disagree_refused_at_capture_on_every_rank", splits_that_disagree_refused_at_capture))
    failed = ctx.run_cases(cases)
    return {"failed": failed, "info": info}


@pytest.mark.parametrize("staging", [None, "1M"])
def test_captured_exchanges_replay_bit_exact(staging):
    env = dict(ENV, TORCH_SDMA_STAGING_BYTES=staging)
    res = run_group(capture_exchange_body, W, "cpu:gloo,cuda:sdma", env=env, cuda=True, timeout=540, pg_timeout_s=60)
    print(res.ranks[0].value["info"] if res.ranks[0].value else None)
    res.check()
