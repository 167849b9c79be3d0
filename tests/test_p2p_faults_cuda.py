"""GPU (2 GPUs, or one shared by two ranks with SDMA_TEST_SHARE_GPU=1; skipped elsewhere): the point-to-point fault
cases of test_p2p_cpu.py on CUDA tensors ("cpu:gloo,cuda:sdma", TORCH_SDMA_MIN_BYTES=0 so that tiny sizes take the
copy engines), 2 ranks, with the bodies of checks/p2p_faults.py, plus cases of their own: sizes that differ then a
lone call, a halo isend/irecv on both ranks, a batch mixing a CPU and a CUDA tensor, all_to_all_single in place.

Every test asserts that no rank dies (each returns its result and exits with status 0) and that no rank's current
stream stays held: the bodies poll the stream after each outcome, up to the group's timeout plus slack. Where a case
fails, every rank that took part raises within the group's timeout plus slack; where the expected outcome is "right
bytes or an error", the bytes are compared exactly once the stream is released. An isend never blocks its caller
more than 5 s."""
import pytest

from checks import p2p_faults as faults
from checks.data import NCCL_SHARED_REASON, SHARE_GPU
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

INIT = "cpu:gloo,cuda:sdma"
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
FAIL_TIMEOUT_S = 10.0  # the group's timeout where a failure is expected
OK_TIMEOUT_S = 30.0  # where every op should succeed
SLACK_S = 10.0
LIMIT_S = FAIL_TIMEOUT_S + SLACK_S  # an error comes within this, and a held stream is released within this
AT_ONCE_S = 5.0  # an op that fails at once, well below the group's timeout
ISEND_S = 5.0  # the longest an isend may block its caller
REFUSED = "refused"

def run(body, pg_timeout_s=FAIL_TIMEOUT_S, init=INIT, env=ENV, kwargs=None, calls=4):
    """Runs `body` on 2 ranks, long enough for `calls` waits of the group's timeout plus slack each."""
    limit = pg_timeout_s + SLACK_S
    return run_group(body, 2, init, env=env, kwargs=dict(kwargs or {}, slack_s=SLACK_S), cuda=True,
                     pg_timeout_s=pg_timeout_s, timeout=calls * limit + 90, grace=calls * limit, destroy=False,
                     hard_exit=True)


def assert_no_rank_died(res):
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()


def assert_released(rank, released, values):
    """Every stream release recorded by a rank came within the group's timeout plus slack (None: still held)."""
    if not isinstance(released, list | tuple):
        released = [released]
    assert all(s is not None for s in released), \
        f"rank {rank}: the current stream stayed held past the group's timeout plus slack ({released}): {values}"


def test_cuda_p2p_refused_batch_leaves_no_batch_open():
    """A batch whose sides pass different sizes fails on both ranks (DistBackendError); the lone isend/irecv that
    follows is refused on both; the lone recv's buffer stays untouched; no stream stays held."""
    res = run(faults.refused_batch_body)
    assert_no_rank_died(res)
    values = res.values()
    for rank, (errors, touched, released) in enumerate(values):
        batch, lone = errors
        assert_released(rank, released, values)
        assert batch is not None and "DistBackendError" in batch, f"rank {rank}: the batch: {batch}"
        assert lone is not None and REFUSED in lone, f"rank {rank}: the lone call after the failed batch: {lone}"
        assert touched is False, f"rank {rank}: the lone recv after the failed batch got bytes ({touched})"


@pytest.mark.parametrize("delegate", [None, pytest.param("send,recv", marks=pytest.mark.skipif(
    SHARE_GPU, reason=NCCL_SHARED_REASON))])
def test_cuda_p2p_recv_from_any_source(delegate):
    """A recv without a source is refused at once, its buffer unwritten, and the send meets the recv from 0 that
    follows, bytes right: on the copy engines by torch_sdma (NotImplementedError naming src=; delegating is no way
    out for CUDA tensors), delegated by NCCL, which receives only from a named rank."""
    res = run(faults.any_source_body, pg_timeout_s=OK_TIMEOUT_S, env=dict(ENV, TORCH_SDMA_DELEGATE=delegate))
    res.check()
    refused, dt, _, _ = res.values()[1]
    assert refused is not None, "a recv without a source on CUDA tensors was not refused"
    if delegate is None:
        assert "NotImplementedError" in refused and "src=" in refused and "NCCL refuses" in refused, refused
        assert "TORCH_SDMA_DELEGATE" not in refused, refused
    else:
        assert "recvAnysource" in refused, refused
    assert dt < AT_ONCE_S, f"refused after {dt:.1f} s"


REFUSAL_TIMEOUT_S = 20.0


