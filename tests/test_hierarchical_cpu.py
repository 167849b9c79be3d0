"""On CPU: the hierarchical all-gather (docs/multinode.md) on one host split into pseudo-nodes
(TORCH_SDMA_TEST_PSEUDO_NODES): shared memory inside each pseudo-node, gloo on the rails between them. 4 processes as
2 pseudo-nodes and 6 as 3, contiguous (0,1 | 2,3) and strided (0,2 | 1,3) layouts; every form, in place, async,
coalesced, 0 bytes to 3 MiB a rank in 64 KiB of staging (hundreds of chunks a message), bit-exact against gloo on
random data with poisoned outputs; the path and layout in stats, group_path and the log line; subgroups that fall on
one node (flat), one rank per node or nodes of unequal size (the inner backend, with the reason); and a rank killed
in the middle of a collective: an error naming it on every other rank, within the group's timeout."""
import pytest
import torch
import torch.distributed as dist
from test_failures import PG_TIMEOUT_S, SLACK_S, VICTIM, _check_survivors, _run, killed_mid_collective_body

from checks.allgather import AG, allgather_cases
from checks.data import stats_calls
from mp_harness import run_group

CPU = torch.device("cpu")
STAGING = 64 << 10


def _layout_line(nodes_of_rank):
    """What the backend should say about a layout given as one node name per rank: "2 nodes x 2 ranks (rails ...)"."""
    nodes = {}
    for rank, name in enumerate(nodes_of_rank):
        nodes.setdefault(name, []).append(rank)
    members = list(nodes.values())
    per = len(members[0])
    rails = ",".join("[" + ",".join(str(m[i]) for m in members) + "]" for i in range(per))
    return f"{len(members)} nodes x {per} ranks (rails {rails})"


def _node_layout(g):
    import torch_sdma

    return torch_sdma.node_layout(g)


