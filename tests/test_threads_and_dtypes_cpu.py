"""Hardening on CPU tensors, what the shared-memory path shares with the GPU one:
- every torch dtype below and above TORCH_SDMA_MIN_BYTES, in every all-gather form, bit-exact against gloo (gloo
  refuses int16, uint16-64 and float8, which the inner path then gathers as bytes);
- a background thread of ours that fails (TORCH_SDMA_TEST_FAULT=worker makes the worker throw) never takes the
  process down: the all-gathers it concerns fail with its message, later ones are refused saying why, and every
  other collective of the group still runs."""
import os

import pytest
import torch
import torch.distributed as dist

from checks.allgather import dtype_sweep_cases
from checks.faults import assert_refused_after
from mp_harness import run_group

CPU = torch.device("cpu")
MIN_BYTES = 64 << 10


def dtype_body(ctx):
    ref = dist.new_group(backend="gloo")
    os.environ["TORCH_SDMA_MIN_BYTES"] = str(MIN_BYTES)
    try:
        g = dist.new_group()
    finally:
        os.environ.pop("TORCH_SDMA_MIN_BYTES")
    return ctx.run_cases(dtype_sweep_cases(g, ref, CPU, "sweep", MIN_BYTES))


@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_below_and_above_the_threshold(world):
    run_group(dtype_body, world, "sdma", timeout=240, pg_timeout_s=30).check()


def worker_fault_body(ctx):
    import torch_sdma

    W = ctx.world
    g = dist.group.WORLD
    x = torch.arange(1000, dtype=torch.float32) + ctx.rank
    out = torch.empty(W * 1000)
    w = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001
        first = str(e)
    else:
        raise AssertionError("the all-gather whose worker failed completed")
    assert "worker thread failed" in first and "TORCH_SDMA_TEST_FAULT=worker" in first, first
    assert_refused_after("worker thread failed", out, x, g)
    # The process and the group's other collectives live on.
    y = torch.ones(10)
    dist.all_reduce(y, group=g)
    assert torch.equal(y, torch.full((10,), float(W))), y
    assert torch_sdma.stats(g)["dma"]["calls"] == 1, torch_sdma.stats(g)  # the refused call ran nowhere
    return 0


def test_worker_thread_fault_fails_its_collectives_not_the_process():
    res = run_group(worker_fault_body, 2, "sdma", timeout=120, pg_timeout_s=20,
                    env={"TORCH_SDMA_TEST_FAULT": "worker"})
    res.check()
