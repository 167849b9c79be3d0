"""GPU (2 GPUs; skipped elsewhere): every collective on CUDA tensors equals the same collective on a
plain NCCL group; the CPU side of "sdma" / "cpu:gloo,cuda:sdma" equals gloo; subgroups, two groups
interleaved, destroy + init again; split_group and DeviceMesh with init_process_group(device_id=...); the
default-backend workaround on CUDA."""
import pytest
import torch
import torch.distributed as dist

from checks.allgather import interleaved_groups_case
from checks.data import NCCL_SHARED_REASON, SHARE_GPU, assert_bytes_equal, rand
from checks.delegation import delegation_cases
from conftest import cuda_count
from mp_harness import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_count() < 2, reason="needs 2 CUDA devices")]

W = 2
CPU = torch.device("cpu")


def _has_cpu_backend(init):
    return init in ("sdma", "cpu:gloo,cuda:sdma")


def cuda_delegation_body(ctx):
    import torch_sdma

    init, rank, dev = ctx.init, ctx.rank, ctx.device
    failed = 0
    world = dist.group.WORLD
    ref = dist.new_group(backend="nccl")
    cases = [("get_backend", lambda: _check_backend(init))]
    cases += delegation_cases(world, ref, dev, "cuda", cpu_ops=False, sdma_stats=torch_sdma.stats)
    if _has_cpu_backend(init):
        cref = dist.new_group(backend="gloo")
        cases += delegation_cases(world, cref, CPU, "cpu", cpu_ops=True,
                                  sdma_stats=torch_sdma.stats if init == "sdma" else None)
    failed += ctx.run_cases(cases, barrier_tag="world")

    # subgroups (created by both ranks in the same order): each rank alone, and both again
    subs = [(r, dist.new_group(ranks=r), dist.new_group(ranks=r, backend="nccl")) for r in ([1], [0], [0, 1])]
    for ranks, sg, sr in subs:
        if rank not in ranks:
            continue
        tag = "sub" + "_".join(map(str, ranks))
        failed += ctx.run_cases(delegation_cases(sg, sr, dev, tag, cpu_ops=False, sdma_stats=torch_sdma.stats),
                                barrier_size=len(ranks), barrier_tag=tag)
    ctx.barrier_store("subs")

    g1, g2 = dist.new_group(), dist.new_group()

    def interleaved():
        xs = [rand(f"il{k}", rank, (4099,), torch.float32, dev, "normal") for k in range(10)]
        exp = []
        for x in xs:
            t = x.clone()
            dist.all_reduce(t, group=ref)
            exp.append(t)
        got = [x.clone() for x in xs]
        works = [dist.all_reduce(t, group=g1 if k % 2 else g2, async_op=True) for k, t in enumerate(got)]
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        for k in range(10):
            assert_bytes_equal(got[k], exp[k], f"interleaved #{k}")

    failed += ctx.run_cases([("two_groups_interleaved", interleaved),
                             interleaved_groups_case(g1, ref, g2, ref, dev, "ilag", n=8)], barrier_tag="il")

    for again in range(2):
        dist.destroy_process_group()
        ctx.init_pg(init)
        ref2 = dist.new_group(backend="nccl")
        keep = ("broadcast[src=0,torch.float32]", "SUM,torch.float32]", "all_gather_into_tensor[torch.float32]",
                "/barrier", "send_recv[async]", "async_handles")
        cases = [c for c in delegation_cases(dist.group.WORLD, ref2, dev, f"reinit{again}", cpu_ops=False)
                 if any(k in c[0] for k in keep) and "reduce_scatter" not in c[0]]
        failed += ctx.run_cases([(f"reinit{again}/get_backend", lambda: _check_backend(init))] + cases,
                                barrier_tag=f"re{again}")
    return failed


def _check_backend(init):
    assert dist.get_backend() == init, (dist.get_backend(), init)


@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "cuda:sdma", "sdma"])
def test_every_collective_matches_nccl(init):
    if SHARE_GPU:  # about the inner NCCL (every collective but the all-gathers), against NCCL
        pytest.skip(NCCL_SHARED_REASON)
    res = run_group(cuda_delegation_body, W, init, env={"TORCH_SDMA_MIN_BYTES": "0"}, cuda=True, timeout=540,
                    pg_timeout_s=60)
    res.check()


