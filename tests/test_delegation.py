"""CPU: every collective on an sdma-registered group gives the bytes a plain gloo group gives.

One spawned group per (world size, registration string) runs every case; a failing case is reported by name
with the traceback of each rank where it failed.
"""
import pytest
import torch
import torch.distributed as dist

from checks.allgather import interleaved_groups_case
from checks.data import assert_bytes_equal, group_ranks, rand
from checks.delegation import delegation_cases
from mp_harness import run_group

INITS = ["sdma", "cpu:sdma", "cpu:gloo,cuda:sdma"]
CPU = torch.device("cpu")


def _sdma_on_cpu(init):
    return init in ("sdma", "cpu:sdma")


def _stats_fn(init):
    if not _sdma_on_cpu(init):
        return None
    import torch_sdma

    return torch_sdma.stats


def _subgroup_layouts(W):
    if W == 4:
        return [[0, 2], [1, 3], [1], [0, 1, 3]]
    if W == 2:
        return [[1], [0]]
    return [[0, 2], [1]]


def delegation_body(ctx):
    import torch_sdma  # noqa: F401

    W, rank, init = ctx.world, ctx.rank, ctx.init
    failed = 0

    # --- the default group, every collective
    world = dist.group.WORLD
    ref = dist.new_group(backend="gloo")

    def get_backend():
        assert dist.get_backend() == init, (dist.get_backend(), init)
        assert dist.get_backend(dist.group.WORLD) == init, dist.get_backend(dist.group.WORLD)
        assert dist.is_initialized()

    failed += ctx.run_cases([("get_backend", get_backend)], barrier_tag="gb")
    failed += ctx.run_cases(delegation_cases(world, ref, CPU, "world", sdma_stats=_stats_fn(init)), barrier_tag="w")

    # --- subgroups of non-contiguous ranks (created by every rank, in the same order), run concurrently
    layouts = _subgroup_layouts(W)
    subs = []
    for ranks in layouts:
        sg = dist.new_group(ranks=ranks)
        sr = dist.new_group(ranks=ranks, backend="gloo")
        subs.append((ranks, sg, sr))
    for i, (ranks, sg, sr) in enumerate(subs):
        if rank not in ranks:
            continue
        tag = "sub" + "_".join(map(str, ranks))

        def sub_meta(sg=sg, ranks=ranks):
            assert dist.get_world_size(sg) == len(ranks)
            assert group_ranks(sg) == ranks, group_ranks(sg)
            assert dist.get_rank(sg) == ranks.index(rank)
            assert dist.get_backend(sg) == init, dist.get_backend(sg)

        cases = [(f"{tag}/meta", sub_meta)] + delegation_cases(sg, sr, CPU, tag, sdma_stats=_stats_fn(init))
        failed += ctx.run_cases(cases, barrier_size=len(ranks), barrier_tag=tag)
    ctx.barrier_store("after-subgroups")

    # --- two groups over the same ranks, interleaved async collectives
    g1, g2 = dist.new_group(), dist.new_group()

    def interleaved_delegated():
        xs = [rand(f"il{k}", rank, (777,), torch.float32, kind="normal") for k in range(12)]
        exp = []
        for k, x in enumerate(xs):
            t = x.clone()
            if k % 3 == 2:
                dist.broadcast(t, k % W, group=ref)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.SUM if k % 3 == 0 else dist.ReduceOp.MAX, group=ref)
            exp.append(t)
        got = [x.clone() for x in xs]
        works = []
        for k, t in enumerate(got):
            grp = g1 if k % 2 == 0 else g2
            if k % 3 == 2:
                works.append(dist.broadcast(t, k % W, group=grp, async_op=True))
            else:
                works.append(dist.all_reduce(t, op=dist.ReduceOp.SUM if k % 3 == 0 else dist.ReduceOp.MAX,
                                             group=grp, async_op=True))
        for w in reversed(works):
            w.wait()
        for k in range(len(xs)):
            assert_bytes_equal(got[k], exp[k], f"interleaved #{k}")

    failed += ctx.run_cases(
        [("two_groups_interleaved_delegated", interleaved_delegated),
         interleaved_groups_case(g1, ref, g2, ref, CPU, "ilag", n=8)],
        barrier_tag="il",
    )

    # --- destroy and init again in the same process (twice), with a fresh reference group each time
    for again in range(2):
        dist.destroy_process_group()
        assert not dist.is_initialized()
        ctx.init_pg(init)
        ref2 = dist.new_group(backend="gloo")
        keep = ("broadcast[src=0,torch.float32]", "all_reduce[", "all_gather_list[torch.float32]",
                "all_gather_into_tensor[torch.float32]", "/barrier", "send_recv[async]", "async_handles",
                "all_to_all_single_even", "stats_delegated_counts")
        cases = [c for c in delegation_cases(dist.group.WORLD, ref2, CPU, f"reinit{again}", sdma_stats=_stats_fn(init))
                 if any(k in c[0] for k in keep) and ("all_reduce[" not in c[0] or "SUM,torch.float32]" in c[0])]
        assert len(cases) >= 8, [c[0] for c in cases]
        failed += ctx.run_cases([(f"reinit{again}/get_backend", get_backend)] + cases, barrier_tag=f"re{again}")
    return failed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("init", INITS)
def test_every_collective_matches_gloo(world, init):
    # The ranks end by os._exit once their groups are destroyed: gloo's worker threads may let go of a finished
    # work's tensors while the interpreter finalizes, and taking the GIL then aborts the process (SIGABRT,
    # "terminate called without an active exception"; pytorch/pytorch#190489), which torch 2.13's gloo did here at
    # the end of a passing run, with no torch_sdma call on CPU tensors (cpu:gloo,cuda:sdma) as well.
    res = run_group(delegation_body, world, init, timeout=300, pg_timeout_s=20, hard_exit=True)
    res.check()
    names = res.case_names(0)
    assert len(names) > 50, names
