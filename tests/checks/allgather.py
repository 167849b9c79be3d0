"""All-gather checks: every form, dtype and size against the reference group, stats, and interleaved groups."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from checks.data import (
    ALL_DTYPES,
    DMA_KEYS,
    EVERY_DTYPE,
    SHARE_GPU,
    assert_bytes_equal,
    coalescing_manager,
    expected_concat,
    group_ranks,
    poison_,
    rand,
    raw,
    stats_calls,
)


# ------------------------------------------------------------------------------------ all-gather cases
class AG:
    """All-gather checks on group g (sdma) against ref (gloo/nccl) with the same members. ref=None: against the
    inputs rebuilt locally from every member's seed only (ranks sharing one GPU, where NCCL cannot run)."""

    def __init__(self, g, ref, dev, tag):
        self.g, self.ref, self.dev, self.tag = g, ref, dev, tag
        self.W = dist.get_world_size(g)
        self.me = dist.get_rank(g)
        self.ranks = group_ranks(g)
        assert ref is None or self.ranks == group_ranks(ref)
        self.my_global = self.ranks[self.me]
        self._ref_ok = {}

    def x(self, name, shape, dtype):
        return rand(f"{self.tag}/{name}", self.my_global, shape, dtype, self.dev)

    def local_expected(self, name, shape, dtype):
        return expected_concat(f"{self.tag}/{name}", self.ranks, shape, dtype)

    def ref_expected(self, x):
        """Bytes of the reference all_gather_into_tensor of x; for dtypes the reference refuses, the reference
        all-gathers the uint8 view instead."""
        W = self.W
        flat = x.reshape(-1)
        out = poison_(torch.empty(W * flat.numel(), dtype=x.dtype, device=self.dev))
        if self._ref_ok.get(x.dtype, True):
            try:
                dist.all_gather_into_tensor(out, flat, group=self.ref)
                self._ref_ok[x.dtype] = True
                return raw(out)
            except (RuntimeError, TypeError, ValueError) as e:  # e.g. gloo: "Invalid scalar type"
                if x.dtype in (torch.float32, torch.uint8):
                    raise
                self._ref_ok[x.dtype] = False
                self.ref_refusal = str(e)
        b = raw(flat).to(self.dev)
        out8 = poison_(torch.empty(W * b.numel(), dtype=torch.uint8, device=self.dev))
        dist.all_gather_into_tensor(out8, b, group=self.ref)
        return raw(out8)

    def expected(self, name, shape, dtype, x):
        loc = self.local_expected(name, shape, dtype)
        if self.ref is None:
            return loc
        e = self.ref_expected(x)
        assert_bytes_equal(e, loc, "reference all-gather vs locally rebuilt inputs (test self-check)")
        return e

    # forms ---------------------------------------------------------------------------------------------
    def into_tensor(self, name, shape, dtype, *, inplace=False, async_op=False, out_layout="cat"):
        """all_gather_into_tensor. out_layout: 'cat' (W*d0, ...), 'stack' (W, *shape), 'flat' (W*numel,)."""
        W, me = self.W, self.me
        x = self.x(name, shape, dtype)
        exp = self.expected(name, shape, dtype, x)
        if out_layout == "cat":
            oshape = (W * shape[0],) + tuple(shape[1:]) if len(shape) else (W,)
        elif out_layout == "stack":
            oshape = (W,) + tuple(shape)
        else:
            oshape = (W * x.numel(),)
        out = poison_(torch.empty(oshape, dtype=dtype, device=self.dev), exp)
        if inplace:
            n = x.numel()
            flat = out.view(-1)
            if out_layout != "cat":
                inp = flat.narrow(0, me * n, n).view(x.shape)
            else:
                inp = out.narrow(0, me * shape[0], shape[0])
            inp.copy_(x)
        else:
            inp = x
        w = dist.all_gather_into_tensor(out, inp, group=self.g, async_op=async_op)
        if async_op:
            assert w is not None, "async_op=True returned no Work"
            w.wait()
            if out.is_cuda:
                # wait() only orders the caller's stream (as NCCL's does); completion is the GPU's to report.
                torch.cuda.current_stream().synchronize()
            assert w.is_completed()
        assert_bytes_equal(out, exp, f"all_gather_into_tensor {name}")
        if not inplace:
            assert_bytes_equal(x, rand(f"{self.tag}/{name}", self.my_global, shape, dtype), "input modified")

    def as_list(self, name, shape, dtype, *, async_op=False):
        W = self.W
        x = self.x(name, shape, dtype)
        exp = self.expected(name, shape, dtype, x)
        per = exp.numel() // W
        outs = [poison_(torch.empty(shape, dtype=dtype, device=self.dev), exp[j * per:(j + 1) * per]) for j in range(W)]
        w = dist.all_gather(outs, x, group=self.g, async_op=async_op)
        if async_op:
            w.wait()
        got = torch.cat([raw(o) for o in outs]) if outs else torch.empty(0, dtype=torch.uint8)
        assert_bytes_equal(got, exp, f"all_gather(list) {name}")

    def coalesced_cm(self, name, specs, *, async_op=False, inplace=False):
        """_coalescing_manager + all_gather_into_tensor for each (shape, dtype) of specs."""
        W, me = self.W, self.me
        xs, exps, outs, inps = [], [], [], []
        for k, (shape, dtype) in enumerate(specs):
            x = self.x(f"{name}.{k}", shape, dtype)
            e = self.expected(f"{name}.{k}", shape, dtype, x)
            o = poison_(torch.empty((W * shape[0],) + tuple(shape[1:]), dtype=dtype, device=self.dev), e)
            if inplace:
                i = o.narrow(0, me * shape[0], shape[0])
                i.copy_(x)
            else:
                i = x
            xs.append(x)
            exps.append(e)
            outs.append(o)
            inps.append(i)
        with coalescing_manager(self.g, async_ops=async_op) as cm:
            for o, i in zip(outs, inps):
                dist.all_gather_into_tensor(o, i, group=self.g)
        if async_op:
            cm.wait()
        for k in range(len(specs)):
            assert_bytes_equal(outs[k], exps[k], f"coalesced {name}[{k}] {specs[k]}")

    def coalesced_legacy(self, name, shapes, dtype, *, async_op=False):
        """all_gather_coalesced (one dtype, mixed shapes)."""
        W = self.W
        xs, exps = [], []
        for k, shape in enumerate(shapes):
            x = self.x(f"{name}.{k}", shape, dtype)
            xs.append(x)
            exps.append(self.expected(f"{name}.{k}", shape, dtype, x))
        outs = []
        for j in range(W):
            row = []
            for k, shape in enumerate(shapes):
                per = exps[k].numel() // W
                row.append(poison_(torch.empty(shape, dtype=dtype, device=self.dev), exps[k][j * per:(j + 1) * per]))
            outs.append(row)
        w = dist.all_gather_coalesced(outs, xs, group=self.g, async_op=async_op)
        if async_op:
            w.wait()
        for k in range(len(shapes)):
            got = torch.cat([raw(outs[j][k]) for j in range(W)])
            assert_bytes_equal(got, exps[k], f"all_gather_coalesced {name}[{k}] {shapes[k]}")

    def many_in_flight(self, name, n=100, base=1000, dtypes=(torch.float32, torch.bfloat16, torch.uint8, torch.int64),
                       stream=None):
        """n all_gather_into_tensor with async_op=True, then wait all, then check all."""
        W = self.W
        items = []
        for k in range(n):
            dt = dtypes[k % len(dtypes)]
            shape = (base + 37 * k,)
            x = self.x(f"{name}.{k}", shape, dt)
            e = self.expected(f"{name}.{k}", shape, dt, x)
            o = poison_(torch.empty(W * shape[0], dtype=dt, device=self.dev), e)
            items.append((x, e, o))
        if stream is not None:
            torch.cuda.current_stream(self.dev).synchronize()
        works = []
        ctxm = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctxm:
            for x, e, o in items:
                works.append(dist.all_gather_into_tensor(o, x, group=self.g, async_op=True))
            for w in works:
                w.wait()
        if stream is not None:
            stream.synchronize()
        bad = []
        for k, (x, e, o) in enumerate(items):
            try:
                assert_bytes_equal(o, e, f"in-flight #{k}")
            except AssertionError as ex:
                bad.append(str(ex))
        assert not bad, f"{len(bad)} of {n} in-flight all-gathers wrong; first: {bad[:3]}"


