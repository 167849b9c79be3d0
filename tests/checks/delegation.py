"""delegation_cases: every collective other than all-gather, on an sdma group and on the reference group, byte for
byte. One function per family of collectives; each registers its cases on a _Cases."""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from checks.data import (
    TORCH_VERSION,
    assert_bytes_equal,
    call_both,
    coalescing_manager,
    expected_concat,
    group_ranks,
    nbytes,
    normalized,
    poison_,
    rand,
    raw,
    stats_calls,
)


class _Cases:
    """What every family needs: the two groups (same members), this rank, and the list the cases go into."""

    def __init__(self, g, ref, dev, tag, cpu_ops, sdma_stats, extra_ops):
        self.g, self.ref, self.dev, self.tag = g, ref, dev, tag
        self.cpu_ops, self.sdma_stats, self.extra_ops = cpu_ops, sdma_stats, extra_ops
        self.W = dist.get_world_size(g)
        self.me = dist.get_rank(g)
        self.ranks = group_ranks(g)
        assert self.ranks == group_ranks(ref), (self.ranks, group_ranks(ref))
        self.my_global = self.ranks[self.me]
        self.cases = []

    def case(self, name):
        def deco(fn):
            self.cases.append((f"{self.tag}/{name}", fn))
            return fn

        return deco

    def R(self, name, shape, dtype=torch.float32, kind="normal", rank=None):
        return rand(f"{self.tag}/{name}", self.my_global if rank is None else rank, shape, dtype, self.dev, kind)


def delegation_cases(g, ref, dev, tag, *, cpu_ops=True, sdma_stats=None, extra_ops=True):
    """(name, fn) checks that every collective on `g` gives the bytes the same collective gives on `ref`.

    g and ref must have the same members. dev: torch.device of the tensors. sdma_stats: callable(group) ->
    stats dict when `g` routes tensors of `dev` through sdma (then "delegated:<op>" counts are checked)."""
    c = _Cases(g, ref, dev, tag, cpu_ops, sdma_stats, extra_ops)
    for family in (_broadcast_and_reductions, _gathers_and_scatters, _reduce_scatter_and_all_to_all,
                   _point_to_point_and_barriers, _coalesced, _handles_and_stats):
        family(c)
    return c.cases


