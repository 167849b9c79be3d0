"""The randomized exchange soak (soak_exchange.py) on CPU ranks, briefly: a few hundred calls of every form among
all-gathers, two groups (with three ranks, the second a subset), random roots and splits with zeros, async depth; every
call bit-exact, every exchange on the DMA path, no descriptor and nothing in /dev/shm left behind."""
import pytest
import torch
from soak_exchange import FORMS, SoakOptions, run_soak, summary_line
from test_user_mistakes_cpu import shm_entries, shm_entries_left

from checks.exchange import OPS, cross_process_reads
from mp_harness import run_group

SEED = 20261125
ENV = {"TORCH_SDMA_MIN_BYTES": "0", "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_DELEGATE": None}


def soak_body(ctx, opts):
    torch.set_num_threads(1)  # as torchrun does: the ranks share two cores with the groups' workers
    return run_soak(opts, torch.device("cpu"))


@pytest.mark.parametrize("world,calls", [(2, 600), (3, 300)])
def test_exchange_soak_cpu(world, calls):
    before = shm_entries()
    opts = SoakOptions(seed=SEED + world, calls=calls, max_bytes=128 << 10, pg_timeout_s=30)
    res = run_group(soak_body, world, "sdma", env=ENV, kwargs={"opts": opts}, timeout=180, pg_timeout_s=30).check()
    s = res.values()[0]
    print(summary_line(s))
    assert s["calls"] == calls, s
    assert set(s["forms"]) == set(FORMS), s  # every form ran
    paths = s["world_paths"]
    for op in OPS:
        on_op = [k for k in paths if k.startswith(op + ":")]
        want = f"{op}:dma:direct" if cross_process_reads() else f"{op}:inner:"
        assert on_op and all(k.startswith(want) for k in on_op), f"{op}: paths {on_op}, expected {want!r}: {paths}"
    left = shm_entries_left(before)
    assert not left, f"left in /dev/shm: {sorted(left)}"
