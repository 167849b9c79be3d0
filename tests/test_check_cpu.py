"""`python -m torch_sdma.check` on CPU ranks, from a wheel installed in a fresh virtual environment outside the
repository (as a user runs it after pip install), and from the source tree with deprecation warnings as errors.

- From the wheel: `torchrun --nproc_per_node 2 -m torch_sdma.check` exits 0 with its report (PASS, every form on the
  DMA path in the groups that ask for it, every line under 200 characters), and torch_sdma comes from the venv.
- The console script `torch-sdma-check`, started outside torchrun, launches torchrun itself; with one output byte
  flipped (TORCH_SDMA_CHECK_PLANT_WRONG_BYTE, a test knob) it exits 1 and names the call.
- From the source tree under PYTHONWARNINGS=error::FutureWarning: nothing the check calls warns, so every form of
  all_gather_single (out of place, in place, stacked, async in flight, coalesced) runs without torch's deprecation
  of all_gather_into_tensor, bit-exact, on the DMA path.

The venv gets torch by a .pth line to this interpreter's site-packages, not by a download: torch is gigabytes and
the CI machine builds against the torch it already has. torch_sdma itself comes only from the wheel (the checkout
is not on sys.path: the commands run in a temporary folder with PYTHONPATH unset).
"""
import os
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

from conftest import sdma_wheel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600
PLANTED_FORM = "all_gather_single in place" if hasattr(torch.distributed, "all_gather_single") \
    else "all_gather_into_tensor in place"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TORCH_SDMA_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    python = os.path.join(root, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # torch (and its dependencies) from this interpreter, after the venv's own packages.
    with open(os.path.join(site, "zz_torch_from_host.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    p = subprocess.run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", sdma_wheel()],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return str(root)


def _run(cmd, cwd, env, timeout=TIMEOUT_S):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def test_check_passes_from_installed_wheel(fresh_venv, tmp_path):
    python = os.path.join(fresh_venv, "bin", "python")
    rc, out, err = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "-m", "torch_sdma.check", "--sizes", "64K,1M", "--rounds", "1"], tmp_path, _env())
    report = out + err
    assert rc == 0, report[-8000:]
    assert "torch_sdma.check: PASS" in out, report[-8000:]
    assert f"from {fresh_venv}" in out, report[-8000:]  # the wheel's copy, not the checkout's
    assert "sdma = torch_sdma:_register" in out
    assert "WRONG" not in out and "FAIL" not in out
    assert "| 1 MiB |" in out  # the busbw table, size by size
    long_lines = [line for line in report.splitlines() if len(line) > 200]
    assert not long_lines, long_lines
    assert "Warning" not in report, report[-8000:]


def test_planted_wrong_byte_exits_1_and_names_the_call(fresh_venv, tmp_path):
    script = os.path.join(fresh_venv, "bin", "torch-sdma-check")
    rc, out, err = _run([script, "--skip-busbw", "--timeout", "120"], tmp_path,
                        _env(TORCH_SDMA_CHECK_PLANT_WRONG_BYTE=PLANTED_FORM))
    assert rc == 1, (out + err)[-8000:]
    assert f"FAIL: WRONG BYTES: group defaults, {PLANTED_FORM}, float32" in out, (out + err)[-8000:]
    assert "rank 1: first wrong byte at 0 (from rank 0)" in out
    assert "torch_sdma.check: FAIL" in out


@pytest.mark.skipif(not hasattr(torch.distributed, "all_gather_single"), reason="all_gather_single: torch >= 2.14")
def test_all_gather_single_every_form_without_deprecation_warnings(tmp_path):
    rc, out, err = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "-m", "torch_sdma.check", "--skip-busbw"], tmp_path,
                        _env(PYTHONPATH=REPO, PYTHONWARNINGS="error::FutureWarning,error::DeprecationWarning"))
    assert rc == 0, (out + err)[-8000:]
    for form in ("all_gather_single", "all_gather_single in place", "all_gather_single stacked",
                 "all_gather_single x4 async", "all_gather_single coalesced"):
        lines = [line for line in out.splitlines() if line.split(" -> ")[0].strip() == form]
        assert len(lines) == 4, (form, lines)  # one per group
        assert all("-> dma" in line for line in lines[1:]), lines  # the groups with TORCH_SDMA_MIN_BYTES=0
    assert "all_gather_into_tensor" not in out + err
