"""The package imports without a GPU, registers "sdma", and the default-backend workaround holds:
with "cpu:gloo,cuda:sdma" (and the other strings) nothing the user does (init, get_backend, new_group, DeviceMesh,
destroy_process_group, init again) raises or warns, on torch 2.13 and 2.14 alike.
"""
import logging
import os
import re
import subprocess
import sys
import tempfile
import warnings

import pytest

from mp_harness import run_group

INITS = ["sdma", "cpu:sdma", "cpu:gloo,cuda:sdma"]


def test_import_without_gpu():
    code = (
        "import torch, torch.distributed as dist\n"
        "import torch_sdma\n"
        "assert torch.cuda.device_count() == 0\n"
        "assert dist.Backend('sdma') == 'sdma', dist.Backend('sdma')\n"
        "assert 'SDMA' in dist.Backend._plugins or 'sdma' in dist.Backend._plugins\n"
        "for f in ('stats', 'reset_stats', 'group_path'):\n"
        "    assert callable(getattr(torch_sdma, f)), f\n"
        "import importlib; importlib.reload(torch_sdma)  # importing twice must not re-register or fail\n"
        "print('IMPORT-OK')\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    assert p.returncode == 0 and "IMPORT-OK" in p.stdout, p.stdout + p.stderr
    bad = [line for line in p.stderr.splitlines() if re.search(r"warn|error|traceback", line, re.I)]
    assert not bad, p.stderr


# ------------------------------------------------------------------------------------------- capture
class Capture:
    """Everything a block emits: Python warnings, log records >= WARNING, and bytes written to fd 2 (C++)."""

    def __init__(self, log_handler=True):
        self.log_handler = log_handler

    def __enter__(self):
        self._wcm = warnings.catch_warnings(record=True)
        self.warnings = self._wcm.__enter__()
        warnings.simplefilter("always")
        self.records = []
        cap = self

        class H(logging.Handler):
            def emit(self, record):
                cap.records.append(record)

        self._h = H(level=logging.WARNING)
        if self.log_handler:
            logging.getLogger().addHandler(self._h)
        self._tmp = tempfile.TemporaryFile()
        sys.stderr.flush()
        self._saved = os.dup(2)
        os.dup2(self._tmp.fileno(), 2)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        self.stderr = self._tmp.read().decode(errors="replace")
        self._tmp.close()
        if self.log_handler:
            logging.getLogger().removeHandler(self._h)
        self._wcm.__exit__(*exc)
        return False

    def messages(self):
        out = [f"warning {w.category.__name__}: {w.message}" for w in self.warnings]
        out += [f"log {r.levelname} {r.name}: {r.getMessage()}" for r in self.records]
        out += [f"stderr: {line}" for line in self.stderr.splitlines()
                if re.search(r"warn|error|traceback|^\[[WE]", line, re.I)]
        return out


def _normalize(msg):
    return re.sub(r"0x[0-9a-f]+|\d+", "N", msg)


def workaround_body(ctx, init, device="cpu"):
    """device: where the tensors and the DeviceMesh live ("cpu", or "cuda" on the GPU machine)."""
    import torch
    import torch.distributed as dist

    W, rank = ctx.world, ctx.rank
    dev = ctx.device if device == "cuda" else torch.device("cpu")
    report = {}

    def actions(backend):
        acts = []

        def do_import():
            if "sdma" in backend:
                import torch_sdma  # noqa: F401

        acts.append(("import", do_import))
        acts.append(("init_process_group", lambda: ctx.init_pg(backend)))

        def get_backend():
            assert dist.get_backend() == backend, (dist.get_backend(), backend)
            assert dist.get_backend(dist.group.WORLD) == backend

        acts.append(("get_backend", get_backend))

        def has_hooks():  # what destroy_process_group asks of the default backend
            pg = dist.group.WORLD
            if hasattr(pg, "_has_hooks"):
                pg._has_hooks()

        acts.append(("default_backend_has_hooks", has_hooks))
        state = {}

        def new_groups():
            state["g_all"] = dist.new_group()
            state["g_0"] = dist.new_group(ranks=[0])
            assert dist.get_backend(state["g_all"]) == backend, dist.get_backend(state["g_all"])
            t = torch.full((4,), float(rank + 1), device=dev)
            dist.all_reduce(t, group=state["g_all"])
            assert t.tolist() == [W * (W + 1) / 2] * 4, t
            if rank == 0:
                dist.all_reduce(t, group=state["g_0"])

        acts.append(("new_group", new_groups))

        def mesh_1d():
            from torch.distributed.device_mesh import init_device_mesh

            m = init_device_mesh(device, (W,))
            t = torch.ones(3, device=dev)
            dist.all_reduce(t, group=m.get_group())
            assert t.tolist() == [float(W)] * 3

        acts.append(("device_mesh_1d", mesh_1d))
        if W == 4:

            def mesh_2d():
                from torch.distributed.device_mesh import init_device_mesh

                m = init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))
                for dim in ("dp", "tp"):
                    t = torch.ones(2, device=dev)
                    dist.all_reduce(t, group=m.get_group(dim))
                    assert t.tolist() == [2.0, 2.0], (dim, t)

            acts.append(("device_mesh_2d", mesh_2d))

        def destroy_sub():
            dist.destroy_process_group(state["g_all"])

        acts.append(("destroy_subgroup", destroy_sub))

        def destroy():
            dist.destroy_process_group()
            assert not dist.is_initialized()

        acts.append(("destroy_process_group", destroy))
        acts.append(("init_again", lambda: ctx.init_pg(backend)))
        acts.append(("get_backend_again", get_backend))
        acts.append(("destroy_again", destroy))
        return acts

    # the same sequence on plain gloo first: what torch itself emits there is not ours
    baseline = {}
    for name, fn in actions("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"):
        with Capture() as cap:
            fn()
        baseline[name] = {_normalize(m) for m in cap.messages()}
        ctx.barrier_store(f"gloo/{name}")

    baseline_all = set().union(*baseline.values())
    cases = []
    for name, fn in actions(init):

        def case(name=name, fn=fn):
            with Capture() as cap:
                fn()
            ours = [m for m in cap.messages() if _normalize(m) not in baseline_all]
            report[name] = cap.messages()
            assert not ours, f"{name} emitted: {ours}"

        cases.append((f"{init}/{name}", case))
    ctx.run_cases(cases)
    return {"baseline": {k: sorted(v) for k, v in baseline.items()}, "sdma": report}


