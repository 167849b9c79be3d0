"""The release of a failed group on GPUs (docs/design.md, "Failures"; 2 GPUs, or one shared by two ranks with
SDMA_TEST_SHARE_GPU=1): a peer later than the group's timeout, on its CPU or on its GPU, gets its calls' right bytes
or an error, never another call's bytes; no copy lands in memory allocated after the failure; the group's streams run
out (a device synchronize returns); the rank's other groups keep gathering bit-exact; a group destroyed while a graph
replays its all-gathers, or its captured all-to-alls, does not fault the GPU; a peer whose process ends leaves the
survivor's streams free even when they all share one hardware queue."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from soak_faults import describe, fit_to_device, run_episode
from test_soak_faults_cpu import LATE_GATHER_THEN_P2P
from test_user_mistakes_cpu import run_mistake

from checks.data import expected_concat, poison_, rand, raw
from conftest import cuda_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

N = 64 * 1024  # float32 elements a rank: 256 KiB
CALLS = 3
LATE_S = 12.0  # beyond the group timeout of test_user_mistakes_cpu.run_mistake (PG_TIMEOUT_S, 8 s)


def _gather(form, group, name, rank, dev, async_op):
    W = group.size()
    x = rand(name, rank, N, torch.float32, dev)
    if form == "list":
        outs = [poison_(torch.empty(N, device=dev)) for _ in range(W)]
        w = dist.all_gather(outs, x, group=group, async_op=async_op)
        return w, lambda: torch.cat(outs)
    out = poison_(torch.empty(W * N, device=dev))
    w = dist.all_gather_into_tensor(out, x, group=group, async_op=async_op)
    return w, lambda: out


def _outcome(form, group, name, rank, dev, works_and_outputs):
    """Per call: "error" or "exact"; anything else (bytes of another call, poison) is returned as a finding."""
    results = []
    for i, (w, output) in enumerate(works_and_outputs):
        if isinstance(w, str):  # refused when called
            results.append(f"error: {w}")
            continue
        try:
            w.wait()
            torch.cuda.current_stream().synchronize()
            # A failure after the first wait() returned (it only ordered the stream) is reported by the next one.
            w.wait()
        except Exception as e:  # noqa: BLE001
            results.append(f"error: {str(e).splitlines()[0][:200]}")
            continue
        want = expected_concat(f"{name}{i}", range(group.size()), N, torch.float32)
        results.append("exact" if torch.equal(raw(output()), want) else f"WRONG BYTES in call {i}")
    return results


def _canaries(dev, count=8):
    return [(c, raw(c)) for c in (rand(f"canary{i}", 0, 2 * N, torch.float32, dev) for i in range(count))]


def _canaries_intact(canaries):
    torch.cuda.synchronize()
    return all(torch.equal(raw(c), want) for c, want in canaries)


def _other_group_exact(other, rank, dev):
    for i in range(5):
        w, output = _gather("into_tensor", other, f"other{i}", rank, dev, False)
        if not torch.equal(raw(output()), expected_concat(f"other{i}", range(other.size()), N, torch.float32)):
            return False
    return True


def late_peer_body(ctx, form, late, async_op):
    rank, dev = ctx.rank, ctx.device
    torch.cuda.set_device(dev)
    ctx.init_pg("cpu:gloo,cuda:sdma")
    timeout = datetime.timedelta(seconds=ctx.pg_timeout_s)
    g = dist.new_group([0, 1], timeout=timeout)
    other = dist.new_group([0, 1], timeout=timeout)
    for i in range(3):  # every member connected and mapped
        _gather(form, g, f"warm{i}", rank, dev, False)
        _gather("into_tensor", other, f"warm{i}", rank, dev, False)
    torch.cuda.synchronize()
    ctx.barrier_store("warm")
    calls = []
    if rank == 1 and late == "cpu":
        time.sleep(LATE_S)
    if rank == 1 and late == "gpu":
        torch.cuda._sleep(int(LATE_S * 2e9))  # the stream holds, the CPU goes on
    for i in range(CALLS):
        try:
            calls.append(_gather(form, g, f"call{i}", rank, dev, async_op))
        except Exception as e:  # noqa: BLE001
            calls.append((str(e).splitlines()[0][:200], None))
    results = _outcome(form, g, "call", rank, dev, calls)
    # Memory allocated after the failure: no late copy of the failed group may land in it.
    canaries = _canaries(dev)
    time.sleep(2.0)
    ctx.barrier_store("after")
    return {"results": results, "canaries_intact": _canaries_intact(canaries),
            "other_group_exact": _other_group_exact(other, rank, dev)}


@pytest.mark.parametrize("form", ["list", "into_tensor"])
@pytest.mark.parametrize("late", ["cpu", "gpu"])
def test_a_late_peer_gets_right_bytes_or_an_error(form, late):
    values = run_mistake(late_peer_body, kwargs={"form": form, "late": late, "async_op": True}, cuda=True)
    for rank, v in enumerate(values):
        assert all(r == "exact" or r.startswith("error") for r in v["results"]), f"rank {rank}: {v}"
        assert v["canaries_intact"], f"rank {rank}: memory allocated after the failure was written: {v}"
        assert v["other_group_exact"], f"rank {rank}: the other group stopped gathering right: {v}"
    assert any(r.startswith("error") for r in values[0]["results"]), f"the early rank did not time out: {values}"


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="a collective failed by the copy-engine watchdog does not fail the group's point-to-point "
                          "pairs, whose later ops run (docs/errors.md, a peer later than the group's timeout)")
def test_point_to_point_after_a_late_sync_gather_is_refused():
    """The fault soak's episode 3 of seed 67 (test_soak_faults_cpu.py, LATE_GATHER_THEN_P2P) on the direct path: rank 1
    reaches a synchronous gather past the timeout, and each of the 55 later calls of both ranks, the point-to-point ones
    among them, must be refused, since the group failed."""
    fault = fit_to_device(LATE_GATHER_THEN_P2P, "cuda")  # as the soak ran it: on the direct path
    problems, outcomes, _ = run_episode(67, 3, fault, calls=100, timeout_s=2.5, device="cuda", mix=True)
    assert not problems, f"{describe(fault)}:\n" + "\n".join(problems)


# Episodes of the fault soak (seed 41, 200 calls) in which the survivor's streams stayed held: the peer's process ends
# with the survivor's direct-path calls waiting on it, and the staging transport connected too.
GONE_PEER_EPISODES = [("exit_in_flight", 155, 3), ("sigkill", 26, 4)]


@pytest.mark.parametrize("queues", ["1", "default"])
@pytest.mark.parametrize("kind,at,episode", GONE_PEER_EPISODES, ids=[k for k, _, _ in GONE_PEER_EPISODES])
def test_a_gone_peer_leaves_the_survivors_streams_free(kind, at, episode, queues):
    """The survivor passes its own waits on a peer whose process ended (docs/design.md, "Failures", rule 4) with a
    write that no work of its own holds: with CUDA_DEVICE_MAX_CONNECTIONS=1 every stream of the process, the
    transports' service stream included, shares one hardware queue with the lanes that wait, and whatever the queues,
    nothing the watchdog does for it may wait for the primary context's work. The survivor's calls raise or return
    bit-exact bytes, memory allocated after the failure stays unwritten, and its streams synchronize."""
    fault = {"kind": kind, "rank": 1, "at": at, "direct": True, "inner_allgathers": False}
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": queues} if queues != "default" else None
    problems, outcomes, _ = run_episode(41, episode, fault, calls=200, timeout_s=2.5, device="cuda", env=env)
    assert not problems, f"{describe(fault)}:\n" + "\n".join(problems)
    assert any(not o.startswith("ok") for o in outcomes[0]), f"the survivor saw no error: {outcomes[0]}"


def replay_then_destroy_body(ctx, op="all_gather"):
    rank, dev = ctx.rank, ctx.device
    torch.cuda.set_device(dev)
    ctx.init_pg("cpu:gloo,cuda:sdma")
    g = dist.new_group([0, 1])
    if op == "all_gather":
        x = rand("graph", rank, N, torch.float32, dev)
        want = expected_concat("graph", [0, 1], N, torch.float32)

        def call():
            dist.all_gather_into_tensor(out, x, group=g)
    else:  # an exchange: each rank's second half goes to the other
        x = rand("graph", rank, 2 * N, torch.float32, dev)
        want = torch.cat([raw(rand("graph", q, 2 * N, torch.float32).narrow(0, rank * N, N)) for q in range(2)])

        def call():
            dist.all_to_all_single(out, x, group=g)
    out = torch.empty(2 * N, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the capture connects the group
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            call()
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    first = torch.equal(raw(out), want)
    ctx.barrier_store("replayed")
    poison_(out)
    graph.replay()  # in flight while its group goes
    dist.destroy_process_group(g)
    torch.cuda.synchronize()  # a fault in the replay would surface here
    second = torch.equal(raw(out), want)
    del graph
    # The GPU context is alive: a new group gathers.
    h = dist.new_group([0, 1])
    w, output = _gather("into_tensor", h, "afterwards", rank, dev, False)
    after = torch.equal(raw(output()), expected_concat("afterwards", [0, 1], N, torch.float32))
    return {"first": first, "second": second, "after": after}


@pytest.mark.parametrize("op", ["all_gather", "all_to_all_single"])
def test_destroy_while_a_replay_is_in_flight(op):
    for rank, v in enumerate(run_mistake(replay_then_destroy_body, kwargs={"op": op}, cuda=True)):
        assert v == {"first": True, "second": True, "after": True}, f"rank {rank}: {v}"
