"""Behave like NCCL wherever torch looks, on CPU tensors ("sdma" groups, 2 ranks; the GPU half is in
test_conformance_cuda.py).
- Point-to-point with oneself: isend/irecv to one's own rank, alone (in either order, the send waited on first
  too), inside batch_isend_irecv (also beside a ring to the other rank), bit-exact; a recv from oneself waited on
  before any send is an error, not a hang. (torch itself refuses blocking send/recv to oneself, for NCCL too.)
- The profiler: every collective through the backend, DMA or delegated, appears as "sdma:<collective>" (NCCL's
  names after its prefix) and with a record_param_comms event carrying the collective's name, element counts,
  dtype and group, as NCCL's do.
- The backend's own name where torch asks the backend for it."""

import torch
import torch.distributed as dist

from checks.data import SHARE_GPU, assert_bytes_equal, poison_, rand
from checks.trace import exported_events
from mp_harness import run_group

CPU = torch.device("cpu")


def self_p2p_cases(ctx, dev, tag):
    rank, W = ctx.rank, ctx.world
    g = dist.group.WORLD
    cases = []

    def x(name, n=1001, dtype=torch.float32):
        return rand(f"{tag}/{name}", rank, (n,), dtype, dev)

    def pair(name, dtype, recv_first):
        def fn():
            s = x(name, dtype=dtype)
            r = poison_(torch.empty_like(s))
            post = [lambda: dist.isend(s, rank, group=g), lambda: dist.irecv(r, rank, group=g)]
            for w in [p() for p in (post[::-1] if recv_first else post)]:
                w.wait()
            assert_bytes_equal(r, s, f"isend/irecv to self, {'recv' if recv_first else 'send'} posted first")

        return fn

    def isend_waited_then_irecv():
        s = x("c", dtype=torch.int64)
        r = poison_(torch.empty_like(s))
        dist.isend(s, rank, group=g).wait()  # done before any recv: the bytes were kept
        s.fill_(0)  # so the tensor may be reused at once
        dist.irecv(r, rank, group=g).wait()
        assert_bytes_equal(r, x("c", dtype=torch.int64), "isend waited on, then irecv from self")

    def blocking_forms():
        # torch refuses a blocking send to oneself in Python, for NCCL as for sdma: the same error here.
        try:
            dist.send(x("r"), rank, group=g)
        except ValueError as e:
            assert "should not be the same as the rank of the current process" in str(e), e
        else:
            raise AssertionError("torch let a blocking send to oneself through")
        # It lets a blocking recv from oneself through, which nothing can ever match: an error, where NCCL hangs.
        try:
            dist.recv(torch.empty(3, device=dev), rank, group=g)
        except RuntimeError as e:
            assert "itself" in str(e) and "post" in str(e), e
        else:
            raise AssertionError("a blocking recv from oneself returned")

    def batch_self_only():
        s = x("d", 4097, torch.uint8)
        r = poison_(torch.empty_like(s))
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, r, rank, g), dist.P2POp(dist.isend, s, rank, g)])
        for w in works:
            w.wait()
        assert_bytes_equal(r, s, "batch_isend_irecv to self")

    def batch_self_and_ring():
        nxt, prv = (rank + 1) % W, (rank - 1) % W
        s_self, s_ring = x("e"), x("f")
        r_self, r_ring = poison_(torch.empty_like(s_self)), poison_(torch.empty_like(s_ring))
        ops = [dist.P2POp(dist.isend, s_self, rank, g), dist.P2POp(dist.irecv, r_ring, prv, g),
               dist.P2POp(dist.isend, s_ring, nxt, g), dist.P2POp(dist.irecv, r_self, rank, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert_bytes_equal(r_self, s_self, "self part of a batch")
        assert_bytes_equal(r_ring, rand(f"{tag}/f", prv, (1001,), torch.float32, "cpu"), "ring part of a batch")

    def many_tags_in_order():
        sends = [x(f"t{k}", 64 + k) for k in range(4)]
        recvs = [poison_(torch.empty_like(s)) for s in sends]
        works = [dist.isend(s, rank, group=g, tag=k % 2) for k, s in enumerate(sends)]
        works += [dist.irecv(r, rank, group=g, tag=k % 2) for k, r in enumerate(recvs)]
        for w in works:
            w.wait()
        for k in range(4):
            assert_bytes_equal(recvs[k], sends[k], f"self message {k} (matched in order per tag)")

    def recv_before_any_send_is_an_error():
        r = torch.empty(10, device=dev)
        pending = dist.irecv(r, rank, group=g)
        try:
            pending.wait()
        except Exception as e:  # noqa: BLE001
            assert "itself" in str(e) and "post" in str(e), e
        else:
            raise AssertionError("waiting on a recv from oneself with no send posted returned")
        # The failed recv is gone: the next pair matches each other.
        s = x("late", 10)
        r2 = poison_(torch.empty_like(s))
        works = [dist.isend(s, rank, group=g), dist.irecv(r2, rank, group=g)]
        for w in works:
            w.wait()
        assert_bytes_equal(r2, s, "a pair after a failed recv from oneself")

    def failed_batch_leaves_nothing():
        # A batch that fails after a self send was posted (here on a non-contiguous tensor, refused before anything
        # is enqueued) must not leave that send for the next batch's recv, as NCCL drops a failed group's operations.
        stale = x("stale", 33)
        strided = x("strided", 66)[::2]
        try:
            dist.batch_isend_irecv([dist.P2POp(dist.isend, stale, rank, g), dist.P2POp(dist.isend, strided, rank, g)])
        except ValueError as e:
            assert "contiguous" in str(e), e
        else:
            raise AssertionError("a batch with a non-contiguous tensor went through")
        s = x("fresh", 33)
        r = poison_(torch.empty_like(s))
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, r, rank, g), dist.P2POp(dist.isend, s, rank, g)]):
            w.wait()
        assert_bytes_equal(r, s, "a batch after a failed batch")

    named = [("isend_then_irecv", pair("a", torch.float32, False)),
             ("irecv_then_isend", pair("b", torch.bfloat16, True)),
             ("isend_waited_then_irecv", isend_waited_then_irecv),
             ("blocking_forms", blocking_forms),
             ("batch_self_only", batch_self_only),
             ("batch_self_and_ring", batch_self_and_ring), ("many_tags_in_order", many_tags_in_order),
             ("recv_before_any_send_is_an_error", recv_before_any_send_is_an_error)]
    # After a failed batch the inner NCCL stays inside its group (ncclGroupStart without an end), as torch's NCCL
    # backend does, so the failed-batch case runs on CPU tensors only.
    if dev.type == "cpu":
        named.append(("failed_batch_leaves_nothing", failed_batch_leaves_nothing))
    # The ring part of a batch goes to the inner NCCL, which refuses two ranks on one GPU (SDMA_TEST_SHARE_GPU=1).
    if dev.type == "cuda" and SHARE_GPU:
        named = [(n, f) for n, f in named if n != "batch_self_and_ring"]
    for name, fn in named:
        cases.append((f"{tag}/self_p2p/{name}", fn))
    return cases