@pytest.mark.parametrize(
    "init,world", [("cpu:gloo,cuda:sdma", 2), ("cpu:gloo,cuda:sdma", 4), ("sdma", 2), ("cpu:sdma", 2)]
)
def test_default_backend_workaround_no_error_no_warning(init, world):
    res = run_group(workaround_body, world, init=None, kwargs={"init": init}, timeout=180, pg_timeout_s=20,
                    env={"TORCH_SDMA_LOG": "0"}, destroy=False)
    res.check()


def test_log_line_at_group_creation():
    """One log line at group creation says which path the group takes, unless TORCH_SDMA_LOG=0."""
    res = run_group(_log_body, 2, init=None, timeout=120, pg_timeout_s=30, env={"TORCH_SDMA_LOG": None})
    res.check()
    r0, r1 = res.values()
    assert r0["on"] and any("sdma" in line.lower() for line in r0["on"]), r0
    assert len(r0["on"]) == 1, f"expected exactly one line at group creation, got {r0['on']}"
    assert not r0["off"] and not r1["off"], (r0["off"], r1["off"])


def _log_body(ctx):
    import torch.distributed as dist

    out = {}
    for key, val in (("on", None), ("off", "0")):
        if val is None:
            os.environ.pop("TORCH_SDMA_LOG", None)
        else:
            os.environ["TORCH_SDMA_LOG"] = val
        with Capture(log_handler=False) as cap:  # no logging handler: the line goes to stderr
            ctx.init_pg("cpu:sdma")
        out[key] = [ln for ln in cap.stderr.splitlines() if "sdma" in ln.lower()]
        dist.destroy_process_group()
    return out


def test_backend_options_are_the_inner_backends():
    """torch <= 2.13's split_group (and DeviceMesh through it) deep-copies `parent_backend.options`: the sdma
    backend answers with its inner backend's options (NCCL's on a GPU, which copy; gloo's here), carrying the
    group's timeout and name."""
    res = run_group(_options_body, 2, init="sdma", timeout=120, pg_timeout_s=37, env={"TORCH_SDMA_LOG": "0"})
    res.check()
    for v in res.values():
        assert v["type"].endswith("Options"), v
        assert v["timeout_s"] == 37.0, v


def _options_body(ctx):
    import torch
    import torch.distributed as dist

    b = dist.group.WORLD._get_backend(torch.device("cpu"))
    o = b.options
    return {"type": type(o).__name__, "timeout_s": o._timeout.total_seconds(), "group": o.group_name}


