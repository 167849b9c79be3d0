"""Every build from one checkout compiles each object once: `pip install .`, `make test`, `make bench` and the
tests' wheels share build/, with the ninja that compiled it first (another ninja's build log makes ninja start
over and recompile everything). And the docs count the files setup.py compiles."""
import ast
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_ninja(folder):
    os.makedirs(folder)
    path = os.path.join(folder, "ninja")
    with open(path, "w") as f:
        f.write("#!/bin/sh\necho 1.11.1\n")
    os.chmod(path, 0o755)
    return path


def _setup_in(checkout, first_on_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = os.path.dirname(first_on_path) + os.pathsep + env.get("PATH", "")
    p = subprocess.run([sys.executable, "setup.py", "--name"], cwd=checkout, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(os.path.join(checkout, "build", "ninja-path")) as f:
        recorded = f.read().strip()
    link = os.path.join(checkout, "build", "ninja-bin", "ninja")
    assert os.readlink(link) == recorded, (os.readlink(link), recorded)
    return recorded


def test_the_first_ninja_found_builds_every_later_build(tmp_path):
    """The system's ninja built the install; a venv's ninja installed later and first on PATH is not used while the
    first one is there. A ninja that is gone is replaced by the one PATH finds."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), checkout / name)
    shutil.copytree(os.path.join(REPO, "torch_sdma"), checkout / "torch_sdma",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    system = _fake_ninja(str(tmp_path / "system"))
    venv = _fake_ninja(str(tmp_path / "venv"))
    assert _setup_in(checkout, system) == system
    assert _setup_in(checkout, venv) == system
    os.remove(system)
    assert _setup_in(checkout, venv) == venv


def _source_counts():
    """(with CUDA, without): setup.py's lists, the vendor layer counted once."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in (
                "SOURCES", "GPU_SOURCES", "CPU_ONLY_SOURCES"):
            lists[node.targets[0].id] = sum(len(v) for v in ast.literal_eval(node.value).values())
    return lists["SOURCES"] + lists["GPU_SOURCES"] + 1, lists["SOURCES"] + lists["CPU_ONLY_SOURCES"]


def test_the_docs_count_the_compiled_files():
    cuda, cpu = _source_counts()
    for doc, words in (("docs/install.md", f"{cuda} C++ files with the CUDA code, {cpu} without"),
                       ("README.md", f"({cuda} with the CUDA code, {cpu} without)")):
        text = " ".join(open(os.path.join(REPO, doc)).read().split())
        assert words in text, f"{doc} does not say {words!r}"