def profiled_events(fn):
    """Runs fn under torch.profiler and returns the exported trace's events."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
    return exported_events(prof)


def profiler_cases(ctx, dev, tag):
    rank, W = ctx.rank, ctx.world
    g = dist.group.WORLD
    out = {}
    # The delegated collectives go to the inner NCCL on CUDA tensors, which refuses two ranks on one GPU
    # (SDMA_TEST_SHARE_GPU=1): there only the DMA all-gathers' events are checked.
    delegated = not (SHARE_GPU and dev.type == "cuda")

    def collectives():
        n = 1024
        x = rand(f"{tag}/prof", rank, (n,), torch.float32, dev)
        if delegated:
            dist.all_reduce(x.clone(), group=g)
            dist.broadcast(x.clone(), 0, group=g)
        o = torch.empty(W * n, device=dev)
        dist.all_gather_into_tensor(o, x, group=g)
        dist.all_gather([torch.empty(n, device=dev) for _ in range(W)], x, group=g)
        if delegated:
            dist.reduce_scatter_tensor(torch.empty(n // W, device=dev), x.clone(), group=g)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def events_and_params():
        events = profiled_events(collectives)
        names = {e.get("name") for e in events}
        want = ["sdma:all_reduce", "sdma:broadcast", "sdma:_allgather_base", "sdma:all_gather",
                "sdma:_reduce_scatter_base"]
        if not delegated:
            want = ["sdma:_allgather_base", "sdma:all_gather"]
        missing = [w for w in want if w not in names]
        assert not missing, f"no profiler events named {missing}; sdma events seen: " \
                            f"{sorted(n for n in names if n and n.startswith('sdma'))}"
        params = [e.get("args", {}) for e in events if e.get("name") == "record_param_comms"]
        by_coll = {}
        for a in params:
            by_coll.setdefault(a.get("Collective name"), a)
        counts = [("_allgather_base", 1024, 1024 * W)] + ([("allreduce", 1024, 1024)] if delegated else [])
        for coll, nel_in, nel_out in counts:
            a = by_coll.get(coll)
            assert a is not None, f"no record_param_comms for {coll}: {sorted(map(str, by_coll))}"
            assert a.get("In msg nelems") == nel_in and a.get("Out msg nelems") == nel_out, (coll, a)
            assert a.get("dtype") in ("Float", "float32", "torch.float32"), (coll, a)
            assert a.get("Group size") == W, (coll, a)
            assert str(a.get("Process Group Name")) == str(g.group_name), (coll, a, g.group_name)
        out["record_param_comms"] = {k: v for k, v in by_coll.items() if k in ("allreduce", "_allgather_base")}
        if dev.type == "cuda":  # the DMA all-gathers' copies, seen on the GPU side of the trace
            memcpys = [e for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"]
            assert memcpys, "the profiler saw no GPU copies for the DMA all-gathers"

    def backend_name():
        backend = g._get_backend(dev)
        assert backend.name() == "sdma", backend.name()
        out["ddp_backend_name_torch_reports"] = dist.distributed_c10d._get_default_group().name()

    return [(f"{tag}/profiler_events", events_and_params), (f"{tag}/backend_name", backend_name)], out


def conformance_body(ctx):
    dev = ctx.device
    cases = self_p2p_cases(ctx, dev, "cpu" if dev.type == "cpu" else "cuda")
    prof, out = profiler_cases(ctx, dev, dev.type)
    failed = ctx.run_cases(cases + prof)
    return {"failed": failed, "info": out}


def test_self_p2p_and_profiler_events_cpu():
    res = run_group(conformance_body, 2, "sdma", timeout=180, pg_timeout_s=30)
    print(res.ranks[0].value["info"] if res.ranks[0].value else None)
    res.check()