def future_case(ag, name):
    W, dev = ag.W, ag.dev
    n = 1001
    x = ag.x(name, (n,), torch.float32)
    e = ag.local_expected(name, (n,), torch.float32)
    out = poison_(torch.empty(W * n, device=dev), e)
    # every collective first, the checks after: a failed check must not leave the peers inside a collective
    w = dist.all_gather_into_tensor(out, x, group=ag.g, async_op=True)
    fut = w.get_future()
    v = fut.wait()
    t0 = time.monotonic()
    while not w.is_completed() and time.monotonic() - t0 < 2.0:  # may lag the future by a moment
        time.sleep(0.001)
    completed = w.is_completed()
    out2 = poison_(torch.empty(W * n, device=dev), e)
    w2 = dist.all_gather_into_tensor(out2, x, group=ag.g, async_op=True)
    r = w2.get_future().then(lambda f: f.value()[0].clone()).wait()
    outs = [poison_(torch.empty(n, device=dev)) for _ in range(W)]
    vl = dist.all_gather(outs, x, group=ag.g, async_op=True).get_future().wait()
    assert isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v), v
    assert v[0].data_ptr() == out.data_ptr(), "the future's value is not [output tensor]"
    assert_bytes_equal(out, e, "output after get_future().wait()")
    assert completed, "work.is_completed() still False 2s after its future completed"
    assert_bytes_equal(r, e, "then() on the future")
    assert isinstance(vl, list) and vl, vl
    assert_bytes_equal(torch.cat([raw(t) for t in outs]), e, "list form after get_future().wait()")


