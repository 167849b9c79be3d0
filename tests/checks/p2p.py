"""Point-to-point cases (send, recv, isend/irecv, batch_isend_irecv) shared by the CPU tests and their GPU twin.
Every received tensor is poisoned first and compared bit-exact with the bytes its sender drew, which every rank
rebuilds locally from (case name, sender). Ranks 0 and 1 carry the two-rank cases; a third rank makes no call for
them, as NCCL lets it."""
import time

import torch
import torch.distributed as dist

from checks.data import EVERY_DTYPE, assert_bytes_equal, poison_, rand

SIZES = (1, 4099)  # elements: one, and an odd count that spans pages for every dtype


def _recv_buffer(name, src, shape, dtype, dev):
    want = rand(name, src, shape, dtype, device=dev)
    got = torch.empty_like(want)
    poison_(got, want.reshape(-1).view(torch.uint8))
    return got, want


def dtype_cases(g, dev, rank, dtypes=EVERY_DTYPE):
    """Every dtype at two sizes: 0 -> 1 then 1 -> 0 with blocking send/recv, and the same async (isend/irecv issued
    in matching order on both ranks, waited on at the end)."""
    cases = []
    for dt in dtypes:
        for n in SIZES:
            name = f"p2p:{dt}:{n}"

            def sync(name=name, dt=dt, n=n):
                if rank == 0:
                    dist.send(rand(name + ":0", 0, n, dt, device=dev), 1, group=g)
                    got, want = _recv_buffer(name + ":1", 1, n, dt, dev)
                    dist.recv(got, 1, group=g)
                    assert_bytes_equal(got, want, f"recv {dt} x{n} from 1")
                elif rank == 1:
                    got, want = _recv_buffer(name + ":0", 0, n, dt, dev)
                    dist.recv(got, 0, group=g)
                    assert_bytes_equal(got, want, f"recv {dt} x{n} from 0")
                    dist.send(rand(name + ":1", 1, n, dt, device=dev), 0, group=g)

            def asynchronous(name=name + ":async", dt=dt, n=n):
                if rank not in (0, 1):
                    return
                peer = 1 - rank
                got, want = _recv_buffer(f"{name}:{peer}", peer, n, dt, dev)
                mine = rand(f"{name}:{rank}", rank, n, dt, device=dev)
                if rank == 0:
                    works = [dist.isend(mine, peer, group=g), dist.irecv(got, peer, group=g)]
                else:
                    works = [dist.irecv(got, peer, group=g), dist.isend(mine, peer, group=g)]
                for w in works:
                    w.wait()
                assert_bytes_equal(got, want, f"irecv {dt} x{n} from {peer}")

            cases += [(f"{name}:sync", sync), (f"{name}:async", asynchronous)]
    return cases


def ring_cases(g, dev, rank, world, rounds=6):
    """Each rank sends to the next and receives from the previous in one batch_isend_irecv, several rounds, the size
    varying per round (zero included); with 2 ranks the batch holds both directions with one peer."""

    def ring():
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for k in range(rounds):
            n = (0, 7, 4099, 1 << 16, 33, 1 << 18)[k % 6]
            dt = (torch.float32, torch.uint8, torch.bfloat16, torch.int64, torch.float16, torch.int32)[k % 6]
            got, want = _recv_buffer(f"ring:{k}", prv, n, dt, dev)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, rand(f"ring:{k}", rank, n, dt, device=dev), nxt, g),
                                            dist.P2POp(dist.irecv, got, prv, g)])
            for w in works:
                w.wait()
            assert_bytes_equal(got, want, f"ring round {k}: {n} x {dt} from {prv}")

    return [("ring", ring)]


def pipeline_cases(g, dev, rank, micro=5):
    """A two-stage pipeline on ranks 0 and 1: activations forward with isend/irecv batches of one, gradients back;
    stage 1 computes on what it received."""

    def pipeline():
        if rank not in (0, 1):
            return
        shape = (64, 257)
        for m in range(micro):
            if rank == 0:
                act = rand(f"pipe:act:{m}", 0, shape, torch.float32, device=dev, kind="normal")
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, act, 1, g)]):
                    w.wait()
                grad = torch.empty(shape, device=dev)
                poison_(grad)
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad, 1, g)]):
                    w.wait()
                assert_bytes_equal(grad, act * 2 + 1, f"microbatch {m}: gradient")
            else:
                act = torch.empty(shape, device=dev)
                poison_(act)
                for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, act, 0, g)]):
                    w.wait()
                assert_bytes_equal(act, rand(f"pipe:act:{m}", 0, shape, torch.float32, device=dev, kind="normal"),
                                   f"microbatch {m}: activation")
                for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, act * 2 + 1, 0, g)]):
                    w.wait()

    return [("pipeline", pipeline)]