def split_and_mesh_body(ctx):
    """Default group bound to the GPU (device_id): split_group and DeviceMesh work and their groups compute
    what NCCL groups compute."""
    from torch.distributed.device_mesh import init_device_mesh

    import torch_sdma  # noqa: F401

    rank, dev = ctx.rank, ctx.device
    ref = dist.new_group(backend="nccl")
    cases = []

    def split_same():
        sg = dist.split_group(split_ranks=[[0, 1]])
        assert sg is not None
        for name, fn in delegation_cases(sg, ref, dev, "split01", cpu_ops=False):
            if any(k in name for k in ("SUM,torch.float32]", "all_gather", "broadcast[src=1,torch.float32]",
                                       "reduce_scatter_tensor", "send_recv[async]")):
                fn()

    def split_single():
        sg = dist.split_group(split_ranks=[[0], [1]])
        assert sg is not None and dist.get_world_size(sg) == 1
        x = rand("ss", rank, (1000,), torch.float32, dev)
        out = torch.empty(1000, device=dev)
        dist.all_gather_into_tensor(out, x, group=sg)
        assert_bytes_equal(out, x, "all_gather on a 1-rank split group")
        t = x.clone()
        dist.all_reduce(t, group=sg)
        assert_bytes_equal(t, x, "all_reduce on a 1-rank split group")

    def mesh_1d():
        m = init_device_mesh("cuda", (W,))
        g = m.get_group()
        for name, fn in delegation_cases(g, ref, dev, "mesh1d", cpu_ops=False):
            if any(k in name for k in ("SUM,torch.float32]", "all_gather_into_tensor", "/barrier")):
                fn()

    def mesh_2d():
        m = init_device_mesh("cuda", (1, W), mesh_dim_names=("dp", "tp"))
        tp = m.get_group("tp")
        dp = m.get_group("dp")
        x = rand("m2", rank, (777,), torch.bfloat16, dev)
        a = torch.empty(W * 777, dtype=torch.bfloat16, device=dev)
        b = torch.empty(W * 777, dtype=torch.bfloat16, device=dev)
        dist.all_gather_into_tensor(a, x, group=ref)
        dist.all_gather_into_tensor(b, x, group=tp)
        assert_bytes_equal(b, a, "all_gather over the tp mesh dimension")
        t = x.float()
        dist.all_reduce(t, group=dp)
        assert_bytes_equal(t, x.float(), "all_reduce over a 1-rank mesh dimension")

    def dtensor_redistribute():
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        m = init_device_mesh("cuda", (W,))
        full = rand("dt", 0, (W * 64, 33), torch.float32, dev)  # same on both ranks
        d = distribute_tensor(full, m, [Shard(0)])
        r = d.redistribute(m, [Replicate()]).to_local()  # an all-gather through functional collectives
        torch.cuda.synchronize()
        assert_bytes_equal(r, full, "DTensor Shard(0) -> Replicate")

    cases += [("split_group_same_members", split_same), ("split_group_singletons", split_single),
              ("device_mesh_1d", mesh_1d), ("device_mesh_2d", mesh_2d),
              ("dtensor_redistribute_allgather", dtensor_redistribute)]
    return ctx.run_cases(cases)


@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "cuda:sdma"])
def test_split_group_and_device_mesh_with_device_id(init):
    # device_id makes torch connect the inner NCCL of the default group at once (eager_connect_single_device),
    # and split_group splits that communicator: nothing of this test runs without a two-rank NCCL.
    if SHARE_GPU:
        pytest.skip(NCCL_SHARED_REASON)
    res = run_group(split_and_mesh_body, W, init, env={"TORCH_SDMA_MIN_BYTES": "0"}, device_id=True, timeout=300,
                    pg_timeout_s=60)
    res.check()


@pytest.mark.parametrize("init", ["cpu:gloo,cuda:sdma", "cuda:sdma"])
def test_default_backend_workaround_cuda(init):
    if SHARE_GPU:  # bound to the GPU (device_id) and all_reduce on CUDA tensors: the inner NCCL
        pytest.skip(NCCL_SHARED_REASON)
    from test_registration import workaround_body

    res = run_group(workaround_body, W, init=None, kwargs={"init": init, "device": "cuda"}, device_id=True,
                    timeout=300, pg_timeout_s=60, env={"TORCH_SDMA_LOG": "0"}, destroy=False)
    res.check()