@pytest.mark.parametrize("refuser_late", [False, True])
@pytest.mark.parametrize("form", ["lone", "batch", "first"])
def test_cuda_p2p_refused_op_takes_its_pair_serial(form, refuser_late):
    """Rank 1 refuses an op on its own arguments (ValueError, non-contiguous); rank 0's matching op fails at once
    naming rank 1 and its error; the next op of each rank is refused at once; rank 0's buffers keep their poison; no
    stream stays held."""
    res = run(faults.refused_p2p_body, pg_timeout_s=REFUSAL_TIMEOUT_S,
              kwargs={"form": form, "refuser_late": refuser_late})
    assert_no_rank_died(res)
    values = res.values()
    (dt0, err0, dt0_after, after0, poisoned0, rel0), (dt1, err1, dt1_after, after1, poisoned1, rel1) = values
    assert_released(0, rel0, values)
    assert_released(1, rel1, values)
    assert err1 is not None and err1.startswith("ValueError") and "contiguous" in err1, err1
    assert err0 is not None and "group rank 1 refused its" in err0 and "on its own arguments" in err0, err0
    assert "its error: torch_sdma:" in err0 and "contiguous" in err0, err0
    assert dt0 < AT_ONCE_S, f"rank 0's op failed after {dt0:.1f} s: {err0}"
    assert after0 is not None and REFUSED in after0, after0
    assert after1 is not None and REFUSED in after1, after1
    assert dt0_after < AT_ONCE_S and dt1_after < AT_ONCE_S, (dt0_after, dt1_after, values)
    assert poisoned0 and poisoned1, f"a buffer of a refused or failed op got bytes: {values}"


def test_cuda_p2p_isends_past_the_ring_never_block():
    """1,100 isends (a pair's ring holds 1,024 posts) then an all-gather on rank 0, the all-gather then the irecvs on
    rank 1: no isend blocks its caller more than 5 s, every byte arrives, the all-gather completes."""
    res = run(faults.backlog_body, pg_timeout_s=OK_TIMEOUT_S)
    res.check()
    slowest, total = res.values()[0]
    assert slowest < ISEND_S, f"an isend blocked its caller for {slowest:.1f} s"
    assert total < OK_TIMEOUT_S / 2, f"{total:.1f} s"


def test_cuda_p2p_backlog_whose_peer_never_comes_fails_in_wait():
    """1,100 isends that rank 1 never meets: none blocks its caller more than 5 s; every one raises DistBackendError
    within the group's timeout plus slack, the first naming rank 1 as timed out; rank 0's stream is released."""
    res = run(faults.backlog_never_met_body)
    assert_no_rank_died(res)
    slowest, elapsed, errors, released = res.values()[0]
    assert slowest < ISEND_S, f"an isend blocked its caller for {slowest:.1f} s"
    assert_released(0, released, (slowest, elapsed, errors[:3]))
    assert len(errors) == faults.BACKLOG_OPS and all(e is not None and "DistBackendError" in e for e in errors), \
        (sum(e is None for e in errors), errors[:3])
    assert "timed out" in errors[0] and ("group ranks [1]" in errors[0] or "group rank 1" in errors[0]), errors[0]
    assert elapsed < LIMIT_S, f"{elapsed:.1f} s: {errors[:3]}"


def test_cuda_p2p_first_op_does_not_wait_for_the_peer_to_connect():
    """The pair's first op made while the peer is inside the group's first all-gather returns within 5 s; the
    all-gather completes on both and the bytes arrive whole."""
    res = run(faults.first_op_beside_collective_body, pg_timeout_s=OK_TIMEOUT_S)
    res.check()
    for rank, (returned, total) in enumerate(res.values()):
        assert returned < ISEND_S, f"rank {rank}: the pair's first op blocked its caller for {returned:.1f} s"
        assert total < OK_TIMEOUT_S / 2, f"rank {rank}: {total:.1f} s"


def test_cuda_p2p_first_ops_of_two_groups_in_opposite_orders():
    """Two groups over the same ranks whose pairs' first ops come in opposite orders both complete with their bytes,
    long before the groups' timeout."""
    res = run(faults.opposite_subgroups_body, pg_timeout_s=OK_TIMEOUT_S)
    res.check()
    for rank, elapsed in enumerate(res.values()):
        assert elapsed < OK_TIMEOUT_S / 2, f"rank {rank}: {elapsed:.1f} s"