def _broadcast_and_reductions(c):
    """Broadcast, all_reduce (every op the reference supports), reduce."""
    g, ref, tag, ranks, my_global, case, R = c.g, c.ref, c.tag, c.ranks, c.my_global, c.case, c.R
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
                _, _, exc = call_both(
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
        _, _, exc = call_both(
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
                call_both(
                    lambda: dist.reduce(a, dst, op=op, group=ref),
                    lambda: dist.reduce(b, dst, op=op, group=g),
                    "reduce",
                )
                if my_global == dst:
                    assert_bytes_equal(b, a, f"reduce at dst {dst}")



def _gathers_and_scatters(c):
    """All_gather (list, into tensor, object), gather, scatter and their object forms."""
    g, ref, dev, tag, W, me, ranks, my_global = c.g, c.ref, c.dev, c.tag, c.W, c.me, c.ranks, c.my_global
    case, R = c.case, c.R
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
            _, _, exc = call_both(
                lambda: dist.gather(x, a, dst=root, group=ref),
                lambda: dist.gather(x, b, dst=root, group=g),
                "gather",
            )
            if exc is None and my_global == root:
                assert_bytes_equal(torch.cat([raw(t) for t in b]), torch.cat([raw(t) for t in a]), "gather")

        @case(f"scatter[src={root}]")
        def _(root=root):
            chunks = None
            if my_global == root:
                chunks = [R(f"sc{root}_{j}", (91,), torch.float32, "bytes") for j in range(W)]
            a = poison_(torch.empty(91, device=dev))
            b = poison_(torch.empty(91, device=dev))
            _, _, exc = call_both(
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
            _, _, exc = call_both(
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
            _, _, exc = call_both(
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



def _reduce_scatter_and_all_to_all(c):
    """Reduce_scatter (list and tensor) and all_to_all (list, even and uneven single)."""
    g, ref, dev, W, me, case, R = c.g, c.ref, c.dev, c.W, c.me, c.case, c.R
    # reduce_scatter ----------------------------------------------------------------------------------------
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):

        @case(f"reduce_scatter_list[{op}]")
        def _(op=op):
            ins = [R(f"rsl{op}{j}", (55,), torch.float32) for j in range(W)]
            a = poison_(torch.empty(55, device=dev))
            b = poison_(torch.empty(55, device=dev))
            _, _, exc = call_both(
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
            _, _, exc = call_both(
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
        # Lists of uneven sizes: gloo refuses them; NCCL and sdma move them, checked here against what each rank sent.
        moved = []
        _, _, exc = call_both(
            lambda: dist.all_to_all(a, ins, group=ref),
            lambda: moved.append(dist.all_to_all(b, ins, group=g)),
            "all_to_all",
            sdma_may_support_more=True,
        )
        if exc is None:
            assert_bytes_equal(torch.cat([raw(t) for t in b]), torch.cat([raw(t) for t in a]), "all_to_all")
        elif moved:
            for q in range(W):
                assert_bytes_equal(b[q], R(f"a2a{me}", (13 + me,), torch.float32, "bytes", rank=c.ranks[q]),
                                   f"all_to_all from {q}")

    @case("all_to_all_single_even")
    def _():
        x = R("a2as", (W * 21, 2), torch.float32, "bytes")
        a = poison_(torch.empty(W * 21, 2, device=dev))
        b = poison_(torch.empty(W * 21, 2, device=dev))
        _, _, exc = call_both(
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
        _, _, exc = call_both(
            lambda: dist.all_to_all_single(a, x, out_splits, in_splits, group=ref),
            lambda: dist.all_to_all_single(b, x, out_splits, in_splits, group=g),
            "all_to_all_single uneven",
        )
        if exc is None:
            assert_bytes_equal(b, a, "all_to_all_single uneven")



def _point_to_point_and_barriers(c):
    """Send/recv (blocking, async, batched) and barriers."""
    g, ref, dev, tag, W, me, ranks = c.g, c.ref, c.dev, c.tag, c.W, c.me, c.ranks
    case, R, cpu_ops = c.case, c.R, c.cpu_ops
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
                a, b, exc = call_both(
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
            call_both(
                lambda: dist.monitored_barrier(group=ref, timeout=None, wait_all_ranks=True),
                lambda: dist.monitored_barrier(group=g, timeout=None, wait_all_ranks=True),
                "monitored_barrier",
            )



def _coalesced(c):
    """All_reduce_coalesced and every collective inside a coalescing manager."""
    g, ref, dev, tag, W, ranks, case, R = c.g, c.ref, c.dev, c.tag, c.W, c.ranks, c.case, c.R
    # coalesced -----------------------------------------------------------------------------------------
    @case("all_reduce_coalesced")
    def _():
        xs = [R("arc0", (31,), torch.float32), R("arc1", (4, 5), torch.float32), R("arc2", (1,), torch.float32)]
        a = [t.clone() for t in xs]
        b = [t.clone() for t in xs]
        _, _, exc = call_both(
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
                with coalescing_manager(grp, async_ops=async_ops) as cm:
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
                with coalescing_manager(grp, async_ops=async_ops) as cm:
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
                    with coalescing_manager(grp, async_ops=async_ops) as cm:
                        for o, x in zip(outs, xs):
                            dist.reduce_scatter_tensor(o, x.clone(), group=grp)
                    if async_ops:
                        cm.wait()
                    return outs

                res.append(go)
            a, b, exc = call_both(res[0], res[1], "coalesced reduce_scatter_tensor")
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
            with coalescing_manager(grp, device=dev, async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, group=grp)
            cm.wait()
            return ts

        a, b, exc = call_both(lambda: go(ref), lambda: go(g), "coalescing device form", sdma_may_support_more=True)
        if exc is None:
            for k in range(2):
                assert_bytes_equal(b[k], a[k], f"device-form coalesced all_reduce[{k}]")
        elif b is not None:  # sdma supports it, the reference doesn't: compare with plain all_reduce on ref
            for k in range(2):
                t = xs[k].clone()
                dist.all_reduce(t, group=ref)
                assert_bytes_equal(b[k], t, f"device-form coalesced all_reduce[{k}]")



def _handles_and_stats(c):
    """Async Work handles, futures, and the delegated:<op> stats."""
    g, ref, dev, ranks, case, R, sdma_stats = c.g, c.ref, c.dev, c.ranks, c.case, c.R, c.sdma_stats
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
            exchanges = ("all_to_all_single:", "all_to_all:", "broadcast:", "gather:", "scatter:")
            assert all(k.startswith(("dma", "inner:", "delegated:", "self:") + exchanges) for k in keys), keys
            c, b = stats_calls(s, lambda k: k.startswith("delegated:") and "allreduce" in normalized(k))
            assert c == 2, f"expected 2 delegated all_reduce calls, stats: {s}"
            assert b == 2 * nbytes(x), f"expected {2 * nbytes(x)} bytes for the all_reduce calls, stats: {s}"
            # An exchange: counted under its op and path, the DMA path's or the inner backend's.
            c, _ = stats_calls(s, lambda k: k.startswith("broadcast:"))
            assert c == 1, f"expected 1 broadcast call, stats: {s}"
            c, _ = stats_calls(s, lambda k: k.startswith("delegated:") and "barrier" in normalized(k))
            assert c >= 1, f"expected a delegated barrier call, stats: {s}"