def hierarchical_body(ctx, layout, quick):
    import torch_sdma

    nodes_of_rank = layout.split(",")
    world = dist.group.WORLD
    ref = dist.new_group(backend="gloo")
    ag = AG(world, ref, CPU, "h")

    def path_and_layout():
        ag.into_tensor("warm", (1000,), torch.float32)
        assert torch_sdma.group_path(world, device="cpu") == "dma:hierarchical", torch_sdma.group_path(world, "cpu")
        assert _node_layout(world) == _layout_line(nodes_of_rank), _node_layout(world)
        torch_sdma.reset_stats(world)

    cases = [("path_and_layout", path_and_layout)]
    if quick:
        # Every form once, a message of many chunks in each, in place and async.
        big = 3 * (1 << 20) + 5
        cases += [
            ("zero_bytes", lambda: ag.into_tensor("z", (0,), torch.float32)),
            ("one_byte", lambda: ag.into_tensor("o", (1,), torch.uint8)),
            ("into_tensor_many_chunks", lambda: ag.into_tensor("big", (big,), torch.uint8)),
            ("inplace_async_many_chunks", lambda: ag.into_tensor("bip", (big // 4,), torch.float32, inplace=True,
                                                                 async_op=True)),
            ("list_many_chunks", lambda: ag.as_list("bl", (big // 2,), torch.int16)),
            ("coalesced_many_chunks", lambda: ag.coalesced_cm(
                "bc", [((40001,), torch.float32), ((3,), torch.uint8), ((90001,), torch.bfloat16)])),
            ("coalesced_inplace", lambda: ag.coalesced_cm(
                "bci", [((5000,), torch.float32), ((7,), torch.int64)], inplace=True, async_op=True)),
            ("all_gather_coalesced", lambda: ag.coalesced_legacy("agc", [(5,), (3, 4), (20001,)], torch.float32)),
            ("in_flight", lambda: ag.many_in_flight("fl", n=8, base=30001)),
        ]
    else:
        cases += allgather_cases(world, ref, CPU, "h", staging_bytes=STAGING, big=True, quick=True)

    def stats_hierarchical():
        s = torch_sdma.stats(world)
        calls, _ = stats_calls(s, lambda k: k == "dma:hierarchical")
        assert calls >= len(cases) - 2, f"all-gathers not counted on dma:hierarchical: {s}"
        assert not any(k.startswith("inner:") for k in s), f"some all-gathers went to the inner backend: {s}"

    cases.append(("stats_hierarchical", stats_hierarchical))
    return ctx.run_cases(cases, barrier_tag="world")


@pytest.mark.parametrize("layout,quick,pg_timeout", [("0,0,1,1", False, 30), ("0,1,0,1", False, 30),
                                                     ("0,0,1,1,2,2", True, 60), ("0,1,2,0,1,2", True, 60)],
                         ids=["2-contiguous", "2-strided", "3-contiguous", "3-strided"])
def test_pseudo_nodes_match_gloo(layout, quick, pg_timeout):
    nodes = layout.split(",")
    res = run_group(hierarchical_body, len(nodes), "sdma", kwargs={"layout": layout, "quick": quick},
                    env={"TORCH_SDMA_TEST_PSEUDO_NODES": layout, "TORCH_SDMA_STAGING_BYTES": str(STAGING)},
                    timeout=400, pg_timeout_s=pg_timeout)
    res.check()
    line = f"hierarchical over {_layout_line(nodes)}"
    assert "CPU all-gathers -> shared memory inside each node, gloo between nodes: " + line in res.ranks[0].log_tail, \
        res.ranks[0].log_tail[-3000:]


def fallback_body(ctx):
    """Layout "0,0,0,1": nodes of unequal size; and subgroups of "0,0,1,1" on one node, one rank per node, or nodes
    of unequal size."""
    import torch_sdma

    rank = ctx.rank
    failed = 0

    def check(g, r, tag, key):
        def fn():
            ag = AG(g, r, CPU, tag)
            torch_sdma.reset_stats(g)
            ag.into_tensor("t", (30001,), torch.float32)
            ag.as_list("l", (77,), torch.int64)
            ag.coalesced_cm("c", [((5000,), torch.float32), ((3,), torch.uint8), ((7001,), torch.bfloat16)])
            s = torch_sdma.stats(g)
            assert list(s) == [key] and s[key]["calls"] == 3, f"expected every all-gather on {key!r}: {s}"
            assert torch_sdma.group_path(g, device="cpu") == key, torch_sdma.group_path(g, device="cpu")

        return fn

    subgroups = [([0, 1], "dma"), ([0, 2], "inner:one rank per node"), ([1, 2, 3], "inner:nodes of unequal size"),
                 ([0, 1, 2, 3], "dma:hierarchical")]
    made = [(ranks, dist.new_group(ranks=ranks), dist.new_group(ranks=ranks, backend="gloo"), key)
            for ranks, key in subgroups]
    for ranks, g, r, key in made:
        if rank in ranks:
            tag = "sub" + "_".join(map(str, ranks))
            failed += ctx.run_cases([(tag, check(g, r, tag, key))], barrier_size=len(ranks), barrier_tag=tag)
    ctx.barrier_store("subgroups")
    return failed


def unequal_body(ctx):
    import torch_sdma

    world = dist.group.WORLD
    ref = dist.new_group(backend="gloo")
    ag = AG(world, ref, CPU, "u")

    def unequal():
        ag.into_tensor("t", (30001,), torch.float32)
        ag.into_tensor("i", (4099,), torch.bfloat16, inplace=True)
        ag.coalesced_legacy("agc", [(5,), (3000,)], torch.float32)
        s = torch_sdma.stats(world)
        key = "inner:nodes of unequal size"
        assert list(s) == [key] and s[key]["calls"] == 3, s
        assert "nodes of unequal size ([0,1,2],[3])" in _node_layout(world), _node_layout(world)

    return ctx.run_cases([("unequal_nodes_take_the_inner_backend", unequal)])


def test_subgroups_of_pseudo_nodes_pick_their_path():
    res = run_group(fallback_body, 4, "sdma", env={"TORCH_SDMA_TEST_PSEUDO_NODES": "0,0,1,1"}, timeout=240,
                    pg_timeout_s=30)
    res.check()
    assert all(len(r.cases) >= 1 for r in res.ranks), [r.cases for r in res.ranks]


def test_unequal_pseudo_nodes_fall_back_to_the_inner_backend():
    res = run_group(unequal_body, 4, "sdma", env={"TORCH_SDMA_TEST_PSEUDO_NODES": "0,0,0,1"}, timeout=240,
                    pg_timeout_s=30)
    res.check()
    assert "CPU all-gathers -> the inner backend (nodes of unequal size" in res.ranks[0].log_tail, \
        res.ranks[0].log_tail[-3000:]


@pytest.mark.parametrize("layout", ["0,0,1,1", "0,1,0,1"], ids=["contiguous", "strided"])
def test_rank_killed_mid_collective_is_named(layout):
    # Rank 1 dies inside a loop of all-gathers of many chunks. Its node peer sees it go while waiting on its flags,
    # its rail peer while gathering with it, and the fourth rank waits on one of those two and sees it go too.
    res = _run(killed_mid_collective_body, 4, {"n": 2 << 20, "killer": "self"},
               env={"TORCH_SDMA_TEST_PSEUDO_NODES": layout, "TORCH_SDMA_STAGING_BYTES": "256K"})
    _check_survivors(res, True, 0.25 + PG_TIMEOUT_S + SLACK_S)
    for r in res.ranks:
        if r.rank != VICTIM and r.status == "ok":
            assert r.value["iterations"] >= 1, r.value
            # named as the rank that exited, not merely listed in a rail
            assert f"group rank {VICTIM} (pid" in r.value["error"], r.value["error"]