def test_cuda_p2p_batch_refused_at_issue_leaves_the_group_working():
    """A batch holding an isend refused as it is issued (non-contiguous) raises, naming it; the all-gather that
    follows moves its bytes or raises (at the call, or at the group's next call); no stream stays held."""
    res = run(faults.batch_refused_at_issue_body)
    assert_no_rank_died(res)
    values = res.values()
    for rank, (batch, after, exact, later, released) in enumerate(values):
        assert_released(rank, released, values)
        assert batch is not None and "contiguous" in batch, f"rank {rank}: {batch}"
        assert after is not None or exact or later is not None, \
            f"rank {rank}: the all-gather after the batch returned without its bytes and no error: {values}"


def _errors_in_time(rank, what, outcome, values):
    dt, err = outcome
    assert err is not None, f"rank {rank}: {what} raised nothing: {values}"
    assert dt < LIMIT_S, f"rank {rank}: {what}'s error took {dt:.1f} s: {err}"


def test_cuda_p2p_sizes_differ_then_lone_call():
    """A send of 1,001 bytes met by a recv of 1,000 (uint8): both ranks raise within the group's timeout plus slack
    and neither stream stays held; the lone isend/irecv that follows is refused on both ranks, or moves its bytes."""
    res = run(faults.sizes_differ_then_lone_body)
    assert_no_rank_died(res)
    values = res.values()
    for rank, v in enumerate(values):
        assert_released(rank, v["released"], values)
        _errors_in_time(rank, "the send or recv of sizes that differ", v["first"], values)
    lone = [v["lone"] for v in values]
    if any(e is not None for _, e in lone):
        for rank, (dt, e) in enumerate(lone):
            assert e is not None and REFUSED in e, f"rank {rank}: the lone call after the failure: {values}"
            assert dt < LIMIT_S, f"rank {rank}: the lone call's error took {dt:.1f} s: {e}"
    else:
        assert values[1]["exact"], f"the lone recv after the failure got wrong bytes and no error: {values}"


def test_cuda_p2p_halo_isend_then_irecv_on_both():
    """Both ranks isend to the other, then irecv from it (same size, not in a batch): each rank gets the right bytes,
    or errors within the group's timeout plus slack; the isend's input keeps its bytes; no stream stays held; no rank
    dies."""
    res = run(faults.halo_body)
    assert_no_rank_died(res)
    values = res.values()
    for rank, v in enumerate(values):
        assert_released(rank, v["released"], values)
        assert v["input_intact"], f"rank {rank}: the isend's input changed: {values}"
        ops = (v["send"], v["recv"])
        if any(e is not None for _, e in ops):
            slowest = max(dt for dt, _ in ops)
            assert slowest < LIMIT_S, f"rank {rank}: {slowest:.1f} s: {values}"
        else:
            assert v["exact"], f"rank {rank}: wrong bytes and no error: {values}"


def test_cuda_p2p_mixed_devices_batch_then_lone_call():
    """On a group of "sdma" for both devices, a batch mixing a CPU isend and a CUDA irecv raises on each rank that
    made it (caught); the lone CUDA isend/irecv that follows moves its bytes, or raises on both within the group's
    timeout plus slack; no stream stays held; no rank dies by a signal."""
    res = run(faults.mixed_devices_batch_body, init="sdma")
    assert_no_rank_died(res)
    values = res.values()
    for rank, v in enumerate(values):
        assert_released(rank, v["released"], values)
        assert v["batch"] is not None, f"rank {rank}: a batch mixing a CPU and a CUDA tensor raised nothing: {values}"
    lone = [v["lone"] for v in values]
    if any(e is not None for _, e in lone):
        for rank, outcome in enumerate(lone):
            _errors_in_time(rank, "the lone call after the mixed batch", outcome, values)
    else:
        assert values[1]["exact"], f"the lone recv after the mixed batch got wrong bytes and no error: {values}"


def test_cuda_all_to_all_single_in_place():
    """all_to_all_single(x, x) (even splits sync and async, uneven splits): per form, every rank holds what its
    peers' inputs held before the call, or every rank raises within the group's timeout plus slack; never wrong bytes
    without an error; no stream stays held."""
    res = run(faults.in_place_all_to_all_body)
    assert_no_rank_died(res)
    values = res.values()
    forms = [name for name, *_ in values[0]]
    for i, name in enumerate(forms):
        per_rank = [v[i] for v in values]
        for rank, (_, err, dt, released, exact) in enumerate(per_rank):
            assert_released(rank, released, per_rank)
            assert err is not None or exact, f"rank {rank}: {name}: wrong bytes and no error: {per_rank}"
        errs = [err for _, err, _, _, _ in per_rank]
        if any(e is not None for e in errs):
            for rank, (_, err, dt, _, _) in enumerate(per_rank):
                _errors_in_time(rank, name, (dt, err), per_rank)
