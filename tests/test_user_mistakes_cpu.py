"""A user's mistake gives a clear Python error on every rank, within the group's timeout, and nothing worse: no rank
killed by a signal, no wrong bytes returned, nothing left in /dev/shm (docs/errors.md). CPU ranks in real processes;
the GPU twins are in test_user_mistakes_cuda.py."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from checks.data import SHARE_GPU, assert_bytes_equal, poison_, rand, raw
from mp_harness import run_group

PG_TIMEOUT_S = 8.0
SLACK_S = 25.0  # scheduling on a loaded 2-core CI machine
BACKTRACE = "Exception raised from"


def shm_entries():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("torch_sdma")}
    except FileNotFoundError:
        return set()


def shm_entries_left(before):
    """Our /dev/shm entries made since `before` that stay. Other groups on this host (other test runs) create
    segments too, and unlink them within moments: only an entry that stays is a leak."""
    left = shm_entries() - before
    for _ in range(10):
        if not left:
            break
        time.sleep(0.5)
        left &= shm_entries()
    return left


def shm_maps():
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line and len(line.split(None, 5)) == 6]


def _error_of(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


# ------------------------------------------------------------------------------------------------ rank bodies
def knobs_differ_body(ctx):
    """init_process_group with a knob set on rank 0 only: refused on every rank, before anything is mapped."""
    r = _error_of(lambda: ctx.init_pg("sdma"))
    r["maps"] = shm_maps()
    return r


def sizes_differ_body(ctx, form, async_op):
    """Each rank passes an input of its own size: the call fails on every rank. `refused_at_call`: the call itself
    raised (nothing was enqueued), so that the outputs must keep their poison where no peer writes them."""
    W, rank, dev = ctx.world, ctx.rank, ctx.device
    n = 1024 * (rank + 1)
    x = rand("differ", rank, (n,), torch.float32, device=dev)
    if form == "into_tensor":
        outs = [poison_(torch.empty(W * n, device=dev))]
        call = lambda: dist.all_gather_into_tensor(outs[0], x, async_op=async_op)  # noqa: E731
    else:
        outs = [poison_(torch.empty(n, device=dev)) for _ in range(W)]
        call = lambda: dist.all_gather(outs, x, async_op=async_op)  # noqa: E731

    returned = []

    def run():
        w = call()
        returned.append(True)
        if async_op:
            w.wait()

    r = _error_of(run)
    r["refused_at_call"] = r["error"] is not None and not returned
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    r["untouched"] = all(bool((raw(o) == 0xA5).all()) for o in outs)
    # The group is now failed: a valid call is refused, in one paragraph.
    y = rand("after", rank, (256,), torch.float32, device=dev)
    r["after"] = _error_of(lambda: dist.all_gather_into_tensor(torch.empty(W * 256, device=dev), y))["error"]
    return r


def calls_differ_body(ctx, case, warm, late):
    """Rank 1 makes another call than rank 0 at the same point of the group's sequence (rank 0 always an
    all_gather_into_tensor of 1024 floats): `case` "all_reduce" or "broadcast" (a delegated collective), "zero" (the
    same call with 0 elements), "list" (the list form); "all_reduce_on_0": rank 0 makes the all_reduce and rank 1 the
    all-gather (unwarmed, rank 0's all_reduce is the first call of the inner backend, whose rank 0 starts its
    connect). Each rank returns its error and how long the call took to raise, counted from a barrier just before it;
    `warm`: an agreeing all-gather and all-reduce ran first; `late`: the rank that makes its call 0.3 s after the other
    (which then cannot see it when it posts: the late one refuses, and the early one's watcher must find it), or
    None."""
    W, rank, dev = ctx.world, ctx.rank, ctx.device
    n = 1024
    if warm:
        out = poison_(torch.empty(W * n, device=dev))
        dist.all_gather_into_tensor(out, rand("warm", rank, (n,), torch.float32, device=dev))
        dist.all_reduce(torch.ones(8, device=dev if not SHARE_GPU else "cpu"))
    x = rand("differ", rank, (n,), torch.float32, device=dev)
    out = poison_(torch.empty(W * n, device=dev))
    if rank != (0 if case == "all_reduce_on_0" else 1):
        call = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
    elif case in ("all_reduce", "all_reduce_on_0"):
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif case == "broadcast":
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
    elif case == "zero":
        call = lambda: dist.all_gather_into_tensor(torch.empty(0, device=dev), torch.empty(0, device=dev))  # noqa: E731
    else:
        call = lambda: dist.all_gather([torch.empty(n, device=dev) for _ in range(W)], x)  # noqa: E731

    def run():
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        # A synchronous call whose rank did not see the other's post fails on its watchdog: the error comes with the
        # next call.
        dist.all_gather_into_tensor(torch.empty(W * 16, device=dev), torch.ones(16, device=dev))

    ctx.store.set(f"ready{rank}", "1")
    ctx.store.wait([f"ready{q}" for q in range(W)])
    if rank == late:
        time.sleep(0.3)
    r = _error_of(run)
    if SHARE_GPU and dev.type == "cuda":  # no NCCL: the next all-gather then
        after = lambda: dist.all_gather_into_tensor(torch.empty(W * 4, device=dev), torch.ones(4, device=dev))  # noqa: E731
    else:
        after = lambda: dist.all_reduce(torch.ones(4, device=dev))  # noqa: E731
    r["after"] = _error_of(after)["error"]
    return r


def sizes_agree_body(ctx):
    """The size check passes what it should: equal sizes on the same group, bit-exact, several times."""
    W, rank, dev = ctx.world, ctx.rank, ctx.device
    for i, n in enumerate((1, 1000, 70000, 3)):
        x = rand(f"agree{i}", rank, (n,), torch.float32, device=dev)
        expected = torch.cat([raw(rand(f"agree{i}", q, (n,), torch.float32)) for q in range(W)])
        out = poison_(torch.empty(W * n, device=dev), expected)
        dist.all_gather_into_tensor(out, x)
        assert_bytes_equal(out, expected, f"all-gather {i}")
    return {"error": None}


def destroyed_body(ctx):
    """Collectives, stats() and group_path() on a destroyed subgroup and on a WORLD handle kept across
    destroy_process_group: each a Python error, never a crash."""
    import torch_sdma

    W, rank, dev = ctx.world, ctx.rank, ctx.device
    g = dist.new_group()
    x = rand("d", rank, (100,), torch.float32, device=dev)
    dist.all_gather_into_tensor(torch.empty(W * 100, device=dev), x, group=g)
    dist.destroy_process_group(g)
    errors = {
        "subgroup all_gather_into_tensor": _error_of(
            lambda: dist.all_gather_into_tensor(torch.empty(W * 100, device=dev), x, group=g))["error"],
        "subgroup all_reduce": _error_of(lambda: dist.all_reduce(x.clone(), group=g))["error"],
        # Past torch's own check of the group map, straight to the backend.
        "subgroup ProcessGroup._allgather_base": _error_of(
            lambda: g._allgather_base(torch.empty(W * 100, device=dev), x).wait())["error"],
        "subgroup ProcessGroup.allreduce": _error_of(lambda: g.allreduce([x.clone()]).wait())["error"],
        "subgroup stats": _error_of(lambda: torch_sdma.stats(g))["error"],
        "subgroup group_path": _error_of(lambda: torch_sdma.group_path(g, dev.type))["error"],
    }
    world = dist.group.WORLD
    dist.all_gather_into_tensor(torch.empty(W * 100, device=dev), x, group=world)
    dist.destroy_process_group()
    errors["WORLD all_gather_into_tensor"] = _error_of(
        lambda: dist.all_gather_into_tensor(torch.empty(W * 100, device=dev), x, group=world))["error"]
    errors["WORLD ProcessGroup._allgather_base"] = _error_of(
        lambda: world._allgather_base(torch.empty(W * 100, device=dev), x).wait())["error"]
    errors["WORLD stats"] = _error_of(lambda: torch_sdma.stats(world))["error"]
    return errors


def first_call_missing_body(ctx):
    """Rank 1 never makes the group's first all-gather (where the transport connects)."""
    W, rank = ctx.world, ctx.rank
    if rank == 1:
        deadline = time.monotonic() + PG_TIMEOUT_S + SLACK_S + 30
        while time.monotonic() < deadline and not ctx.store.check(["pub/done"]):
            time.sleep(0.1)
        return {"victim": True}
    x = rand("first", rank, (4096,), torch.float32, device=ctx.device)
    r = _error_of(lambda: dist.all_gather_into_tensor(torch.empty(W * 4096, device=ctx.device), x))
    # The peers may be anywhere inside the connect: the next all-gather is refused at once, not tried again.
    r["after"] = _error_of(lambda: dist.all_gather_into_tensor(torch.empty(W * 4096, device=ctx.device), x))
    ctx.publish("done", 1)
    return r


def misspelt_knob_body(ctx):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx.init_pg("sdma")
        dist.new_group()  # a second group: still one warning per process
    W, rank = ctx.world, ctx.rank
    x = rand("m", rank, (300,), torch.float32)
    out = poison_(torch.empty(W * 300))
    dist.all_gather_into_tensor(out, x)
    assert_bytes_equal(out, torch.cat([raw(rand("m", q, (300,), torch.float32)) for q in range(W)]), "after")
    return {"warnings": [str(w.message) for w in caught if "TORCH_SDMA" in str(w.message)]}


def list_element_wrong_size_body(ctx):
    W, rank = ctx.world, ctx.rank
    x = rand("l", rank, (10,), torch.float32)
    outs = [torch.empty(10) for _ in range(W)]
    outs[1] = torch.empty(11)
    return _error_of(lambda: dist.all_gather(outs, x))


# ------------------------------------------------------------------------------------------------ checks
def run_mistake(body, init=None, kwargs=None, per_rank_env=None, env=None, cuda=False):
    """Runs `body` on two ranks; every rank must end with a result (no signal death) and /dev/shm must hold no new
    entry of ours. Returns each rank's value."""
    before = shm_entries()
    res = run_group(body, 2, init, kwargs=kwargs, env=env, per_rank_env=per_rank_env,
                    timeout=PG_TIMEOUT_S + SLACK_S + 90, pg_timeout_s=PG_TIMEOUT_S, grace=PG_TIMEOUT_S + SLACK_S,
                    destroy=False, hard_exit=True, cuda=cuda)
    problems = []
    for r in res.ranks:
        if r.exitcode is not None and r.exitcode < 0:
            problems.append(f"rank {r.rank} killed by {signal.Signals(-r.exitcode).name}")
        elif r.status != "ok":
            problems.append(f"rank {r.rank}: {r.error}")
    left = shm_entries_left(before)
    if left:
        problems.append(f"left in /dev/shm: {sorted(left)}")
    assert not problems, "\n".join(problems) + "\n" + res.describe()
    return [r.value for r in res.ranks]


def one_paragraph(msg):
    assert BACKTRACE not in msg, f"a C++ backtrace inside the message: {msg!r}"
    assert "\n" not in msg.strip(), f"not one paragraph: {msg!r}"


@pytest.mark.parametrize("knob,rank0,rank1_shows", [
    ("TORCH_SDMA_STAGING_BYTES", "64K", "group rank 0 has 65536, group rank 1 has 33554432"),
    ("TORCH_SDMA_STAGING_BYTES", "64M", "group rank 0 has 67108864, group rank 1 has 33554432"),
    ("TORCH_SDMA_SLOTS", "4", "group rank 0 has 4, group rank 1 has 2"),
    ("TORCH_SDMA_CHUNK_BYTES", "8K", "group rank 0 has 8192, group rank 1 has 0"),
    ("TORCH_SDMA_DIRECT", "1", "group rank 0 has 1, group rank 1 has 0"),
    ("TORCH_SDMA_DISABLE", "1", "group rank 0 has 1, group rank 1 has 0"),
    ("TORCH_SDMA_MIN_BYTES", "1M", "group rank 0 has 1048576, group rank 1 has 0"),
])
def test_knob_set_on_one_rank_refuses_the_group(knob, rank0, rank1_shows):
    values = run_mistake(knobs_differ_body, per_rank_env={0: {knob: rank0}})
    for rank, v in enumerate(values):
        err = v["error"]
        assert err is not None, f"rank {rank}: the group formed although {knob} differs"
        assert err.startswith("ValueError: torch_sdma: group"), f"rank {rank}: {err}"
        assert knob in err and rank1_shows in err, f"rank {rank}: {err}"
        one_paragraph(err)
        assert v["elapsed"] < PG_TIMEOUT_S + SLACK_S, (rank, v)
        assert not [m for m in v["maps"] if "torch_sdma" in m], f"rank {rank} still maps {v['maps']}"


def allocator_differs_body(ctx):
    """Only rank 1's caching allocator makes expandable segments: not a knob the user set, so the group forms, and
    bit-exact all-gathers follow."""
    r = _error_of(lambda: ctx.init_pg("sdma"))
    if r["error"] is None:
        o = dist.group.WORLD._get_backend(torch.device("cpu"))._sdma_options
        r["direct"] = (o.direct_cuda, o.direct_cuda_from_allocator)
        W, rank = ctx.world, ctx.rank
        x = rand("alloc", rank, (3000,), torch.float32)
        expected = torch.cat([raw(rand("alloc", q, (3000,), torch.float32)) for q in range(W)])
        out = poison_(torch.empty(W * 3000), expected)
        dist.all_gather_into_tensor(out, x)
        assert_bytes_equal(out, expected, "after the allocators differed")
    return r


def test_an_allocator_difference_is_not_a_knob_difference():
    expandable = {1: {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    values = run_mistake(allocator_differs_body, per_rank_env=expandable,
                         env={"TORCH_SDMA_DIRECT": None, "PYTORCH_CUDA_ALLOC_CONF": None})
    assert [v["error"] for v in values] == [None, None], values
    assert [tuple(v["direct"]) for v in values] == [(True, False), (False, True)], values


def non_contiguous_body(ctx):
    """One non-contiguous tensor per call, the same on every rank (so no peer waits for a call that never posted):
    each call raises at once, naming which tensor; then the group still gathers right."""
    ctx.init_pg("sdma")
    W, rank = ctx.world, ctx.rank

    def strided(n):  # n elements, every other one of a buffer
        return torch.zeros(2 * n)[::2]

    ok = torch.zeros(8)
    calls = {
        "the input": lambda: dist.all_gather_into_tensor(torch.zeros(W * 8), strided(8)),
        "the output": lambda: dist.all_gather_into_tensor(strided(W * 8), ok),
        "entry 1 of the output list": lambda: dist.all_gather([torch.zeros(8), strided(8)], ok),
        "the input of all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(W * 4), strided(W * 4)),
        "entry 1 of the input list": lambda: dist.all_to_all([torch.zeros(4) for _ in range(W)],
                                                             [torch.zeros(4), strided(4)]),
    }
    errors = {what: _error_of(call)["error"] for what, call in calls.items()}
    x = rand("after", rank, (3000,), torch.float32)
    expected = torch.cat([raw(rand("after", q, (3000,), torch.float32)) for q in range(W)])
    out = poison_(torch.empty(W * 3000), expected)
    dist.all_gather_into_tensor(out, x)
    assert_bytes_equal(out, expected, "after the refused calls")
    return errors


def test_a_non_contiguous_tensor_is_named():
    for rank, errors in enumerate(run_mistake(non_contiguous_body, env={"TORCH_SDMA_MIN_BYTES": "0"})):
        for what, err in errors.items():
            which = "the input" if what == "the input of all_to_all_single" else what
            assert err is not None and f"Tensors must be contiguous: {which} is not" in err, (rank, what, err)
            assert err.startswith("ValueError"), (rank, what, err)
            one_paragraph(err)


def splits_disagree_body(ctx):
    """Rank 0 sends rank 1 three rows of 16 bytes; rank 1 expects one row from it. Every other pair agrees."""
    ctx.init_pg("sdma")
    send = [1, 3] if ctx.rank == 0 else [1, 1]
    recv = [1, 1]
    out = torch.zeros(sum(recv), 4)
    return _error_of(lambda: dist.all_to_all_single(out, torch.zeros(sum(send), 4), recv, send))


def test_splits_that_disagree_are_named_on_both_ranks():
    """Whichever rank reads the other's post first finds the pair disagreeing; the other learns of it from the
    group's failure: both name the pair and its sizes."""
    words = "group rank 0 sends 48 bytes to group rank 1, which expects 16 bytes from it"
    for rank, v in enumerate(run_mistake(splits_disagree_body, env={"TORCH_SDMA_MIN_BYTES": "0"})):
        err = v["error"]
        assert err is not None and "all_to_all_single" in err and words in err, (rank, err)
        one_paragraph(err)
        assert v["elapsed"] < PG_TIMEOUT_S + SLACK_S, (rank, v)


@pytest.mark.parametrize("form,async_op,direct", [
    ("into_tensor", False, "0"), ("into_tensor", True, "0"), ("list", False, "0"), ("into_tensor", False, "1"),
])
def test_sizes_differ_fail_every_rank(form, async_op, direct):
    values = run_mistake(sizes_differ_body, "sdma", kwargs={"form": form, "async_op": async_op},
                  env={"TORCH_SDMA_DIRECT": direct})
    for rank, v in enumerate(values):
        err = v["error"]
        assert err is not None, f"rank {rank}: no error although the ranks passed different sizes"
        assert "different sizes" in err, f"rank {rank}: {err}"
        assert "group rank 0 4096 bytes of Float" in err and "group rank 1 8192 bytes of Float" in err, err
        one_paragraph(err)
        assert v["untouched"], f"rank {rank}: bytes landed in the output of a failed call"
        after = v["after"]
        assert after is not None and "an earlier collective on this group failed" in after, (rank, after)
        one_paragraph(after)
        assert len(after) < 1200, f"rank {rank}: {len(after)} characters: {after!r}"


def test_equal_sizes_pass_the_size_check():
    run_mistake(sizes_agree_body, "sdma")


def test_destroyed_group_raises():
    for rank, errors in enumerate(run_mistake(destroyed_body, "sdma")):
        for what, err in errors.items():
            assert err is not None, f"rank {rank}: {what} on a destroyed group did not raise"
            # torch answers the public API itself (the group left its map); the backend answers the rest.
            torch_words = ("not initialized in the world group map", "not been initialized")
            assert "was destroyed" in err or ("ProcessGroup." not in what and any(w in err for w in torch_words)), (
                f"rank {rank}: {what}: {err}")
            one_paragraph(err)


def test_peer_missing_at_the_first_call_is_named():
    v = run_mistake(first_call_missing_body, "sdma")[0]
    err = v["error"]
    assert err is not None, "the first all-gather succeeded without rank 1"
    assert "all_gather_into_tensor" in err and "group ranks [1]" in err and "never reached it" in err, err
    one_paragraph(err)
    assert v["elapsed"] < PG_TIMEOUT_S + SLACK_S, v
    after = v["after"]
    assert after["error"] is not None and "refused: an earlier collective on this group failed" in after["error"], v
    assert after["elapsed"] < 1.0, after


def test_misspelt_knob_warns_once_naming_the_closest():
    for rank, v in enumerate(run_mistake(misspelt_knob_body, env={"TORCH_SDMA_STAGNG_BYTES": "64K"})):
        assert len(v["warnings"]) == 1, (rank, v)
        assert "TORCH_SDMA_STAGNG_BYTES" in v["warnings"][0] and "TORCH_SDMA_STAGING_BYTES" in v["warnings"][0], v


def test_list_element_of_the_wrong_size_is_named_in_our_words():
    for rank, v in enumerate(run_mistake(list_element_wrong_size_body, "sdma")):
        err = v["error"]
        assert err is not None and err.startswith("ValueError: all_gather: output tensor 1 has 11 elements"), err
        assert "Gloo" not in err, err
        one_paragraph(err)


# Ranks that make different calls at the same point of the group's sequence (docs/errors.md): the rank that reads the
# other's post on the call board refuses at once, the other one's watcher (the worker's waits for an all-gather, the
# watcher of delegated calls for gloo's) finds the same post and fails its call in the same words.
CALLS_DIFFER_WORDS = {
    "all_reduce": "the ranks called different collectives: all_gather_into_tensor on rank 0 vs all_reduce on rank 1",
    "all_reduce_on_0": ("the ranks called different collectives: all_reduce on rank 0 vs all_gather_into_tensor on "
                        "rank 1"),
    "broadcast": "the ranks called different collectives: all_gather_into_tensor on rank 0 vs broadcast on rank 1",
    "zero": ("the ranks passed inputs of different sizes to all_gather_into_tensor (bytes per rank: group rank 0 "
             "4096 bytes of Float, group rank 1 0 bytes of Float)"),
    "list": "the ranks called different collectives: all_gather_into_tensor on rank 0 vs all_gather on rank 1",
}


@pytest.mark.parametrize("case,warm,late", [
    ("all_reduce", True, 0),  # rank 1 is inside gloo's all_reduce: the watcher of delegated calls fails it
    ("all_reduce", True, 1),  # rank 0's all-gather is on the worker: its waits fail it
    ("all_reduce", False, None),  # the group's first all-gather, which connects the transport
    ("all_reduce_on_0", False, None),
    ("all_reduce_on_0", False, 1),  # rank 0 is inside gloo's first all_reduce when rank 1 posts the all-gather
    ("broadcast", True, 0),
    ("zero", True, 1),
    ("zero", False, 0),
    ("list", True, 1),
])
@pytest.mark.parametrize("direct", ["0", "1"])
def test_calls_that_differ_are_named_on_every_rank(case, warm, late, direct):
    values = run_mistake(calls_differ_body, "sdma", kwargs={"case": case, "warm": warm, "late": late},
                         env={"TORCH_SDMA_DIRECT": direct})
    assert_named_on_every_rank(values, case, 3 if warm else 1, late)


# Below TORCH_SDMA_MIN_BYTES the all-gathers go to the inner backend too: the one that a peer's other call meets must
# fail in the board's words as fast, also where it posted first (late 1) and is then inside gloo's all-gather.
@pytest.mark.parametrize("late", [1, 0])
def test_inner_allgather_that_differs_is_named_on_every_rank(late):
    values = run_mistake(calls_differ_body, "sdma", kwargs={"case": "all_reduce", "warm": True, "late": late},
                         env={"TORCH_SDMA_MIN_BYTES": "1M"})
    assert_named_on_every_rank(values, "all_reduce", 3, late)


def assert_named_on_every_rank(values, case, seq, late):
    words = f"{CALLS_DIFFER_WORDS[case]}, sequence number {seq} of group '0'"
    for rank, v in enumerate(values):
        err = v["error"]
        assert err is not None, f"rank {rank}: no error although the ranks called different collectives: {v}"
        assert words in err, f"rank {rank}: {err!r} does not say {words!r}"
        one_paragraph(err)
        assert v["elapsed"] < PG_TIMEOUT_S + SLACK_S, (rank, v)
        after = v["after"]
        assert after is not None and "an earlier collective on this group failed" in after, (rank, after)
    assert min(v["elapsed"] for v in values) < 1.0, values
    if late is not None:
        assert values[late]["elapsed"] < 1.0, values  # it saw the early rank's post
