"""Frameworks on sdma, end to end (GPU only): FSDP2, DeepSpeed ZeRO-3 and megatron-core's distributed optimizer
each train a tiny model for a few steps on 2 GPUs, once with NCCL and once with sdma. The losses must be identical
bit for bit (an all-gather is a copy, the rest runs on the same NCCL underneath), and sdma must have served the
framework's all-gathers on its DMA path rather than handing them to NCCL. By default FSDP2's all_gather_into_tensor
calls take the direct path; ZeRO-3's forms that it does not serve go through staging in the same group. FSDP2 and
ZeRO-3 run once more with the direct path off (TORCH_SDMA_DIRECT=0): everything through staging.

Skipped without 2 GPUs; the DeepSpeed and Megatron cases are skipped where those packages do not import
(examples/install_framework_wheels.sh installs them offline). Each case launches 2 torchruns (a minute or less).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import compare_frameworks  # noqa: E402  (its launcher: free port per run, NVLink multicast kept off)

from checks.data import NCCL_SHARED_REASON, SHARE_GPU  # noqa: E402

# Each case compares with an NCCL run, and the sdma run hands the frameworks' other collectives to NCCL: neither can
# run with two ranks on one GPU (SDMA_TEST_SHARE_GPU=1).
pytestmark = [pytest.mark.skipif(SHARE_GPU, reason=NCCL_SHARED_REASON),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

STEPS = 6
TINY_MODEL = ["--steps", str(STEPS), "--layers", "4", "--dim", "256", "--heads", "4", "--ffn", "768",
              "--vocab", "1024", "--seq", "128", "--batch", "2"]
# What must import for each case, beyond torch_sdma itself.
NEEDS = {"fsdp2": None, "zero3": "deepspeed", "megatron": "megatron.core"}


CASES = [(f, True) for f in NEEDS] + [("fsdp2", False), ("zero3", False)]


@pytest.mark.parametrize("framework,direct", CASES, ids=[f + ("" if d else "-staging") for f, d in CASES])
def test_losses_bit_identical_and_allgathers_on_dma(framework, direct, tmp_path, monkeypatch):
    if NEEDS[framework]:
        pytest.importorskip(NEEDS[framework])
    # The tiny model's all-gathers are far below the GPU default threshold; the DMA path is what is under test.
    monkeypatch.setenv("TORCH_SDMA_MIN_BYTES", "0")
    if direct:
        monkeypatch.delenv("TORCH_SDMA_DIRECT", raising=False)
    else:
        monkeypatch.setenv("TORCH_SDMA_DIRECT", "0")
    script, _ = compare_frameworks.FRAMEWORKS[framework]
    reports = {}
    for backend in ("nccl", "sdma"):
        out = tmp_path / f"{backend}.json"
        proc = compare_frameworks.launch(script, backend, out, nproc=2, script_args=TINY_MODEL, timeout=600)
        assert proc.returncode == 0, f"{framework}/{backend} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        reports[backend] = json.loads(out.read_text())

    nccl, sdma = reports["nccl"]["losses"], reports["sdma"]["losses"]
    assert len(nccl) == len(sdma) == STEPS
    differing = [(i, a, b) for i, (a, b) in enumerate(zip(nccl, sdma)) if a != b]
    assert not differing, f"losses differ at (step, nccl, sdma): {differing}"

    counters = reports["sdma"]["sdma"]
    assert counters["dma_calls"] > 0, f"no all-gather took the DMA path: {counters['stats']}"
    assert counters["dma_share"] > 0.9, f"only {counters['dma_share']:.1%} on the DMA path: {counters['stats']}"
    if direct and framework == "fsdp2":
        assert counters["direct_share"] > 0.9, f"only {counters['direct_share']:.1%} direct: {counters['stats']}"
