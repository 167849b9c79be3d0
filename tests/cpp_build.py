"""Builds the C++ test programs of tests/cpp/ against csrc/ with the system compiler (no torch, no GPU)."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def build_cpp_test(tmp_path_factory, name, sources):
    """Compiles tests/cpp/<name>.cpp with `sources` (paths under the repository) and returns the binary."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp(name) / name
    cmd = [cxx, "-O2", "-std=c++17", "-Wall", "-Werror", "-pthread", f"-I{ROOT / 'csrc'}",
           str(ROOT / "tests" / "cpp" / f"{name}.cpp"), *(str(ROOT / s) for s in sources), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return out


def run_model(binary, *args):
    """Runs a model check of tests/cpp/ (model_cases.hpp) with SEED CASES and its flags."""
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, timeout=120)


def caught_kinds(p, cases):
    """The total and the count per kind of a model run that must catch something (model_cases.hpp's report)."""
    assert p.returncode == 1, p.stdout + p.stderr
    m = re.match(rf"caught (\d+) of {cases} cases:((?: [A-Za-z][A-Za-z ']+ \d+;)*)$", p.stdout.strip())
    assert m, p.stdout + p.stderr
    counts = {kind: int(n) for kind, n in re.findall(r" ([A-Za-z][A-Za-z ']+) (\d+);", m.group(2))}
    assert sum(counts.values()) == int(m.group(1)), p.stdout
    return int(m.group(1)), counts