def mixed_forms_in_flight(ag, name, rounds=5):
    """All four forms issued async back to back (with a delegated all_reduce among them), then wait all."""
    W, dev = ag.W, ag.dev
    checks = []
    works = []
    for r in range(rounds):
        # into tensor
        x = ag.x(f"{name}{r}.t", (301 + r,), torch.float32)
        e = ag.local_expected(f"{name}{r}.t", (301 + r,), torch.float32)
        o = poison_(torch.empty(W * (301 + r), device=dev), e)
        works.append(dist.all_gather_into_tensor(o, x, group=ag.g, async_op=True))
        checks.append((o, e, "into_tensor"))
        # list
        x2 = ag.x(f"{name}{r}.l", (55,), torch.bfloat16)
        e2 = ag.local_expected(f"{name}{r}.l", (55,), torch.bfloat16)
        per = e2.numel() // W
        ol = [poison_(torch.empty(55, dtype=torch.bfloat16, device=dev), e2[j * per:(j + 1) * per]) for j in range(W)]
        works.append(dist.all_gather(ol, x2, group=ag.g, async_op=True))
        checks.append((ol, e2, "list"))
        # a delegated collective in between (not where the ranks share a GPU: the inner NCCL cannot run there)
        if not (SHARE_GPU and dev.type == "cuda"):
            t = torch.full((8,), float(ag.me + r), device=dev)
            works.append(dist.all_reduce(t, group=ag.g, async_op=True))
            checks.append((t, float(sum(range(W)) + W * r), "all_reduce"))
        # coalescing manager
        specs = [((9,), torch.int64), ((4, 4), torch.uint8)]
        outs, exps, ins = [], [], []
        for k, (sh, dt) in enumerate(specs):
            xi = ag.x(f"{name}{r}.c{k}", sh, dt)
            ei = ag.local_expected(f"{name}{r}.c{k}", sh, dt)
            outs.append(poison_(torch.empty((W * sh[0],) + sh[1:], dtype=dt, device=dev), ei))
            exps.append(ei)
            ins.append(xi)
        with coalescing_manager(ag.g, async_ops=True) as cm:
            for oo, xi in zip(outs, ins):
                dist.all_gather_into_tensor(oo, xi, group=ag.g)
        works.append(cm)
        for oo, ei in zip(outs, exps):
            checks.append((oo, ei, "coalesced"))
        # all_gather_coalesced
        shapes = [(3,), (2, 5)]
        xs = [ag.x(f"{name}{r}.g{k}", sh, torch.float64) for k, sh in enumerate(shapes)]
        es = [ag.local_expected(f"{name}{r}.g{k}", sh, torch.float64) for k, sh in enumerate(shapes)]
        og = [[poison_(torch.empty(sh, dtype=torch.float64, device=dev)) for sh in shapes] for _ in range(W)]
        works.append(dist.all_gather_coalesced(og, xs, group=ag.g, async_op=True))
        for k in range(len(shapes)):
            checks.append(([og[j][k] for j in range(W)], es[k], "all_gather_coalesced"))
    for w in works:
        w.wait()
    for obj, e, what in checks:
        if what == "all_reduce":
            assert torch.equal(obj.cpu(), torch.full((8,), e)), (obj, e)
            continue
        got = torch.cat([raw(t) for t in obj]) if isinstance(obj, list) else raw(obj)
        assert_bytes_equal(got, e, f"mixed forms in flight: {what}")


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


