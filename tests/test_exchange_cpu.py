"""The exchange collectives on CPU tensors ("sdma" groups, shared memory and process_vm_readv/writev), 2 and 3 ranks:
all_to_all_single (even, uneven with zero splits), all_to_all lists, broadcast, gather and scatter with every root,
sync, async waited later and many in flight among all-gathers, every dtype, bit-exact against inputs every rank
rebuilds locally, outputs poisoned first; a subgroup of non-contiguous ranks (roots are global ranks); stats and
group_path(op=...) on "dma:direct"; TORCH_SDMA_DELEGATE and TORCH_SDMA_MIN_BYTES routing; mistakes across ranks
(splits, roots, sizes that disagree) raising DistBackendError naming the op on every rank within the group's
timeout."""
import pytest
import torch
import torch.distributed as dist

from checks.exchange import (
    EX,
    bad_input_cases,
    check,
    cross_process_reads,
    exchange_cases,
    mistake_problems,
    mistakes_summary,
    run_mistakes,
    split_matrix,
    stats_cases,
)
from mp_harness import run_group

CPU = torch.device("cpu")
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
MISTAKE_TIMEOUT_S = 10.0
SLACK_S = 20.0  # scheduling on a loaded 2-core CI machine


def exchange_body(ctx):
    torch.set_num_threads(1)  # as torchrun does: the ranks share two cores with the groups' workers
    world = dist.group.WORLD
    failed = ctx.run_cases(exchange_cases(world, CPU, "world") + bad_input_cases(world, CPU, "world")
                           + stats_cases(CPU, "world", "cpu", dma_expected=cross_process_reads()), barrier_tag="world")
    if ctx.world == 3:  # ranks 0 and 2: group rank 1 is global rank 2, the roots torch takes
        sub = dist.new_group(ranks=[0, 2])
        if ctx.rank in (0, 2):
            failed += ctx.run_cases(exchange_cases(sub, CPU, "sub0_2", big=False, quick=True), barrier_size=2,
                                    barrier_tag="sub0_2")
        ctx.barrier_store("after-sub")
    return failed


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_matches_local_bytes(world):
    run_group(exchange_body, world, "sdma", env=ENV, timeout=240, pg_timeout_s=20).check()


# ------------------------------------------------------------------------------------------------ routing
def routing_body(ctx, delegated):
    """TORCH_SDMA_MIN_BYTES=64K and TORCH_SDMA_DELEGATE=<delegated>: each call bit-exact on whichever path, counted on
    the path the routing rules give it, and group_path(op=...) names that path."""
    import torch_sdma

    torch.set_num_threads(1)
    g = dist.group.WORLD
    ex = EX(g, CPU, "routing")
    W = ex.W
    small, large = 256, 128 << 10  # bytes per rank, well below and above 64K
    dma = "dma:direct" if cross_process_reads() else "inner:"

    def key(op, nbytes, any_size=False):
        family = "all_to_all" if op.startswith("all_to_all") else op
        if family in delegated:
            return f"{op}:inner:TORCH_SDMA_DELEGATE"
        if nbytes < (64 << 10) and not any_size:
            return f"{op}:inner:below TORCH_SDMA_MIN_BYTES"
        return f"{op}:{dma}"

    def even(name, n):
        return ex.all_to_all_single(name, torch.uint8, split_matrix("", W, f"even:{n // W}"), cols=None, splits="none")

    # Older torch's gloo has no list all_to_all: delegated there, the call gets gloo's own refusal, as with gloo.
    try:
        dist.all_to_all([torch.empty(1) for _ in range(W)], [torch.zeros(1) for _ in range(W)],
                        group=dist.new_group(backend="gloo"))
        gloo_lists = True
    except RuntimeError as e:
        assert "does not support alltoall" in str(e), e
        gloo_lists = False

    u8 = torch.uint8
    steps = [  # (call, the key it must be counted on); broadcast: the tensor's bytes, gather and scatter: per rank x
        # size, even all_to_all_single: the input's bytes; uneven all_to_all_single and all_to_all lists: any size
        (lambda: ex.broadcast("bs", u8, 1, (small,)), key("broadcast", small)),
        (lambda: ex.broadcast("bl", u8, 0, (large,)), key("broadcast", large)),
        (lambda: ex.scatter("ss", u8, 1, (small,)), key("scatter", small * W)),
        (lambda: ex.scatter("sl", u8, 0, (large,)), key("scatter", large * W)),
        (lambda: ex.gather("gs", u8, 1, (small,)), key("gather", small * W)),
        (lambda: ex.gather("gl", u8, 0, (large,)), key("gather", large * W)),
        (lambda: even("es", small), key("all_to_all_single", small)),
        (lambda: even("el", large), key("all_to_all_single", large)),
        (lambda: ex.all_to_all_single("us", torch.float32, split_matrix("us", W, "random_with_zeros", 4)),
         key("all_to_all_single", 0, any_size=True)),
        # even sizes: where the list form is delegated, gloo takes no lists of uneven sizes
        (lambda: ex.all_to_all("ls", torch.float32, split_matrix("", W, "even:2")), key("all_to_all", 0, True)),
    ]

    def case(call, key):
        def fn():
            torch_sdma.reset_stats(g)
            if key == "all_to_all:inner:TORCH_SDMA_DELEGATE" and not gloo_lists:
                try:
                    call()
                except RuntimeError as e:
                    assert "does not support alltoall" in str(e), e
                    return
                raise AssertionError("a delegated list all_to_all ran where gloo has none")
            check(call())
            s = torch_sdma.stats(g)
            op = key.split(":")[0]
            got = {k: v["calls"] for k, v in s.items() if k.startswith(op + ":")}
            on_key = [k for k in got if k.startswith(key)]
            assert on_key and sum(got.values()) == 1, f"expected one call on {key!r}: {s}"
            p = torch_sdma.group_path(g, device="cpu", op=op)
            assert f"{op}:{p}".startswith(key), f"group_path(op={op!r}) = {p!r}, expected {key!r}"

        return fn

    return ctx.run_cases([(f"routing/{k}#{i}", case(c, k)) for i, (c, k) in enumerate(steps)])


