"""The arrival mailbox of the direct all-gather design (csrc/arrival_mailbox.hpp, docs/design-direct-push.md), in
real processes: for every pair of ranks and every collective, never two early arrivers, and every post seen is the
one its owner made for that serial; ring depths from 1 (a rank waits for its peers at every collective) to 8."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stress_binary(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("mailbox") / "arrival_mailbox_stress"
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", f"-I{ROOT / 'csrc'}",
                    str(ROOT / "tests/cpp/arrival_mailbox_stress.cpp"), "-o", str(out)], check=True)
    return out


@pytest.mark.parametrize("world,collectives,depth", [(2, 20000, 4), (2, 5000, 1), (3, 10000, 2), (4, 5000, 8)])
def test_never_two_early_arrivers(stress_binary, world, collectives, depth):
    p = subprocess.run([str(stress_binary), str(world), str(collectives), str(depth), str(world * 7 + depth)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip().endswith("ok"), p.stdout
