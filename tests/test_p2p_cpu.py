"""Point-to-point on CPU tensors ("sdma" groups: a shared-memory transport per pair of ranks, copies with
process_vm_readv/writev), 2 and 3 ranks: send/recv every dtype bit-exact, sync and async; a ring with
batch_isend_irecv over several rounds whose sizes vary (zero included); a two-stage pipeline; a batch with both
directions and several tensors to one peer; zero-size; p2p in flight among all-gathers and all-to-alls on the same
group; stats() and group_path(op=) on "dma:direct"; mistakes (sizes that differ, two sends that meet, a recv whose
send never comes, at the pair's first operation and later) raising on the ranks that made them within the group's
timeout, naming the peer."""
import pytest
import torch
import torch.distributed as dist

from checks import p2p
from mp_harness import run_group

CPU = torch.device("cpu")
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}
MISTAKE_TIMEOUT_S = 10.0
SLACK_S = 20.0


def p2p_body(ctx):
    torch.set_num_threads(1)
    return ctx.run_cases(p2p.all_cases(dist.group.WORLD, CPU, ctx.rank, ctx.world, "cpu"))


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_matches_local_bytes(world):
    run_group(p2p_body, world, "sdma", env=ENV, timeout=300, pg_timeout_s=30).check()


def mistakes_body(ctx):
    torch.set_num_threads(1)
    return p2p.mistake_cases(ctx, CPU, MISTAKE_TIMEOUT_S)


@pytest.mark.parametrize("world", [2, 3])
def test_p2p_mistakes_raise(world):
    res = run_group(mistakes_body, world, "sdma", env=ENV, timeout=4 * (MISTAKE_TIMEOUT_S + SLACK_S) + 60,
                    pg_timeout_s=60, destroy=False, hard_exit=True, grace=4 * (MISTAKE_TIMEOUT_S + SLACK_S))
    assert all(r.status == "ok" and r.exitcode == 0 for r in res.ranks), res.describe()
    values = res.values()
    problems = p2p.mistake_problems(values, MISTAKE_TIMEOUT_S, SLACK_S)
    assert not problems, "\n".join(problems) + "\n" + repr(values)


def routing_body(ctx):
    """TORCH_SDMA_MIN_BYTES=64K: a small send takes the inner backend on both sides, a large one the DMA path."""
    import torch_sdma

    torch.set_num_threads(1)
    g = dist.group.WORLD
    r = ctx.rank
    for n in (256, 128 << 10):
        t = torch.full((n,), r, dtype=torch.uint8)
        if r == 0:
            dist.send(t, 1)
        elif r == 1:
            dist.recv(t, 0)
            assert bool((t == 0).all()), n
    if r in (0, 1):
        stats = torch_sdma.stats(g)
        op = "send" if r == 0 else "recv"
        assert int(stats[f"delegated:{op}"]["calls"]) == 1, sorted(stats)
        assert int(stats[f"{op}:dma:direct"]["calls"]) == 1, sorted(stats)
        assert torch_sdma.group_path(g, device="cpu", op=op) == "dma:direct"


def test_p2p_min_bytes_routes_alike():
    run_group(routing_body, 2, "sdma", env=dict(ENV, TORCH_SDMA_MIN_BYTES="64K"), timeout=120,
              pg_timeout_s=20).check()
