"""Device-generic checks shared by the CPU suites (reference: gloo) and the GPU suites (reference: nccl).

Every check compares bytes exactly. Inputs are random (seeded per case and per rank, so that every rank can
also rebuild every peer's input locally); outputs are poisoned first with the bitwise NOT of the expected
bytes, so that any byte the backend fails to write differs from what is expected.
"""
from __future__ import annotations

import contextlib
import math
import pickle
import time
import warnings
import zlib

import torch
import torch.distributed as dist

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

# words NCCL uses (ProcessGroupNCCL.cpp), that the sdma backend must reuse
MSG_SIZE = "output tensor size must be equal to world_size times input tensor size"
MSG_TYPE = "output tensor must have the same type as input tensor"
MSG_CONTIG = "Tensors must be contiguous"

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*will be deprecated.*", category=FutureWarning)


# ----------------------------------------------------------------------------------------------- data
def seed_of(name, rank):
    return zlib.crc32(f"{name}|{rank}".encode()) & 0x7FFFFFFF


def rand(name, rank, shape, dtype, device="cpu", kind="bytes"):
    """Random tensor for (case name, rank). kind: 'bytes' (any bit pattern), 'normal', 'int' (small ints)."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator()
    g.manual_seed(seed_of(name, rank))
    n = math.prod(shape)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    elif kind == "normal" and (dtype.is_floating_point or dtype.is_complex):
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    elif kind == "int":
        t = torch.randint(-8, 9, (n,), generator=g, dtype=torch.int64).to(dtype)
        if dtype.is_floating_point:
            t = t.to(dtype)
    else:
        es = torch.empty((), dtype=dtype).element_size()
        t = torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8).view(dtype)
    return t.reshape(shape).to(device)


def raw(t):
    """The bytes of a tensor, flat uint8 on the CPU."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).cpu()


def nbytes(t):
    return t.numel() * t.element_size()


def poison_(t, expected_bytes=None, pattern=0xA5):
    """Fill t's bytes with NOT(expected) (so every byte differs from what is expected), or with `pattern`."""
    with torch.no_grad():
        b = t.view(-1).view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)
        if expected_bytes is None:
            b.fill_(pattern)
        else:
            assert expected_bytes.numel() == b.numel(), (expected_bytes.numel(), b.numel())
            b.copy_(torch.bitwise_not(expected_bytes).to(b.device))
    return t


def assert_bytes_equal(got, expected, what=""):
    g = raw(got)
    e = raw(expected)
    e = e.cpu()
    if g.numel() != e.numel():
        raise AssertionError(f"{what}: {g.numel()} bytes, expected {e.numel()}")
    if not torch.equal(g, e):
        bad = (g != e).nonzero().flatten()
        first = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {e.numel()} bytes differ; first at byte {first}: "
            f"got 0x{int(g[first]):02x} expected 0x{int(e[first]):02x}; "
            f"last at byte {int(bad[-1])}; poison-like bytes (unwritten): "
            f"{int((g[bad] == torch.bitwise_not(e[bad])).sum())}"
        )


def expected_concat(name, ranks, shape, dtype, kind="bytes"):
    """Bytes of the concatenation of every member's input, rebuilt locally from the seeds."""
    return torch.cat([raw(rand(name, r, shape, dtype, "cpu", kind)) for r in ranks])


def group_ranks(g):
    """Global ranks of g's members, in group-rank order."""
    return [dist.get_global_rank(g, i) for i in range(dist.get_world_size(g))]


# -------------------------------------------------------------------------------------------- helpers
def _call_both(ref_fn, sdma_fn, what, sdma_may_support_more=False):
    """Run ref_fn() then sdma_fn(). If the reference raised, the sdma call must raise the same type.

    Returns (ref_result, sdma_result, ref_exc)."""
    ref_exc = None
    ref_res = None
    try:
        ref_res = ref_fn()
    except Exception as e:  # noqa: BLE001
        ref_exc = e
    try:
        res = sdma_fn()
    except Exception as e:  # noqa: BLE001
        if ref_exc is None:
            raise AssertionError(f"{what}: the reference succeeded but sdma raised {type(e).__name__}: {e}") from e
        if not isinstance(e, type(ref_exc)) and not isinstance(ref_exc, type(e)):
            raise AssertionError(
                f"{what}: reference raised {type(ref_exc).__name__}: {ref_exc}; sdma raised a different kind: "
                f"{type(e).__name__}: {e}"
            ) from e
        return None, None, ref_exc
    if ref_exc is not None and not sdma_may_support_more:
        raise AssertionError(
            f"{what}: reference raised {type(ref_exc).__name__}: {ref_exc} but sdma silently succeeded"
        )
    return ref_res, res, ref_exc


