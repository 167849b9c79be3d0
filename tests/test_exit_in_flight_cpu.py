"""A script that ends with all-gathers in flight exits with its own status, as it does on gloo and NCCL: no thread of
ours takes the GIL while the interpreter finalizes (csrc/work/interpreter_exit.hpp), so no rank dies by SIGABRT
("terminate called without an active exception"), and nothing is left in /dev/shm. Two real processes per run, each
a plain script (tests/exit_in_flight.py), not a harness function: the interpreter's own exit is what is tested. The
GPU twin is test_exit_in_flight_cuda.py."""
import datetime
import os
import re
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist
from test_user_mistakes_cpu import shm_entries, shm_entries_left

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "exit_in_flight.py")
RUN_TIMEOUT_S = 150.0  # two interpreters starting torch on a loaded 2-core machine, and a group's timeout of 30 s


def describe_status(rc):
    return f"signal {signal.Signals(-rc).name}" if rc < 0 else f"status {rc}"


def run_script_pair(mode, device="cpu", status=7, world=2, env=None, extra_args=()):
    """Runs exit_in_flight.py as `world` ranks over a store this process hosts; returns [(returncode, output)]."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, child_env.get("PYTHONPATH")) if p)
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    # A late peer's run may fail its calls after they returned: the script's own status is what is checked.
    child_env.setdefault("TORCH_SDMA_ASYNC_ERROR_HANDLING", "0")
    procs = []
    for rank in range(world):
        cmd = [sys.executable, SCRIPT, "--store-port", str(store.port), "--rank", str(rank), "--world", str(world),
               "--mode", mode, "--device", device, "--status", str(status), *extra_args]
        procs.append(subprocess.Popen(cmd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    del store
    return results


def check_runs(mode, runs, device="cpu", env=None):
    not_completed = 0  # calls some rank had not seen complete when it ended, over every run
    ends = []  # every rank's last line, for the message below
    for run in range(runs):
        before = shm_entries()
        status = 7 if run % 2 == 0 else 0
        # The late peer comes from at once to well after the other rank's exit: its calls complete while that rank's
        # interpreter finalizes in some runs, never in others.
        late = ["--late-s", f"{0.15 * run:.2f}"] if mode == "late_peer" else []
        results = run_script_pair(mode, device=device, status=status, env=env, extra_args=late)
        for rank, (rc, out) in enumerate(results):
            assert rc == status, (f"{mode}, run {run}: rank {rank} ended with {describe_status(rc)}, not the script's "
                                  f"status {status}:\n{out[-4000:]}")
            assert "terminate called" not in out, f"{mode}, run {run}: rank {rank}:\n{out[-4000:]}"
            m = re.search(r"calls in flight, (\d+) not completed", out)
            assert m, f"{mode}, run {run}: rank {rank} did not reach its end:\n{out[-4000:]}"
            not_completed += int(m.group(1))
            ends.append(re.search(r"rank \d+ ends with [^\n]*", out).group(0))
            print(f"{mode}, run {run}: {ends[-1]}")  # shown by pytest -rA: how far each run's calls had come
        left = shm_entries_left(before)
        assert not left, f"{mode}, run {run}: left in /dev/shm: {sorted(left)}"
    # The runs tested what they are for: calls still running when an interpreter exited.
    assert mode == "destroy" or not_completed > 0, (f"{mode}: every call had completed before its rank ended: "
                                                  f"{ends}")


# Two endings, ten runs each: every rank's calls in flight at its exit, and a peer so late that the
# calls are still waiting for it when the other rank's interpreter finalizes.
@pytest.mark.parametrize("mode", ["in_flight", "late_peer"])
def test_script_ending_with_calls_in_flight_exits_with_its_status(mode):
    check_runs(mode, runs=10)


# Outputs Python dropped at once (the worker's reference is the last), a Python callback on every call's future, and
# destroy_process_group with the calls in flight.
@pytest.mark.parametrize("mode", ["temporaries", "callbacks", "destroy"])
def test_other_endings_exit_with_their_status(mode):
    check_runs(mode, runs=3)