# ------------------------------------------------------------------------------------------- init again
# Every string that runs on CPU ranks, with the backend each device's collectives go to.
SERVES = {
    "sdma": {"cpu": "sdma", "cuda": "sdma"},
    "cpu:sdma": {"cpu": "sdma", "cuda": None},
    "cpu:gloo,cuda:sdma": {"cpu": "gloo", "cuda": "sdma"},
    "gloo": {"cpu": "gloo", "cuda": "gloo"},
}


def _init_pairs_body(ctx):
    import datetime

    from init_again_child import init_each

    def make():  # a store of its own per group, as a script that rendezvouses afresh each time has
        return {"store": ctx.fresh_store(), "rank": ctx.rank, "world_size": ctx.world,
                "timeout": datetime.timedelta(seconds=ctx.pg_timeout_s)}

    return init_each([s for first in SERVES for second in SERVES for s in (first, second)], make=make)


def _check_inits(results, count):
    assert len(results) == count, results
    for r in results:
        assert r["served"] == SERVES[r["backend"]] and r["gathered"] == "right", r


def test_init_again_serves_the_new_strings_devices():
    """After destroy_process_group, init_process_group with any string serves exactly the devices it names: every
    ordered pair of strings, in one pair of processes (whatever a group leaves in the process is there for the
    next)."""
    res = run_group(_init_pairs_body, 2, init=None, timeout=300, pg_timeout_s=30, env={"TORCH_SDMA_LOG": "0"})
    res.check()
    for results in res.values():
        _check_inits(results, 2 * len(SERVES) ** 2)


# Under torchrun, through the agent's store that every init shares: each pair of sdma strings in turn. torch's own
# gloo comes once ("cpu:gloo,cuda:sdma"): a gloo that torch makes again under the same name in a store that kept the
# first one's addresses may connect to them (torch's behaviour, not the backend's).
TORCHRUN_SEQUENCE = ["sdma", "cpu:gloo,cuda:sdma", "sdma", "sdma", "cpu:sdma", "cpu:sdma", "sdma"]


def test_init_again_under_torchrun():
    import json

    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init_again_child.py")
    env = dict(os.environ, TORCH_SDMA_LOG="0", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", child,
                        ";".join(TORCHRUN_SEQUENCE)], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tempfile.gettempdir())
    # Each rank's report after its marker, wherever the ranks' output met on one line.
    lines = [json.loads(part) for line in p.stdout.splitlines() for part in line.split("INIT-AGAIN ")[1:]]
    assert p.returncode == 0 and len(lines) == 2, p.stdout[-4000:] + p.stderr[-4000:]
    for line in lines:
        _check_inits(line["results"], len(TORCHRUN_SEQUENCE))


def test_first_served_device_ignores_an_earlier_groups_probe():
    """The creator learns the device it serves from the prefix torch gives its store; a probe left by an earlier
    group of the same name under the other device's prefix must not count."""
    import torch.distributed as dist

    from torch_sdma._registration import _first_served_device

    store = dist.HashStore()
    group_store = dist.PrefixStore("0/", store)
    assert _first_served_device(dist.PrefixStore("cuda/", group_store)) == "cuda"
    assert _first_served_device(dist.PrefixStore("cpu/", group_store)) == "cpu"
    assert _first_served_device(dist.PrefixStore("cuda/", group_store)) == "cuda"


# ------------------------------------------------------------------------------------------- group_path
def _group_path_body(ctx):
    import torch_sdma

    return {"any": torch_sdma.group_path(), "cpu": torch_sdma.group_path(device="cpu"),
            "cuda": torch_sdma.group_path(device="cuda"),
            "op": torch_sdma.group_path(device="cuda", op="all_to_all_single")}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device serves the string here")
def test_group_path_says_why_a_device_has_no_path():
    """"cpu:gloo,cuda:sdma" where this process has no CUDA: the sdma backend serves no device, and group_path
    says why (this torch's build, or no visible device), never a bare "unknown"."""
    import torch

    res = run_group(_group_path_body, 2, init="cpu:gloo,cuda:sdma", timeout=120, env={"TORCH_SDMA_LOG": "0"})
    res.check()
    no_cuda = ("this torch has no CUDA (a CPU-only build)" if torch.version.cuda is None and torch.version.hip is None
               else "no CUDA device is visible to this process")
    for v in res.values():
        assert v["any"] == f"unavailable:{no_cuda}; CPU tensors go to gloo, as the backend string says", v
        assert v["cuda"] == v["op"] == f"unavailable:{no_cuda}", v
        assert v["cpu"] == "unavailable:CPU tensors go to gloo, as the backend string says", v
