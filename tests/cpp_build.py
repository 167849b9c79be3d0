"""Builds the C++ test programs of tests/cpp/ against csrc/ with the system compiler (no torch, no GPU)."""
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