@pytest.mark.parametrize("delegate", ["broadcast,scatter", "all_to_all,gather"])
def test_exchange_routing_knobs(delegate):
    env = dict(ENV, TORCH_SDMA_MIN_BYTES="64K", TORCH_SDMA_DELEGATE=delegate)
    run_group(routing_body, 2, "sdma", env=env, kwargs={"delegated": tuple(delegate.split(","))}, timeout=120,
              pg_timeout_s=20).check()


# ------------------------------------------------------------------------------------------------ mistakes
def mistakes_body(ctx):
    torch.set_num_threads(1)
    return run_mistakes(ctx, CPU, MISTAKE_TIMEOUT_S, SLACK_S)


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_mistakes_raise_on_every_rank(world):
    """Each mistake on a group of its own, all at once, in fresh processes: DistBackendError naming the op on every
    rank within the groups' 10 s timeout; no rank dies by a signal; the world group still exchanges bit-exact."""
    res = run_group(mistakes_body, world, "sdma", env=ENV, timeout=MISTAKE_TIMEOUT_S + SLACK_S + 90,
                    pg_timeout_s=30, destroy=False, hard_exit=True, grace=MISTAKE_TIMEOUT_S + SLACK_S + 30)
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    print(mistakes_summary(values))
    problems = mistake_problems(values, MISTAKE_TIMEOUT_S, SLACK_S)
    assert not problems, "\n".join(problems) + "\n" + mistakes_summary(values)


