"""The all-gather protocol over shared memory (CPU tensors on "sdma" / "cpu:sdma" groups), bit-exact
against gloo on random data with poisoned outputs: 0 elements, odd sizes, every dtype, in-place, list and
coalesced forms, subgroups of non-contiguous ranks, two groups interleaved, 100 in flight, larger than the
staging memory, stats on "dma", and bad input (NCCL's errors, nothing enqueued)."""
import pytest
import torch
import torch.distributed as dist

from checks.allgather import allgather_cases, interleaved_groups_case, stats_cases
from checks.bad_input import bad_input_cases
from mp_harness import run_group

CPU = torch.device("cpu")


def _layouts(W):
    if W == 4:
        return [[0, 2], [1, 3], [0, 1, 3], [2]]
    if W == 3:
        return [[0, 2], [1]]
    return [[1], [0]]


def protocol_body(ctx, staging=None, subgroups=True, quick=False):
    W, rank = ctx.world, ctx.rank
    failed = 0
    world = dist.group.WORLD
    ref = dist.new_group(backend="gloo")

    cases = allgather_cases(world, ref, CPU, "world", staging_bytes=staging, big=staging is not None, quick=quick)
    if not quick:
        cases += stats_cases(world, ref, CPU, "world", "cpu")
        cases += bad_input_cases(world, CPU, "world")
    failed += ctx.run_cases(cases, barrier_tag="world")

    if subgroups:
        subs = []
        for ranks in _layouts(W):
            subs.append((ranks, dist.new_group(ranks=ranks), dist.new_group(ranks=ranks, backend="gloo")))
        for ranks, sg, sr in subs:
            if rank not in ranks:
                continue
            tag = "sub" + "_".join(map(str, ranks))
            c = allgather_cases(sg, sr, CPU, tag, staging_bytes=staging, big=False, quick=True)
            c += stats_cases(sg, sr, CPU, tag, "cpu")
            failed += ctx.run_cases(c, barrier_size=len(ranks), barrier_tag=tag)
        ctx.barrier_store("after-subgroups")

        # two groups interleaved: same members, then a non-contiguous subset beside the whole world
        g1, g2 = dist.new_group(), dist.new_group()
        part = _layouts(W)[0]
        g3 = dist.new_group(ranks=part)
        r3 = dist.new_group(ranks=part, backend="gloo")
        in3 = rank in part
        failed += ctx.run_cases(
            [
                interleaved_groups_case(g1, ref, g2, ref, CPU, "il_same_members", n=12),
                interleaved_groups_case(world, ref, g3 if in3 else None, r3 if in3 else None, CPU, "il_world_and_sub",
                                        n=12),
            ],
            barrier_tag="il",
        )
    return failed


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("init", ["sdma", "cpu:sdma"])
def test_allgather_protocol_matches_gloo(world, init):
    quick = init == "cpu:sdma"  # same transport: the second registration string runs the shorter list
    res = run_group(protocol_body, world, init, kwargs={"quick": quick, "subgroups": not quick},
                    timeout=300, pg_timeout_s=20)
    res.check()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_allgather_bigger_than_staging(world):
    """TORCH_SDMA_STAGING_BYTES=64K and messages of several MiB: chunked and pipelined, still bit-exact."""
    res = run_group(protocol_body, world, "sdma", kwargs={"staging": 65536, "subgroups": False, "quick": True},
                    env={"TORCH_SDMA_STAGING_BYTES": "64K"}, timeout=300, pg_timeout_s=20)
    res.check()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_allgather_direct_matches_gloo(world):
    """TORCH_SDMA_DIRECT=1: all_gather_into_tensor moves straight between the members' memory (the later arriver
    of each pair copies both ways, docs/design.md); the other forms keep the staging path. Same cases."""
    res = run_group(protocol_body, world, "sdma", kwargs={"quick": False, "subgroups": True},
                    env={"TORCH_SDMA_DIRECT": "1"}, timeout=300, pg_timeout_s=20)
    res.check()
