"""`python -m torch_sdma.check` on CPU ranks, from a wheel installed in a fresh virtual environment outside the
repository (as a user runs it after pip install), and from the source tree with deprecation warnings as errors.

- From the wheel: `torchrun --nproc_per_node 2 -m torch_sdma.check` exits 0 with its report (PASS, every form and
  every exchange op, point-to-point included, on the DMA path in the groups that ask for it, the exchanges' busbw
  rows, the raw copy-engine schedules n/a for want of GPUs, every line under 200 characters), and torch_sdma comes
  from the venv.
- The console script `torch-sdma-check`, started outside torchrun, launches torchrun itself; with one output byte
  flipped (TORCH_SDMA_CHECK_PLANT_WRONG_BYTE, a test knob) of an all-gather form, of the uneven all-to-all or of the
  batch_isend_irecv ring, it exits 1 and names the call.
- From the source tree under PYTHONWARNINGS=error::FutureWarning: nothing the check calls warns, so every form of
  all_gather_single (out of place, in place, stacked, async in flight, coalesced) runs without torch's deprecation
  of all_gather_into_tensor, bit-exact, on the DMA path.

The venv holds torch and nothing else: links, in a folder its .pth names, to torch and the distributions torch
requires (read from this interpreter's metadata, so no download of gigabytes; CI builds against the torch it has),
and no numpy, pytest or torch_sdma. The wheel is installed with its declared dependencies and no index, so a
dependency it needs but does not declare fails the test, and one it declares but the venv lacks fails the install.
torch_sdma comes only from the wheel (the commands run in a temporary folder with PYTHONPATH unset), whatever an
earlier install left in the checkout.
"""
import importlib.metadata
import os
import re
import subprocess
import sys
import venv

import pytest
import torch

from conftest import pip_env, sdma_wheel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 600
PLANTED_FORM = "all_gather_single in place" if hasattr(torch.distributed, "all_gather_single") \
    else "all_gather_into_tensor in place"


def _env(**extra):
    env = {k: v for k, v in pip_env().items() if not k.startswith("TORCH_SDMA_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **extra)
    return env


def _distribution_name(requirement):
    """'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"' -> ('cuda-toolkit', {'cublas', 'cudart'})."""
    m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
    return m.group(1), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def _link_torch_alone(dest):
    """Links in `dest` to the top-level files of torch and every distribution it requires, transitively (the
    extras it asks of them included, its own extras not): what `pip install torch` installs, from this
    interpreter's site-packages. Returns the distributions' names."""
    todo, seen = [("torch", set())], set()
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement whose marker excludes this platform
        seen.add(key)
        for req in dist.requires or []:
            wanted = re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
            if wanted and not set(wanted) & extras:
                continue
            todo.append(_distribution_name(req))
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".data"):
                continue
            link = os.path.join(dest, top)
            if not os.path.lexists(link):
                os.symlink(dist.locate_file(top), link)
    return seen


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=True).create(root)
    python = os.path.join(root, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=pip_env()).stdout.strip()
    torch_alone = tmp_path_factory.mktemp("torch_alone")
    names = _link_torch_alone(torch_alone)
    assert "torch" in names and "numpy" not in names, names
    with open(os.path.join(site, "zz_torch_alone.pth"), "w") as f:
        f.write(f"{torch_alone}\n")
    # The venv's own setuptools (ensurepip's) would shadow the one torch requires, at an older version.
    p = subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "setuptools"], capture_output=True, text=True,
                       env=pip_env(), cwd=str(root))
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run([python, "-c", "import torch; import numpy"], capture_output=True, text=True,
                       env=pip_env(), cwd=str(root))
    assert "No module named 'numpy'" in p.stderr, p.stdout + p.stderr  # torch imports, numpy does not
    p = subprocess.run([python, "-m", "pip", "install", "--no-index", "-q", sdma_wheel()],
                       capture_output=True, text=True, timeout=300, env=pip_env(), cwd=str(root))
    assert p.returncode == 0, p.stdout + p.stderr
    return str(root)


def _run(cmd, cwd, env, timeout=TIMEOUT_S):
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _without_torchs_numpy_warning(text):
    """torch itself warns at `import torch` where numpy is missing (two lines: the warning, its source line); the
    check's report names it. Every other line is kept."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if "UserWarning: Failed to initialize NumPy" in line:
            continue
        if i and "UserWarning: Failed to initialize NumPy" in lines[i - 1]:
            continue
        out.append(line)
    return "\n".join(out)


def test_check_passes_from_installed_wheel(fresh_venv, tmp_path):
    python = os.path.join(fresh_venv, "bin", "python")
    rc, out, err = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         "-m", "torch_sdma.check", "--sizes", "64K,1M", "--rounds", "1"], tmp_path, _env())
    report = _without_torchs_numpy_warning(out + err)
    assert rc == 0, report[-8000:]
    assert "torch_sdma.check: PASS" in out, report[-8000:]
    assert "numpy: not installed" in out, out
    assert f"from {fresh_venv}" in out, report[-8000:]  # the wheel's copy, not the checkout's
    assert "sdma = torch_sdma:_register" in out
    assert "WRONG" not in out and "FAIL" not in out
    assert "| 1 MiB |" in out  # the busbw table, size by size
    assert "raw copy-engine schedules (ce-limit): n/a, no GPUs (CPU tensors have no copy engines)" in out
    for group in ("defaults", "dma", "direct", "staging"):  # group_path with no device names the CPU's path
        assert re.search(f"^group {group}: all bytes right; torch_sdma.group_path: dma", out, re.M), out
    for group in ("defaults", "dma"):  # the exchange sweep: every op bit-exact, on the DMA path
        assert re.search(f"^group {group}: all bytes right$", out, re.M), out
    for op in ("all_to_all_single uneven", "all_to_all", "broadcast", "gather", "scatter"):
        assert len(re.findall(f"^  {op} +-> dma:direct$", out, re.M)) == 2, (op, out)
    for op in ("batch_isend_irecv ring", "send/recv pipeline"):  # paths merged over the ranks that made the op
        assert len(re.findall(f"^  {op} +-> send dma:direct, recv dma:direct$", out, re.M)) == 2, (op, out)
    for op in ("all_to_all_single", "broadcast", "gather", "scatter", "batch_isend_irecv ring",
               "send/recv pipeline"):  # the exchanges' busbw table
        assert f"| {op} | 512 KiB |" in out, out
    assert re.search(r"^\| send/recv pipeline \| 512 KiB \|.*\| send dma:direct, recv dma:direct \|$", out, re.M), out
    long_lines = [line for line in report.splitlines() if len(line) > 200]
    assert not long_lines, long_lines
    assert "Warning" not in report, report[-8000:]


@pytest.mark.parametrize("planted,named", [(PLANTED_FORM, "rank 1: first wrong byte at 0 (from rank 0)"),
                                           ("all_to_all_single uneven", "rank 1: first wrong byte at 0: 0x"),
                                           ("batch_isend_irecv ring", "rank 1: first wrong byte at 0: 0x")])
def test_planted_wrong_byte_exits_1_and_names_the_call(fresh_venv, tmp_path, planted, named):
    script = os.path.join(fresh_venv, "bin", "torch-sdma-check")
    rc, out, err = _run([script, "--skip-busbw", "--timeout", "120"], tmp_path,
                        _env(TORCH_SDMA_CHECK_PLANT_WRONG_BYTE=planted))
    assert rc == 1, (out + err)[-8000:]
    assert f"FAIL: WRONG BYTES: group defaults, {planted}, float32" in out, (out + err)[-8000:]
    assert named in out
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