def batch_cases(g, dev, rank):
    """Ranks 0 and 1: one batch with both directions and several tensors each way (the k-th send meets the k-th
    recv), posted in different orders on the two ranks; zero-size send and recv alone and in a batch."""

    def both_directions():
        if rank not in (0, 1):
            return
        peer = 1 - rank
        sizes = (5, 0, 4099)
        outs, wants, ops = [], [], []
        for k, n in enumerate(sizes):
            got, want = _recv_buffer(f"both:{k}", peer, n, torch.int32, dev)
            outs.append(got)
            wants.append(want)
            ops.append(dist.P2POp(dist.irecv, got, peer, g))
            ops.append(dist.P2POp(dist.isend, rand(f"both:{k}", rank, n, torch.int32, device=dev), peer, g))
        if rank == 1:  # every send first, then every recv: each direction keeps its order
            ops = [op for op in ops if op.op is dist.isend] + [op for op in ops if op.op is dist.irecv]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for k, (got, want) in enumerate(zip(outs, wants)):
            assert_bytes_equal(got, want, f"batch both directions, tensor {k}")

    def zero_size():
        if rank not in (0, 1):
            return
        empty = torch.empty(0, device=dev)
        if rank == 0:
            dist.send(empty, 1, group=g)
            dist.recv(empty, 1, group=g)
        else:
            dist.recv(empty, 0, group=g)
            dist.send(empty, 0, group=g)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, empty, 1 - rank, g),
                                         dist.P2POp(dist.irecv, torch.empty(0, device=dev), 1 - rank, g)]):
            w.wait()

    return [("both_directions", both_directions), ("zero_size", zero_size)]


def interleaved_cases(g, dev, rank, world, rounds=4):
    """p2p between collectives on the same group, async and in flight together: all_gather_into_tensor,
    all_to_all_single, a ring batch; everything waited on at the end and compared bit-exact. With 3 ranks or more, a
    batch whose peers match it with lone calls that interleave with a lone call between them."""

    def interleaved():
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        checks = []
        works = []
        for k in range(rounds):
            n = 1000 + 37 * k
            mine = rand(f"mix:ag:{k}", rank, n, torch.float32, device=dev)
            out = torch.empty(world * n, device=dev)
            poison_(out)
            works.append(dist.all_gather_into_tensor(out, mine, group=g, async_op=True))
            checks.append((out, torch.cat([rand(f"mix:ag:{k}", q, n, torch.float32, device=dev)
                                           for q in range(world)]), f"all-gather {k}"))
            got, want = _recv_buffer(f"mix:p2p:{k}", prv, n + 3, torch.uint8, dev)
            works += dist.batch_isend_irecv([
                dist.P2POp(dist.isend, rand(f"mix:p2p:{k}", rank, n + 3, torch.uint8, device=dev), nxt, g),
                dist.P2POp(dist.irecv, got, prv, g)])
            checks.append((got, want, f"ring {k}"))
            a2a_in = rand(f"mix:a2a:{k}", rank, world * 16, torch.int32, device=dev)
            a2a_out = torch.empty_like(a2a_in)
            poison_(a2a_out)
            works.append(dist.all_to_all_single(a2a_out, a2a_in, group=g, async_op=True))
            checks.append((a2a_out, torch.cat([rand(f"mix:a2a:{k}", q, world * 16, torch.int32, device=dev)
                                               [rank * 16:(rank + 1) * 16] for q in range(world)]), f"all_to_all {k}"))
        for w in works:
            w.wait()
        for got, want, what in checks:
            assert_bytes_equal(got, want, what)

    def batch_among_lone_calls():
        """Rank 2's batch sends to ranks 0 and 1, which receive as lone calls that interleave with a lone call between
        them: rank 1 receives from 2, then from 0; rank 0 sends to 1, then receives from 2. Rank 0 reaches its recv
        from 2 only once its send to 1 ended, which needs rank 1's recv from 2 to end, which needs rank 2's step with
        rank 1 to go on while its step with rank 0 waits: each peer's steps on a lane of their own (NCCL serves it)."""
        n = 4099
        if rank == 2:
            for w in dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, rand("amid:2>0", 2, n, torch.float32, device=dev), 0, g),
                    dist.P2POp(dist.isend, rand("amid:2>1", 2, n + 5, torch.float32, device=dev), 1, g)]):
                w.wait()
        elif rank == 1:
            from2, want2 = _recv_buffer("amid:2>1", 2, n + 5, torch.float32, dev)
            from0, want0 = _recv_buffer("amid:0>1", 0, n + 7, torch.int32, dev)
            dist.recv(from2, 2, group=g)
            dist.recv(from0, 0, group=g)
            assert_bytes_equal(from2, want2, "recv from 2")
            assert_bytes_equal(from0, want0, "recv from 0")
        elif rank == 0:
            dist.send(rand("amid:0>1", 0, n + 7, torch.int32, device=dev), 1, group=g)
            from2, want2 = _recv_buffer("amid:2>0", 2, n, torch.float32, dev)
            dist.recv(from2, 2, group=g)
            assert_bytes_equal(from2, want2, "recv from 2")

    return [("interleaved", interleaved)] + ([("batch among lone calls", batch_among_lone_calls)] if world >= 3 else [])