def _wait(w):
    if w is not None:
        w.wait()


def stats_calls(stats, pred):
    c = b = 0
    for k, v in stats.items():
        if pred(k):
            c += int(v["calls"])
            b += int(v["bytes"])
    return c, b


def _norm(k):
    return k.lower().replace("_", "").replace(" ", "")


# ------------------------------------------------------------------------------------- delegation cases
def delegation_cases(g, ref, dev, tag, *, cpu_ops=True, sdma_stats=None, extra_ops=True):
    """(name, fn) checks that every collective on `g` gives the bytes the same collective gives on `ref`.

    g and ref must have the same members. dev: torch.device of the tensors. sdma_stats: callable(group) ->
    stats dict when `g` routes tensors of `dev` through sdma (then "delegated:<op>" counts are checked)."""
    W = dist.get_world_size(g)
    me = dist.get_rank(g)
    ranks = group_ranks(g)
    assert ranks == group_ranks(ref), (ranks, group_ranks(ref))
    my_global = ranks[me]
    cases = []

    def case(name):
        def deco(fn):
            cases.append((f"{tag}/{name}", fn))
            return fn

        return deco

    def R(name, shape, dtype=torch.float32, kind="normal", rank=None):
        return rand(f"{tag}/{name}", my_global if rank is None else rank, shape, dtype, dev, kind)

    # broadcast ------------------------------------------------------------------------------------------
    for src_i, src in enumerate(ranks):
        for dt in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):

            @case(f"broadcast[src={src},{dt}]")
            def _(src=src, dt=dt):
                x = R(f"bc{src}{dt}", (37, 3), dt, "bytes")
                a, b = x.clone(), x.clone()
                dist.broadcast(a, src, group=ref)
                dist.broadcast(b, src, group=g)
                assert_bytes_equal(b, a, "broadcast")
                assert_bytes_equal(b, rand(f"{tag}/bc{src}{dt}", src, (37, 3), dt, "cpu", "bytes"), "broadcast vs src")

    # all_reduce -----------------------------------------------------------------------------------------
    RO = dist.ReduceOp
    ar_matrix = [
        (torch.float32, [RO.SUM, RO.PRODUCT, RO.MIN, RO.MAX, RO.AVG]),
        (torch.float64, [RO.SUM, RO.MAX]),
        (torch.bfloat16, [RO.SUM]),
        (torch.float16, [RO.SUM]),
        (torch.int64, [RO.SUM, RO.PRODUCT, RO.MIN, RO.MAX, RO.BAND, RO.BOR, RO.BXOR]),
        (torch.int32, [RO.SUM, RO.MAX]),
        (torch.uint8, [RO.SUM, RO.BXOR]),
    ]
    for dt, ops in ar_matrix:
        for op in ops:

            @case(f"all_reduce[{op},{dt}]")
            def _(dt=dt, op=op):
                x = R(f"ar{dt}{op}", (1003,), dt, "normal" if dt.is_floating_point else "int")
                a, b = x.clone(), x.clone()
                _, _, exc = _call_both(
                    lambda: dist.all_reduce(a, op=op, group=ref),
                    lambda: dist.all_reduce(b, op=op, group=g),
                    f"all_reduce {op} {dt}",
                )
                if exc is None:
                    assert_bytes_equal(b, a, f"all_reduce {op} {dt}")

    @case("all_reduce[premul_sum]")
    def _():
        x = R("arpremul", (64,), torch.float32)
        a, b = x.clone(), x.clone()
        try:
            op_ref = dist._make_nccl_premul_sum(2.0)
        except Exception:  # noqa: BLE001
            return
        _, _, exc = _call_both(
            lambda: dist.all_reduce(a, op=op_ref, group=ref),
            lambda: dist.all_reduce(b, op=dist._make_nccl_premul_sum(2.0), group=g),
            "all_reduce premul_sum",
        )
        if exc is None:
            assert_bytes_equal(b, a, "all_reduce premul_sum")

    # reduce ---------------------------------------------------------------------------------------------
    for dst in ranks:
        for op in (RO.SUM, RO.MAX):

            @case(f"reduce[dst={dst},{op}]")
            def _(dst=dst, op=op):
                x = R(f"red{dst}{op}", (513,), torch.float32)
                a, b = x.clone(), x.clone()
                _call_both(
                    lambda: dist.reduce(a, dst, op=op, group=ref),
                    lambda: dist.reduce(b, dst, op=op, group=g),
                    "reduce",
                )
                if my_global == dst:
                    assert_bytes_equal(b, a, f"reduce at dst {dst}")

    # all_gather (list), all_gather_into_tensor -------------------------------------------------------------
    for dt in (torch.float32, torch.bfloat16, torch.int64):

        @case(f"all_gather_list[{dt}]")
        def _(dt=dt):
            x = R(f"agl{dt}", (129,), dt, "bytes")
            a = [poison_(torch.empty(129, dtype=dt, device=dev)) for _ in range(W)]
            dist.all_gather(a, x, group=ref)
            exp = torch.cat([raw(t) for t in a])
            b = [torch.empty(129, dtype=dt, device=dev) for _ in range(W)]
            for j in range(W):
                poison_(b[j], raw(a[j]))
            dist.all_gather(b, x, group=g)
            assert_bytes_equal(torch.cat([raw(t) for t in b]), exp, "all_gather list")

        @case(f"all_gather_into_tensor[{dt}]")
        def _(dt=dt):
            x = R(f"agt{dt}", (65, 3), dt, "bytes")
            a = poison_(torch.empty(65 * W, 3, dtype=dt, device=dev))
            dist.all_gather_into_tensor(a, x, group=ref)
            b = poison_(torch.empty(65 * W, 3, dtype=dt, device=dev), raw(a))
            dist.all_gather_into_tensor(b, x, group=g)
            assert_bytes_equal(b, a, "all_gather_into_tensor")
            assert_bytes_equal(b, expected_concat(f"{tag}/agt{dt}", ranks, (65, 3), dt), "vs local concat")

    @case("all_gather_object")
    def _():
        obj = {"rank": my_global, "payload": R("ago", (17,), torch.float64).cpu().tolist(), "s": "x" * me}
        a = [None] * W
        b = [None] * W
        dist.all_gather_object(a, obj, group=ref)
        dist.all_gather_object(b, obj, group=g)
        assert pickle.dumps(a) == pickle.dumps(b), (a, b)
        assert [o["rank"] for o in b] == ranks

    # gather / scatter -------------------------------------------------------------------------------------
    for root in ranks:

        @case(f"gather[dst={root}]")
        def _(root=root):
            x = R(f"ga{root}", (77,), torch.float32, "bytes")
            if my_global == root:
                a = [poison_(torch.empty(77, device=dev)) for _ in range(W)]
                b = [poison_(torch.empty(77, device=dev)) for _ in range(W)]
            else:
                a = b = None
            _, _, exc = _call_both(
                lambda: dist.gather(x, a, dst=root, group=ref),
                lambda: dist.gather(x, b, dst=root, group=g),
                "gather",
            )
            if exc is None and my_global == root:
                assert_bytes_equal(torch.cat([raw(t) for t in b]), torch.cat([raw(t) for t in a]), "gather")

        @case(f"scatter[src={root}]")
        def _(root=root):
            chunks = [R(f"sc{root}_{j}", (91,), torch.float32, "bytes") for j in range(W)] if my_global == root else None
            a = poison_(torch.empty(91, device=dev))
            b = poison_(torch.empty(91, device=dev))
            _, _, exc = _call_both(
                lambda: dist.scatter(a, chunks, src=root, group=ref),
                lambda: dist.scatter(b, [c.clone() for c in chunks] if chunks else None, src=root, group=g),
                "scatter",
            )
            if exc is None:
                assert_bytes_equal(b, a, "scatter")

        @case(f"gather_object[dst={root}]")
        def _(root=root):
            obj = ("o", my_global, list(range(me + 3)))
            a = [None] * W if my_global == root else None
            b = [None] * W if my_global == root else None
            _, _, exc = _call_both(
                lambda: dist.gather_object(obj, a, dst=root, group=ref),
                lambda: dist.gather_object(obj, b, dst=root, group=g),
                "gather_object",
            )
            if exc is None and my_global == root:
                assert a == b, (a, b)

        @case(f"scatter_object_list[src={root}]")
        def _(root=root):
            objs = [{"to": j, "v": j * 7 + 1} for j in range(W)] if my_global == root else None
            a, b = [None], [None]
            _, _, exc = _call_both(
                lambda: dist.scatter_object_list(a, objs, src=root, group=ref),
                lambda: dist.scatter_object_list(b, objs, src=root, group=g),
                "scatter_object_list",
            )
            if exc is None:
                assert a == b == [{"to": me, "v": me * 7 + 1}], (a, b)

        @case(f"broadcast_object_list[src={root}]")
        def _(root=root):
            objs = [{"from": my_global}, "str", 3.5, None] if my_global == root else [None] * 4
            a, b = list(objs), list(objs)
            dist.broadcast_object_list(a, src=root, group=ref)
            dist.broadcast_object_list(b, src=root, group=g)
            assert a == b and a[0] == {"from": root}, (a, b)

    # reduce_scatter ----------------------------------------------------------------------------------------
    for op in (RO.SUM, RO.MAX):

        @case(f"reduce_scatter_list[{op}]")
        def _(op=op):
            ins = [R(f"rsl{op}{j}", (55,), torch.float32) for j in range(W)]
            a = poison_(torch.empty(55, device=dev))
            b = poison_(torch.empty(55, device=dev))
            _, _, exc = _call_both(
                lambda: dist.reduce_scatter(a, [t.clone() for t in ins], op=op, group=ref),
                lambda: dist.reduce_scatter(b, [t.clone() for t in ins], op=op, group=g),
                "reduce_scatter",
            )
            if exc is None:
                assert_bytes_equal(b, a, "reduce_scatter")

        @case(f"reduce_scatter_tensor[{op}]")
        def _(op=op):
            x = R(f"rst{op}", (W * 33,), torch.float32)
            a = poison_(torch.empty(33, device=dev))
            b = poison_(torch.empty(33, device=dev))
            _, _, exc = _call_both(
                lambda: dist.reduce_scatter_tensor(a, x.clone(), op=op, group=ref),
                lambda: dist.reduce_scatter_tensor(b, x.clone(), op=op, group=g),
                "reduce_scatter_tensor",
            )
            if exc is None:
                assert_bytes_equal(b, a, "reduce_scatter_tensor")

    # all_to_all -----------------------------------------------------------------------------------------
    @case("all_to_all_list")
    def _():
        ins = [R(f"a2a{j}", (13 + j,), torch.float32, "bytes") for j in range(W)]
        a = [poison_(torch.empty(13 + me, device=dev)) for _ in range(W)]
        b = [poison_(torch.empty(13 + me, device=dev)) for _ in range(W)]
        _, _, exc = _call_both(
            lambda: dist.all_to_all(a, ins, group=ref),
            lambda: dist.all_to_all(b, ins, group=g),
            "all_to_all",
        )
        if exc is None:
            assert_bytes_equal(torch.cat([raw(t) for t in b]), torch.cat([raw(t) for t in a]), "all_to_all")

    @case("all_to_all_single_even")
    def _():
        x = R("a2as", (W * 21, 2), torch.float32, "bytes")
        a = poison_(torch.empty(W * 21, 2, device=dev))
        b = poison_(torch.empty(W * 21, 2, device=dev))
        _, _, exc = _call_both(
            lambda: dist.all_to_all_single(a, x, group=ref),
            lambda: dist.all_to_all_single(b, x, group=g),
            "all_to_all_single",
        )
        if exc is None:
            assert_bytes_equal(b, a, "all_to_all_single")

    @case("all_to_all_single_uneven")
    def _():
        def s(i, j):  # elements group-rank i sends to group-rank j
            return (i + 2 * j) % 3 + 1

        in_splits = [s(me, j) for j in range(W)]
        out_splits = [s(j, me) for j in range(W)]
        x = R("a2au", (sum(in_splits),), torch.float32, "bytes")
        a = poison_(torch.empty(sum(out_splits), device=dev))
        b = poison_(torch.empty(sum(out_splits), device=dev))
        _, _, exc = _call_both(
            lambda: dist.all_to_all_single(a, x, out_splits, in_splits, group=ref),
            lambda: dist.all_to_all_single(b, x, out_splits, in_splits, group=g),
            "all_to_all_single uneven",
        )
        if exc is None:
            assert_bytes_equal(b, a, "all_to_all_single uneven")

    # point to point --------------------------------------------------------------------------------------
    if W > 1:
        nxt, prv = ranks[(me + 1) % W], ranks[(me - 1) % W]

        def ring(grp, mode, name):
            x = R(name, (301,), torch.float32, "bytes")
            y = poison_(torch.empty(301, device=dev))
            if mode == "blocking":
                if me % 2 == 0:
                    dist.send(x, nxt, group=grp)
                    dist.recv(y, prv, group=grp)
                else:
                    dist.recv(y, prv, group=grp)
                    dist.send(x, nxt, group=grp)
            elif mode == "async":
                # even ranks send first, odd ranks receive first: unbatched NCCL sends to a peer that is itself
                # blocked in a send deadlock while the pair's first connection is being set up
                send, recv = (lambda: dist.isend(x, nxt, group=grp)), (lambda: dist.irecv(y, prv, group=grp))
                ws = [send(), recv()] if me % 2 == 0 else [recv(), send()]
                for w in ws:
                    w.wait()
            else:
                ops = [dist.P2POp(dist.isend, x, nxt, grp), dist.P2POp(dist.irecv, y, prv, grp)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            return y

        for mode in ("blocking", "async", "batch"):

            @case(f"send_recv[{mode}]")
            def _(mode=mode):
                a, b, exc = _call_both(
                    lambda: ring(ref, mode, f"p2p{mode}"), lambda: ring(g, mode, f"p2p{mode}"), f"p2p {mode}"
                )
                if exc is None:
                    assert_bytes_equal(b, a, f"send/recv {mode}")
                    assert_bytes_equal(b, rand(f"{tag}/p2p{mode}", prv, (301,), torch.float32, "cpu"), "vs sender")

    # barriers ------------------------------------------------------------------------------------------
    @case("barrier")
    def _():
        dist.barrier(group=g)
        w = dist.barrier(group=g, async_op=True)
        w.wait()

    # torch <= 2.13 refuses monitored_barrier in Python for any group whose backend string is not exactly
    # "gloo" (even "cpu:gloo,cuda:nccl"); 2.14 accepts any group with a CPU backend.
    if cpu_ops and TORCH_VERSION >= (2, 14):

        @case("monitored_barrier")
        def _():
            _call_both(
                lambda: dist.monitored_barrier(group=ref, timeout=None, wait_all_ranks=True),
                lambda: dist.monitored_barrier(group=g, timeout=None, wait_all_ranks=True),
                "monitored_barrier",
            )

    # coalesced -----------------------------------------------------------------------------------------
    @case("all_reduce_coalesced")
    def _():
        xs = [R("arc0", (31,), torch.float32), R("arc1", (4, 5), torch.float32), R("arc2", (1,), torch.float32)]
        a = [t.clone() for t in xs]
        b = [t.clone() for t in xs]
        _, _, exc = _call_both(
            lambda: dist.all_reduce_coalesced(a, group=ref),
            lambda: dist.all_reduce_coalesced(b, group=g),
            "all_reduce_coalesced",
        )
        if exc is None:
            for i in range(3):
                assert_bytes_equal(b[i], a[i], f"all_reduce_coalesced[{i}]")

    for async_ops in (False, True):

        @case(f"coalescing_manager_all_reduce[async={async_ops}]")
        def _(async_ops=async_ops):
            xs = [R(f"cmar{k}", (17 * (k + 1),), torch.float32) for k in range(3)]
            outs = []
            for grp in (ref, g):
                ts = [t.clone() for t in xs]
                with _cm(grp, async_ops=async_ops) as cm:
                    for t in ts:
                        dist.all_reduce(t, group=grp)
                if async_ops:
                    cm.wait()
                outs.append(ts)
            for i in range(3):
                assert_bytes_equal(outs[1][i], outs[0][i], f"coalesced all_reduce[{i}]")

        @case(f"coalescing_manager_all_gather_into_tensor[async={async_ops}]")
        def _(async_ops=async_ops):
            # one dtype: gloo's allgather_into_tensor_coalesced concatenates its inputs with torch.cat, which
            # promotes mixed dtypes (int64 bytes come back changed). Mixed dtypes: the protocol suites.
            specs = [((19,), torch.float32), ((3, 5), torch.float32), ((8,), torch.float32)]
            xs = [R(f"cmag{k}", s, dt, "bytes") for k, (s, dt) in enumerate(specs)]
            exp = [expected_concat(f"{tag}/cmag{k}", ranks, s, dt) for k, (s, dt) in enumerate(specs)]
            for grp, what in ((ref, "ref"), (g, "sdma")):
                outs = [
                    poison_(torch.empty((W * s[0],) + s[1:], dtype=dt, device=dev), exp[k])
                    for k, (s, dt) in enumerate(specs)
                ]
                with _cm(grp, async_ops=async_ops) as cm:
                    for o, x in zip(outs, xs):
                        dist.all_gather_into_tensor(o, x, group=grp)
                if async_ops:
                    cm.wait()
                for k in range(len(specs)):
                    assert_bytes_equal(outs[k], exp[k], f"{what} coalesced all_gather[{k}]")

        @case(f"coalescing_manager_reduce_scatter_tensor[async={async_ops}]")
        def _(async_ops=async_ops):
            xs = [R(f"cmrs{k}", (W * (k + 2),), torch.float32) for k in range(2)]
            res = []
            for grp in (ref, g):

                def go(grp=grp):
                    outs = [poison_(torch.empty(k + 2, device=dev)) for k in range(2)]
                    with _cm(grp, async_ops=async_ops) as cm:
                        for o, x in zip(outs, xs):
                            dist.reduce_scatter_tensor(o, x.clone(), group=grp)
                    if async_ops:
                        cm.wait()
                    return outs

                res.append(go)
            a, b, exc = _call_both(res[0], res[1], "coalesced reduce_scatter_tensor")
            if exc is None:
                for k in range(2):
                    assert_bytes_equal(b[k], a[k], f"coalesced reduce_scatter[{k}]")

    @case("coalescing_manager_device_form_all_reduce")
    def _():
        # the DeepSpeed form: start/endCoalescing on the backend. sdma may support it where the reference doesn't
        # (then it is compared with plain all_reduces: integer data, so that any summation order is exact).
        xs = [R(f"cmd{k}", (23,), torch.int64, "int") for k in range(2)]

        def go(grp):
            ts = [t.clone() for t in xs]
            with _cm(grp, device=dev, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, group=grp)
            cm.wait()
            return ts

        a, b, exc = _call_both(lambda: go(ref), lambda: go(g), "coalescing device form", sdma_may_support_more=True)
        if exc is None:
            for k in range(2):
                assert_bytes_equal(b[k], a[k], f"device-form coalesced all_reduce[{k}]")
        elif b is not None:  # sdma supports it, the reference doesn't: compare with plain all_reduce on ref
            for k in range(2):
                t = xs[k].clone()
                dist.all_reduce(t, group=ref)
                assert_bytes_equal(b[k], t, f"device-form coalesced all_reduce[{k}]")

    # async handles --------------------------------------------------------------------------------------
    @case("async_handles")
    def _():
        xs = [R(f"as{k}", (257,), torch.float32) for k in range(8)]
        a = [t.clone() for t in xs]
        b = [t.clone() for t in xs]
        wa = [dist.all_reduce(t, group=ref, async_op=True) for t in a]
        wb = [dist.all_reduce(t, group=g, async_op=True) for t in b]
        for w in wa + wb:
            assert w is not None
            w.wait()
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()  # wait() only orders the stream, as with NCCL
        for w in wb:
            assert w.is_completed(), "is_completed() is False after wait() and a stream synchronize"
        for k in range(8):
            assert_bytes_equal(b[k], a[k], f"async all_reduce[{k}]")
        # a broadcast and an all_gather async too
        y = R("asb", (99,), torch.float32)
        ya, yb = y.clone(), y.clone()
        dist.broadcast(ya, ranks[-1], group=ref, async_op=True).wait()
        w = dist.broadcast(yb, ranks[-1], group=g, async_op=True)
        w.wait()
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()
        assert w.is_completed(), "is_completed() is False after wait() and a stream synchronize"
        assert_bytes_equal(yb, ya, "async broadcast")

    @case("async_get_future")
    def _():
        x = R("fut", (64,), torch.float32)
        a, b = x.clone(), x.clone()
        fa = dist.all_reduce(a, group=ref, async_op=True).get_future()
        fb = dist.all_reduce(b, group=g, async_op=True).get_future()
        va = fa.wait()
        vb = fb.wait()
        assert isinstance(vb, list) and len(vb) == 1, type(vb)
        assert_bytes_equal(vb[0], va[0], "future value")
        assert_bytes_equal(b, a, "future all_reduce")

    # stats -----------------------------------------------------------------------------------------------
    if sdma_stats is not None:

        @case("stats_delegated_counts")
        def _():
            import torch_sdma

            torch_sdma.reset_stats(g)
            s0 = sdma_stats(g)
            assert stats_calls(s0, lambda k: True)[0] == 0, f"reset_stats left counts: {s0}"
            x = R("st", (250,), torch.float32)
            dist.all_reduce(x, group=g)
            dist.all_reduce(x, group=g)
            dist.broadcast(x, ranks[0], group=g)
            if dev.type == "cuda":  # without device_ids a "cpu:gloo,cuda:sdma" group runs barrier() on gloo
                dist.barrier(group=g, device_ids=[dev.index])
            else:
                dist.barrier(group=g)
            s = sdma_stats(g)
            keys = list(s)
            assert all(k == "dma" or k.startswith("inner:") or k.startswith("delegated:") for k in keys), keys
            c, b = stats_calls(s, lambda k: k.startswith("delegated:") and "allreduce" in _norm(k))
            assert c == 2, f"expected 2 delegated all_reduce calls, stats: {s}"
            assert b == 2 * nbytes(x), f"expected {2 * nbytes(x)} bytes for the all_reduce calls, stats: {s}"
            c, _ = stats_calls(s, lambda k: k.startswith("delegated:") and "broadcast" in _norm(k))
            assert c == 1, f"expected 1 delegated broadcast call, stats: {s}"
            c, _ = stats_calls(s, lambda k: k.startswith("delegated:") and "barrier" in _norm(k))
            assert c >= 1, f"expected a delegated barrier call, stats: {s}"

    return cases


# ------------------------------------------------------------------------------------ all-gather cases
class AG:
    """All-gather checks on group g (sdma) against ref (gloo/nccl) with the same members."""

    def __init__(self, g, ref, dev, tag):
        self.g, self.ref, self.dev, self.tag = g, ref, dev, tag
        self.W = dist.get_world_size(g)
        self.me = dist.get_rank(g)
        self.ranks = group_ranks(g)
        assert self.ranks == group_ranks(ref)
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
        e = self.ref_expected(x)
        loc = self.local_expected(name, shape, dtype)
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
            inp = flat.narrow(0, me * n, n).view(x.shape) if out_layout != "cat" else out.narrow(0, me * shape[0], shape[0])
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
        with _cm(self.g, async_ops=async_op) as cm:
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


@contextlib.contextmanager
def _cm(group, device=None, async_ops=False):
    """dist._coalescing_manager that never leaves the group in 'coalescing' state after an error
    (torch leaves its op list behind when start_coalescing raises, which silently swallows every later
    collective on that group)."""
    try:
        with dist._coalescing_manager(group=group, device=device, async_ops=async_ops) as cm:
            yield cm
    except BaseException:
        dist.distributed_c10d._world.pg_coalesce_state.pop(group, None)
        raise


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
        # a delegated collective in between
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
        with _cm(ag.g, async_ops=True) as cm:
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
    add("coalesced_cm_mixed_inplace", lambda: ag.coalesced_cm("cmi", mixed[:3] + mixed[4:], inplace=True, async_op=True))
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
    """The all-gathers of g are counted on the 'dma' path with their output bytes; group_path says 'dma'."""
    import torch_sdma

    ag = AG(g, ref, dev, tag)
    W = ag.W

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
        assert "dma" in s, f"no 'dma' key after 2 all_gather_into_tensor: {s}"
        assert s["dma"]["calls"] == 2, s
        assert s["dma"]["bytes"] == W * (4000 + 33), (s, W * 4033)
        ag.as_list("st3", (10,), torch.float64)
        s2 = torch_sdma.stats(g)
        assert s2["dma"]["calls"] == 3 and s2["dma"]["bytes"] == W * (4000 + 33 + 80), s2
        ag.coalesced_cm("st4", [((10,), torch.float32), ((3,), torch.int64)])
        s3 = torch_sdma.stats(g)
        assert s3["dma"]["calls"] >= 4, f"coalesced all-gather not counted on dma: {s3}"
        c_before = s3["dma"]["calls"]
        ag.coalesced_legacy("st5", [(4,), (2,)], torch.float32)
        s4 = torch_sdma.stats(g)
        assert s4["dma"]["calls"] > c_before, f"all_gather_coalesced not counted on dma: {s4}"
        assert not any(k.startswith("inner:") for k in s4), f"some all-gathers went to the inner backend: {s4}"

    return [(f"{tag}/stats_dma", check)]


def bad_input_cases(g, dev, tag, ref=None, compare_messages=False):
    """Bad input raises NCCL's error before anything is enqueued; the next valid all-gather still works.

    With compare_messages and ref (an nccl group), the same bad call on ref must raise the same type and
    the same first line of message."""
    ag_ok = AG(g, g, dev, tag)  # valid follow-up checked against the locally rebuilt inputs
    W = dist.get_world_size(g)
    cases = []

    def follow_up(k):
        x = ag_ok.x(f"fu{k}", (257,), torch.float32)
        e = ag_ok.local_expected(f"fu{k}", (257,), torch.float32)
        o = poison_(torch.empty(W * 257, device=dev), e)
        dist.all_gather_into_tensor(o, x, group=g)
        assert_bytes_equal(o, e, "valid all-gather after the bad one")
        ol = [poison_(torch.empty(257, device=dev)) for _ in range(W)]
        dist.all_gather(ol, x, group=g)
        assert_bytes_equal(torch.cat([raw(t) for t in ol]), e, "valid list all-gather after the bad one")

    def expect(k, call, exc_type, msg, compare=None):
        # the reference (NCCL) is asked too only where it checks: it does not check list lengths (a short list
        # would make it write out of bounds) nor the sizes inside a coalesced all-gather
        compare = compare_messages and (msg is not None if compare is None else compare)

        def raised(grp, async_op):
            """The exception the call (and its wait) raised on grp, or None."""
            try:
                w = call(grp, async_op)
                if w is not None:
                    w.wait()
            except Exception as e:  # noqa: BLE001
                return e
            return None

        def fn():
            for async_op in (False, True):
                got = raised(g, async_op)
                if got is None:
                    raise AssertionError(f"no error raised (async_op={async_op})")
                if exc_type is not None and not isinstance(got, exc_type):
                    raise AssertionError(f"raised {type(got).__name__}: {got}; expected {exc_type.__name__}")
                if msg is not None and msg not in str(got):
                    raise AssertionError(f"message {str(got)!r} lacks {msg!r}")
                if compare and ref is not None:
                    rexc = raised(ref, async_op)
                    assert rexc is not None, "the reference accepted this input"
                    assert type(rexc) is type(got), (type(rexc), type(got))
                    l1r = str(rexc).splitlines()[0] if str(rexc) else ""
                    l1g = str(got).splitlines()[0] if str(got) else ""
                    assert l1r == l1g, f"message differs from the reference's:\n  ref:  {l1r!r}\n  sdma: {l1g!r}"
            follow_up(k)

        cases.append((f"{tag}/bad_input/{k}", fn))

    n = 10
    expect("output_too_big",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n + 1, device=dev), torch.ones(n, device=dev),
                                                      group=grp, async_op=a), ValueError, MSG_SIZE)
    expect("output_too_small",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n - 1, device=dev), torch.ones(n, device=dev),
                                                      group=grp, async_op=a), ValueError, MSG_SIZE)
    expect("dtype_mismatch",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, dtype=torch.float64, device=dev),
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           TypeError, MSG_TYPE)
    expect("dtype_mismatch_same_size",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, dtype=torch.int32, device=dev),
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           TypeError, MSG_TYPE)
    expect("noncontiguous_input",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, device=dev),
                                                      torch.ones(2 * n, device=dev)[::2], group=grp, async_op=a),
           ValueError, MSG_CONTIG)
    expect("noncontiguous_output",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(2 * W * n, device=dev)[::2],
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           ValueError, MSG_CONTIG)
    expect("list_wrong_length",
           lambda grp, a: dist.all_gather([torch.empty(n, device=dev) for _ in range(W + 1)],
                                          torch.ones(n, device=dev), group=grp, async_op=a), None, None)
    if W > 1:
        expect("list_too_short",
               lambda grp, a: dist.all_gather([torch.empty(n, device=dev) for _ in range(W - 1)],
                                              torch.ones(n, device=dev), group=grp, async_op=a), None, None)
    expect("coalesced_cm_size_mismatch",
           lambda grp, a: _cm_bad(grp, dev, W, n, a), ValueError, MSG_SIZE, compare=False)
    if dev.type == "cuda":
        expect("device_mismatch",
               lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n), torch.ones(n, device=dev),
                                                          group=grp, async_op=a), None, None, compare=True)
    return cases


def _cm_bad(grp, dev, W, n, async_op):
    outs = [torch.empty(W * n, device=dev), torch.empty(W * n + 3, device=dev)]
    ins = [torch.ones(n, device=dev), torch.ones(n, device=dev)]
    with _cm(grp, async_ops=async_op) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=grp)
    if async_op:
        cm.wait()
    return None


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
        # also a delegated collective on each group in between
        for ag in (a1, a2):
            if ag is not None:
                t = torch.ones(3, device=dev)
                dist.all_reduce(t, group=ag.g)
                assert torch.equal(t, torch.full((3,), float(ag.W), device=dev))
        for w in works:
            w.wait()
        for ag, k, x, e, o in items:
            assert_bytes_equal(o, e, f"interleaved group {ag.tag} #{k}")

    return (f"{tag}/two_groups_interleaved", fn)