QUICK_DTYPES = [torch.bool, torch.uint8, torch.int16, torch.bfloat16, torch.complex128, torch.float8_e5m2]


def allgather_cases(g, ref, dev, tag, *, staging_bytes=None, dtypes=ALL_DTYPES, big=True, quick=False,
                    in_flight_stream=None):
    """The protocol's correctness cases, for one group. quick: fewer dtypes and sizes (for subgroups)."""
    ag = AG(g, ref, dev, tag)
    W = ag.W
    cases = []
    if quick:
        dtypes = [d for d in dtypes if d in QUICK_DTYPES]

    def add(name, fn):
        if quick and any(name.startswith(p) for p in ("uint8_bytes=4095", "uint8_bytes=65537", "float32_odd",
                                                       "shape_3d", "zero_elements_2d", "inplace_async_n=1",
                                                       "list_odd", "coalesced_cm_single")):
            return
        cases.append((f"{tag}/{name}", fn))

    # sizes
    add("zero_elements", lambda: ag.into_tensor("zero", (0,), torch.float32))
    add("zero_elements_list", lambda: ag.as_list("zero_l", (0,), torch.float32))
    add("zero_elements_2d", lambda: ag.into_tensor("zero2d", (0, 5), torch.float32))
    for n in (1, 3, 7, 4095, 4097, 65537, 1000003):
        add(f"uint8_bytes={n}", lambda n=n: ag.into_tensor(f"u8_{n}", (n,), torch.uint8))
    for n in (1, 3, 7, 1001):
        add(f"float32_odd_numel={n}", lambda n=n: ag.into_tensor(f"f32_{n}", (n,), torch.float32))
    add("shape_2d_cat", lambda: ag.into_tensor("s2c", (7, 9), torch.float32))
    add("shape_3d_cat", lambda: ag.into_tensor("s3c", (3, 5, 2), torch.float16))
    add("output_stacked(W,n)", lambda: ag.into_tensor("stk", (11,), torch.float32, out_layout="stack"))
    add("output_flat_from_2d_input", lambda: ag.into_tensor("flt", (4, 6), torch.int32, out_layout="flat"))
    # every dtype, several sizes, the two main forms
    for dt in dtypes:
        for n in (1, 5, 1027):
            add(f"dtype[{dt}]_n={n}", lambda dt=dt, n=n: ag.into_tensor(f"dt{dt}{n}", (n,), dt))
        add(f"dtype[{dt}]_list", lambda dt=dt: ag.as_list(f"dtl{dt}", (33,), dt))
        add(f"dtype[{dt}]_inplace", lambda dt=dt: ag.into_tensor(f"dti{dt}", (129,), dt, inplace=True))
    # in place (FSDP2 / ZeRO-3 call it this way)
    for n in (1, 17, 100003):
        add(f"inplace_n={n}", lambda n=n: ag.into_tensor(f"ip{n}", (n,), torch.bfloat16, inplace=True))
        add(f"inplace_async_n={n}", lambda n=n: ag.into_tensor(f"ipa{n}", (n,), torch.float32, inplace=True,
                                                                 async_op=True))
    add("inplace_2d", lambda: ag.into_tensor("ip2d", (6, 10), torch.float32, inplace=True))
    # list form
    add("list_2d", lambda: ag.as_list("l2d", (5, 3), torch.float64))
    add("list_async", lambda: ag.as_list("lasync", (1000,), torch.int64, async_op=True))
    add("list_odd_bytes", lambda: ag.as_list("lodd", (12347,), torch.uint8))
    # async single
    add("async_into_tensor", lambda: ag.into_tensor("asy", (4099,), torch.float32, async_op=True))
    # coalesced
    mixed = [((5,), torch.float32), ((1,), torch.uint8), ((33, 3), torch.bfloat16), ((0,), torch.float32),
             ((1001,), torch.int64), ((7,), torch.complex64), ((64,), torch.bool), ((9,), torch.float8_e4m3fn)]
    add("coalesced_cm_mixed", lambda: ag.coalesced_cm("cm", mixed))
    add("coalesced_cm_mixed_async", lambda: ag.coalesced_cm("cma", mixed, async_op=True))
    add("coalesced_cm_mixed_inplace",
        lambda: ag.coalesced_cm("cmi", mixed[:3] + mixed[4:], inplace=True, async_op=True))
    add("coalesced_cm_single", lambda: ag.coalesced_cm("cm1", [((100,), torch.float32)]))
    add("all_gather_coalesced", lambda: ag.coalesced_legacy("agc", [(5,), (3, 4), (1,), (1000,)], torch.float32))
    add("all_gather_coalesced_async", lambda: ag.coalesced_legacy("agca", [(7,), (2, 2)], torch.int32, async_op=True))
    add("all_gather_coalesced_with_empty", lambda: ag.coalesced_legacy("agce", [(0,), (3,)], torch.float64))
    # work.get_future(): a future whose value holds the output tensors
    add("get_future", lambda: future_case(ag, "fut"))
    # many in flight
    add("100_in_flight", lambda: ag.many_in_flight("fl100", n=100, base=500, stream=in_flight_stream))
    add("mixed_forms_in_flight", lambda: mixed_forms_in_flight(ag, "mix"))
    # larger than the staging memory
    if big and staging_bytes:
        S = staging_bytes
        for n in sorted({max(1, S // W - 1), S // W, S // W + 1, S - 1, S, S + 1, 2 * S + 3}):
            add(f"staging_edge_bytes={n}", lambda n=n: ag.into_tensor(f"se{n}", (n,), torch.uint8))
        big_n = max(3 * (1 << 20), 8 * S) + 5
        add(f"bigger_than_staging_uint8={big_n}", lambda: ag.into_tensor("big8", (big_n,), torch.uint8))
        add("bigger_than_staging_f32_inplace", lambda: ag.into_tensor("bigip", (big_n // 4,), torch.float32,
                                                                       inplace=True))
        add("bigger_than_staging_list", lambda: ag.as_list("bigl", (big_n // 2,), torch.int16))
        add("bigger_than_staging_coalesced", lambda: ag.coalesced_cm(
            "bigc", [((big_n // 4,), torch.float32), ((3,), torch.uint8), ((big_n // 2 + 1,), torch.bfloat16)]))
        add("bigger_than_staging_in_flight", lambda: ag.many_in_flight("bigfl", n=6, base=big_n // 8))
    return cases


def stats_cases(g, ref, dev, tag, device_name):
    """The all-gathers of g are counted on a DMA path with their output bytes ("dma", or "dma:direct" for
    all_gather_into_tensor where the direct path is on); group_path says 'dma'."""
    import torch_sdma

    ag = AG(g, ref, dev, tag)
    W = ag.W

    def on_dma(s):
        return stats_calls(s, lambda k: k in DMA_KEYS)

    def check():
        # warm-up so that the path is known
        ag.into_tensor("stw", (16,), torch.float32)
        assert torch_sdma.group_path(g, device=device_name) == "dma", torch_sdma.group_path(g, device=device_name)
        torch_sdma.reset_stats(g)
        s = torch_sdma.stats(g)
        assert stats_calls(s, lambda k: True)[0] == 0, f"reset_stats left counts: {s}"
        ag.into_tensor("st1", (1000,), torch.float32)
        ag.into_tensor("st2", (33,), torch.uint8, async_op=True)
        s = torch_sdma.stats(g)
        assert on_dma(s) == (2, W * (4000 + 33)), (s, W * 4033)
        direct = s.get("dma:direct")
        if direct:  # how this rank's pairs settled: one count per peer per call
            settled = direct["pairs_each_pushing_own"] + direct["pairs_one_moving_both"]
            assert settled == 2 * (W - 1), s
        ag.as_list("st3", (10,), torch.float64)
        s2 = torch_sdma.stats(g)
        assert on_dma(s2) == (3, W * (4000 + 33 + 80)), s2
        ag.coalesced_cm("st4", [((10,), torch.float32), ((3,), torch.int64)])
        s3 = torch_sdma.stats(g)
        assert on_dma(s3)[0] >= 4, f"coalesced all-gather not counted on dma: {s3}"
        c_before = on_dma(s3)[0]
        ag.coalesced_legacy("st5", [(4,), (2,)], torch.float32)
        s4 = torch_sdma.stats(g)
        assert on_dma(s4)[0] > c_before, f"all_gather_coalesced not counted on dma: {s4}"
        assert not any(k.startswith("inner:") for k in s4), f"some all-gathers went to the inner backend: {s4}"

    return [(f"{tag}/stats_dma", check)]




def interleaved_groups_case(g1, r1, g2, r2, dev, tag, n=20):
    """Async all-gathers alternating between two groups (that may share members), then wait all, check all."""
    a1 = AG(g1, r1, dev, tag + "/g1") if g1 is not None else None
    a2 = AG(g2, r2, dev, tag + "/g2") if g2 is not None else None

    def fn():
        items = []
        for k in range(n):
            for ag in (a1, a2):
                if ag is None:
                    continue
                dt = (torch.float32, torch.uint8, torch.bfloat16)[k % 3]
                shape = (300 + 91 * k,)
                x = ag.x(f"il{k}", shape, dt)
                e = ag.local_expected(f"il{k}", shape, dt)
                o = poison_(torch.empty(ag.W * shape[0], dtype=dt, device=dev), e)
                items.append((ag, k, x, e, o))
        works = [dist.all_gather_into_tensor(o, x, group=ag.g, async_op=True) for ag, k, x, e, o in items]
        # also a delegated collective on each group in between (not where the ranks share a GPU: the inner NCCL
        # cannot run there)
        for ag in (a1, a2):
            if ag is not None and not (SHARE_GPU and dev.type == "cuda"):
                t = torch.ones(3, device=dev)
                dist.all_reduce(t, group=ag.g)
                assert torch.equal(t, torch.full((3,), float(ag.W), device=dev))
        for w in works:
            w.wait()
        for ag, k, x, e, o in items:
            assert_bytes_equal(o, e, f"interleaved group {ag.tag} #{k}")

    return (f"{tag}/two_groups_interleaved", fn)


def dtype_sweep_cases(g, ref, dev, tag, min_bytes):
    """Every dtype below and above the group's TORCH_SDMA_MIN_BYTES (`min_bytes`, in output bytes), in every form:
    the same call must work whichever path takes it (the inner path gathers the bytes of dtypes its backend lacks),
    bit-exact, and the stats must show both paths."""
    import torch_sdma

    ag = AG(g, ref, dev, tag)
    W = ag.W
    cases = []
    for dt in EVERY_DTYPE:
        es = torch.empty((), dtype=dt).element_size()
        small = max(1, (min_bytes - 1) // (3 * W * es) - 1)  # the legacy coalesced form gathers 3x this
        large = min_bytes // (W * es) + 3

        def sweep(dt=dt, small=small, large=large):
            torch_sdma.reset_stats(g)
            for n, size in (("below", small), ("above", large)):
                name = f"{dt}_{n}"
                ag.into_tensor(f"{name}_into", (size,), dt)
                ag.into_tensor(f"{name}_inplace", (size,), dt, inplace=True, async_op=True)
                ag.as_list(f"{name}_list", (size,), dt)
                ag.coalesced_cm(f"{name}_cm", [((size,), dt), ((size + 1,), dt)], async_op=True)
                ag.coalesced_legacy(f"{name}_legacy", [(size,), (2, size)], dt)
            s = torch_sdma.stats(g)
            below = stats_calls(s, lambda k: k == "inner:below TORCH_SDMA_MIN_BYTES")[0]
            above = stats_calls(s, lambda k: k in DMA_KEYS)[0]
            # NCCL has no all_gather_coalesced: that form stays on the DMA path at every size on GPUs.
            lacking = 1 if dev.type == "cuda" else 0
            assert (below, above) == (5 - lacking, 5 + lacking), f"{dt}: calls per path: {s}"

        cases.append((f"{tag}/dtype_sweep[{dt}]", sweep))
    return cases