def path_cases(g, dev, rank, device_name, expected="dma:direct"):
    """After the cases above: stats() counts send and recv on the path `expected`, and group_path(op=) says so."""
    import torch_sdma

    def paths():
        if rank not in (0, 1):
            return
        stats = torch_sdma.stats(g)
        for op in ("send", "recv"):
            key = f"{op}:{expected}" if expected.startswith("dma") else f"delegated:{op}"
            other = f"delegated:{op}" if expected.startswith("dma") else f"{op}:dma:direct"
            assert int(stats.get(key, {}).get("calls", 0)) > 0, (op, sorted(stats))
            assert other not in stats, (op, sorted(stats))
            path = torch_sdma.group_path(g, device=device_name, op=op)
            assert path == expected, (op, path)

    return [("paths", paths)]


def profiler_cases(g, dev, rank, expected="dma:direct"):
    """A send and its recv, then a batch_isend_irecv of both directions, under torch.profiler: "sdma:send 0->1" on
    the sender's trace, "sdma:recv 1<-0" on the receiver's; on the copy engines, no CUDA kernel on either rank."""
    from torch.profiler import ProfilerActivity, profile

    from checks.trace import exported_events

    def events():
        if rank not in (0, 1):
            return
        peer = 1 - rank
        t = rand("prof", 0, 4099, torch.float32, device=dev)
        out, back = poison_(torch.empty_like(t)), rand("profb", rank, 4099, torch.float32, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            if rank == 0:
                dist.send(t, 1, group=g)
            else:
                dist.recv(t, 0, group=g)
            ops = [dist.P2POp(dist.isend, back, dist.get_global_rank(g, peer), g),
                   dist.P2POp(dist.irecv, out, dist.get_global_rank(g, peer), g)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        assert_bytes_equal(out, rand("profb", peer, 4099, torch.float32, device=dev), "profiled batch")
        events = exported_events(prof)
        names = {e.get("name") for e in events}
        want = "sdma:send 0->1" if rank == 0 else "sdma:recv 1<-0"  # as NCCL names them, "nccl:send 0->1"
        assert want in names, f"no profiler event {want}; sdma events: {sorted(n for n in names if 'sdma' in str(n))}"
        if dev.type == "cuda" and expected.startswith("dma"):
            kernels = sorted({str(e.get("name"))[:80] for e in events if str(e.get("cat", "")).lower() == "kernel"})
            assert not kernels, f"point-to-point on the copy engines ran CUDA kernels: {kernels}"

    return [("profiler", events)]


def all_cases(g, dev, rank, world, device_name, dtypes=EVERY_DTYPE, expected="dma:direct"):
    return (dtype_cases(g, dev, rank, dtypes) + ring_cases(g, dev, rank, world) + pipeline_cases(g, dev, rank)
            + batch_cases(g, dev, rank) + interleaved_cases(g, dev, rank, world)
            + profiler_cases(g, dev, rank, expected) + path_cases(g, dev, rank, device_name, expected))


def mistake_cases(ctx, dev, timeout_s):
    """Each mistake on a group of its own (made up front, by every rank), ranks 0 and 1: (name, seconds it took,
    the error's words or None) per rank."""
    import datetime

    rank = ctx.rank
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {name: dist.new_group(list(range(ctx.world)), timeout=timeout)
              for name in ("sizes", "both_send", "no_send_first", "no_send_later")}
    results = []

    def attempt(name, fn):
        t0 = time.monotonic()
        try:
            fn(groups[name])
            results.append((name, time.monotonic() - t0, None))
        except Exception as e:  # noqa: BLE001
            results.append((name, time.monotonic() - t0, f"{type(e).__name__}: {e}"))

    def settle(work):
        """Waits for `work` by polling (on a GPU wait() only orders the stream, and a stream whose peer never comes
        stays held), then raises its error, if any."""
        deadline = time.monotonic() + timeout_s + 30
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.05)
        work.wait()

    def sizes(g):
        if rank == 0:
            settle(dist.isend(torch.zeros(100, dtype=torch.uint8, device=dev), 1, group=g))
        elif rank == 1:
            settle(dist.irecv(torch.zeros(200, dtype=torch.uint8, device=dev), 0, group=g))

    def both_send(g):
        if rank in (0, 1):
            settle(dist.isend(torch.zeros(64, dtype=torch.uint8, device=dev), 1 - rank, group=g))

    def no_send_first(g):
        if rank == 1:
            settle(dist.irecv(torch.zeros(64, dtype=torch.uint8, device=dev), 0, group=g))

    def no_send_later(g):
        t = torch.zeros(64, dtype=torch.uint8, device=dev)
        if rank == 0:
            settle(dist.isend(t, 1, group=g))
        elif rank == 1:
            settle(dist.irecv(t, 0, group=g))
            settle(dist.irecv(t, 0, group=g))  # rank 0 never sends it

    for name, fn in (("sizes", sizes), ("both_send", both_send), ("no_send_first", no_send_first),
                     ("no_send_later", no_send_later)):
        if rank in (0, 1):
            attempt(name, fn)
    # The failed p2p failed its group: the group's next collective raises on every rank, the third one included.
    ctx.barrier_store("mistakes-made", timeout_s=4 * timeout_s + 60)
    t = torch.zeros(4, device=dev)
    attempt_all = time.monotonic()
    try:
        dist.all_gather_into_tensor(torch.zeros(4 * ctx.world, device=dev), t, group=groups["sizes"])
        results.append(("after", time.monotonic() - attempt_all, None))
    except Exception as e:  # noqa: BLE001
        results.append(("after", time.monotonic() - attempt_all, f"{type(e).__name__}: {e}"))
    ctx.barrier_store("mistakes-done", timeout_s=4 * timeout_s + 60)  # no rank exits while a peer waits for it
    return results


def mistake_problems(values, timeout_s, slack_s, cuda=False):
    """What the mistakes' outcomes lack: an error on each rank that took part, within the timeout, in words that name
    the peer (and, for sizes, both sizes). On CUDA tensors the pair compares sizes only (two sends of the same size
    that meet are not told from a send and a recv) and a late recv is named by the watchdog."""
    problems = []
    by_rank = {r: {name: (dt, err) for name, dt, err in v} for r, v in enumerate(values)}

    def expect(rank, name, *words):
        dt, err = by_rank[rank][name]
        if err is None:
            problems.append(f"rank {rank} {name}: no error")
            return
        if dt > timeout_s + slack_s:
            problems.append(f"rank {rank} {name}: the error took {dt:.1f} s: {err}")
        missing = [w for w in words if w not in err]
        if missing:
            problems.append(f"rank {rank} {name}: {missing} not in: {err}")

    for name, words in (("sizes", ("100 bytes", "200 bytes")), ("both_send", ("64 bytes",))):
        if cuda:  # the rank that read the other's post names the sizes; the other learns that its peer failed
            for r in (0, 1):
                expect(r, name, "DistBackendError", "group rank " + str(1 - r))
            errs = [by_rank[r][name][1] or "" for r in (0, 1)]
            if not any(all(w in e for w in words) for e in errs):
                problems.append(f"{name}: no rank names {words}: {errs}")
        else:
            for r in (0, 1):
                expect(r, name, "DistBackendError", *words, f"group ranks {r} and {1 - r}")
    expect(1, "no_send_first", "group rank 0")
    expect(1, "no_send_later", "DistBackendError", "group ranks [0]")
    for r in by_rank:
        expect(r, "after", "DistBackendError")
    return problems
