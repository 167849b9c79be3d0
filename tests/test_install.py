"""The package installs from a wheel and torch finds the backend by its entry point, with no import.

What this checks:
- `pip wheel --no-build-isolation --no-deps .` builds a wheel from this checkout (with the interpreter running the
  tests, so against its torch), and the wheel holds the extension, every module of the package, `Requires-Dist:
  torch` and the `torch.distributed.backends` entry point `sdma = torch_sdma:_register`.
- Installed with `pip install --no-deps --target DIR` and run with PYTHONPATH=DIR only (not the checkout), so that
  importlib.metadata sees the wheel's dist-info and `torch_sdma` can only come from DIR: for each of "sdma",
  "cpu:sdma" and "cpu:gloo,cuda:sdma", two fresh processes (rendezvous from the environment, as torchrun sets it)
  that never import torch_sdma call init_process_group(string) (tests/entry_point_child.py). Each asserts that
  torch_sdma was not loaded before and is loaded after, from DIR, registered as `import torch_sdma` registers it
  (extended API, devices cpu and cuda, the nccl split-source patch, CUDA_DEVICE_MAX_CONNECTIONS=32 since CUDA had
  not started), that importing it afterwards changes nothing, and then runs 32 all-gathers (into a tensor and into
  a list; 4 dtypes; 1 to 1M elements) on random data with poisoned outputs, byte for byte against gloo.
  With "sdma" and "cpu:sdma" those all-gathers take sdma's shared-memory path (its stats count every one).
  With "cpu:gloo,cuda:sdma" they go to gloo: on this CPU-only machine it shows only that the entry point ran, that
  torch made the sdma backend for the cuda slot, and that the group initialises, all-gathers and passes a barrier.

What it does not check: a copy-engine all-gather of CUDA tensors after loading by entry point (GPU machine:
examples/torchrun_backend_string.py); a dependency the wheel fails to declare (it reuses this interpreter's
packages: test_check_cpu.py installs the wheel beside torch alone); the hardware-queue count when CUDA starts
before init_process_group; torch 2.11-2.13, which have no such entry point (skipped there). `pip install .` runs in
CI (`make install`, then `make test` and `make bench` in the same checkout); `pip install -e .` is checked by hand.
"""
import datetime
import glob
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from conftest import pip_env, sdma_wheel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(REPO, "tests", "entry_point_child.py")
TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# A peer that never comes fails its group within the children's 60 s group timeout; this bounds everything else.
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def wheel():
    return sdma_wheel()  # built once for every test that installs it


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), wheel],
                       capture_output=True, text=True, timeout=300, env=pip_env())
    assert p.returncode == 0, p.stdout + p.stderr
    return str(target)


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    modules = sorted(os.path.basename(f) for f in glob.glob(os.path.join(REPO, "torch_sdma", "*.py")))
    missing = [m for m in modules if f"torch_sdma/{m}" not in names]
    assert not missing, missing
    assert any(n.startswith("torch_sdma/_C.") and n.endswith(".so") for n in names), names
    assert "[torch.distributed.backends]\nsdma = torch_sdma:_register" in entry_points, entry_points
    assert "Requires-Dist: torch" in metadata.splitlines(), metadata


def _run_pair(site, backend, tmp_path):
    """Two ranks of entry_point_child.py, the store hosted here as torchrun's agent hosts it (no port race)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=RUN_TIMEOUT_S))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS") and not k.startswith("TORCH_SDMA_")}
    env.update(PYTHONPATH=site, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True", CUDA_VISIBLE_DEVICES="")
    procs, logs = [], []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, CHILD, backend, os.path.join(site, "torch_sdma")],
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=str(tmp_path),
                                      stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    del store
    return codes, outputs


@pytest.mark.skipif(TORCH < (2, 14), reason="torch loads c10d backends by entry point from 2.14 on")
@pytest.mark.parametrize("backend", ["sdma", "cpu:sdma", "cpu:gloo,cuda:sdma"])
def test_entry_point_without_import(site, backend, tmp_path):
    codes, outputs = _run_pair(site, backend, tmp_path)
    report = "\n".join(f"--- rank {r} (exit {c}):\n{o[-6000:]}" for r, (c, o) in enumerate(zip(codes, outputs)))
    assert codes == [0, 0], report
    for out in outputs:
        assert any(line.startswith("RESULT ") for line in out.splitlines()), report