# ------------------------------------------------------------------------------------------------ list pieces
def list_pieces_body(ctx):
    """The list forms' pieces are posted where they are on CPU ranks: pieces that are views of one buffer in reverse
    order of address, and pieces that alias an output (all_to_all with output p the input p, scatter into the root's
    own piece, gather from the root's own slot), all as if the inputs were read before any output was written."""
    torch.set_num_threads(1)
    W, r, n = ctx.world, ctx.rank, 4099

    def data(src, dst):  # what src sends dst
        g = torch.Generator().manual_seed(1000 * src + dst + 7)
        return torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)

    problems = []

    def expect(what, got, want):
        if not torch.equal(got, want):
            problems.append(f"rank {r}: {what}: first wrong element {(got != want).nonzero()[0].item()}")

    buf = torch.empty(W * n, dtype=torch.int32)
    ins = [buf[(W - 1 - p) * n:(W - p) * n] for p in range(W)]  # piece p below piece p - 1
    for p in range(W):
        ins[p].copy_(data(r, p))
    outs_buf = torch.full((W * n,), -1, dtype=torch.int32)
    outs = [outs_buf[(W - 1 - p) * n:(W - p) * n] for p in range(W)]
    dist.all_to_all(outs, ins)
    for p in range(W):
        expect(f"all_to_all views in reverse order, from rank {p}", outs[p], data(p, r))

    same = [data(r, p).clone() for p in range(W)]
    dist.all_to_all(same, same)  # output p is input p
    for p in range(W):
        expect(f"all_to_all with output {p} the input {p}", same[p], data(p, r))

    root = W - 1
    pieces = [data(root, p).clone() for p in range(W)] if r == root else None
    out = pieces[root] if r == root else torch.full((n,), -1, dtype=torch.int32)
    dist.scatter(out, pieces, src=root)
    expect("scatter into the root's own piece", out, data(root, r))

    root = 0
    mine = data(r, root).clone()
    slots = [torch.full((n,), -1, dtype=torch.int32) for _ in range(W)] if r == root else None
    if r == root:
        slots[root] = mine
    dist.gather(mine, slots, dst=root)
    if r == root:
        for p in range(W):
            expect(f"gather from the root's own slot, rank {p}", slots[p], data(p, root))
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_list_pieces_in_place_and_aliased(world):
    res = run_group(list_pieces_body, world, "sdma", env=ENV, timeout=120, pg_timeout_s=20)
    res.check()
    for rank, problems in enumerate(res.values()):
        assert not problems, f"rank {rank}: {problems}"


# ------------------------------------------------------------------------------------------------ in place
def in_place_body(ctx):
    """all_to_all_single with one tensor as input and output (even and uneven splits, sync and async) and with an
    output that overlaps the input in part: every rank gets the bytes its peers' inputs held before the call."""
    from checks.data import assert_bytes_equal, rand

    torch.set_num_threads(1)
    W, r, n = ctx.world, ctx.rank, 1031
    problems = []

    def expect(what, got, want):
        try:
            assert_bytes_equal(got, want, what)
        except AssertionError as e:
            problems.append(f"rank {r}: {e}")

    for async_op in (False, True):
        name = f"inplace:even:{async_op}"
        x = rand(name, r, W * n, torch.float32)
        w = dist.all_to_all_single(x, x, async_op=async_op)
        if async_op:
            w.wait()
        expect(f"even, async_op={async_op}", x,
               torch.cat([rand(name, q, W * n, torch.float32)[r * n:(r + 1) * n] for q in range(W)]))

    def sends(src, dst):  # elements src sends dst: symmetric, so each rank's input and output sizes agree
        return (src + dst + 1) * 7

    x = rand("inplace:uneven", r, sum(sends(r, p) for p in range(W)), torch.int32)
    splits = [sends(r, p) for p in range(W)]
    dist.all_to_all_single(x, x, output_split_sizes=splits, input_split_sizes=splits)
    want = []
    for q in range(W):
        start = sum(sends(q, p) for p in range(r))
        theirs = rand("inplace:uneven", q, sum(sends(q, p) for p in range(W)), torch.int32)
        want.append(theirs[start:start + sends(q, r)])
    expect("uneven", x, torch.cat(want))

    buf = torch.empty((W + 1) * n, dtype=torch.int32)
    buf[:W * n].copy_(rand("inplace:shifted", r, W * n, torch.int32))
    dist.all_to_all_single(buf[n // 2:n // 2 + W * n], buf[:W * n])
    expect("output shifted half a split past the input", buf[n // 2:n // 2 + W * n],
           torch.cat([rand("inplace:shifted", q, W * n, torch.int32)[r * n:(r + 1) * n] for q in range(W)]))
    return problems


@pytest.mark.parametrize("route", ["dma", "delegated"])
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_single_in_place(world, route):
    env = dict(ENV, TORCH_SDMA_DELEGATE="all_to_all") if route == "delegated" else ENV
    res = run_group(in_place_body, world, "sdma", env=env, timeout=120, pg_timeout_s=20)
    res.check()
    for rank, problems in enumerate(res.values()):
        assert not problems, f"rank {rank}: {problems}"
