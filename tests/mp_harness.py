"""Run a function in N real processes that form a process group, with a hard time limit.

Usage (from a test):

    from mp_harness import run_group

    def body(ctx):                      # runs in every rank, must be a module-level function
        ...                             # ctx.rank, ctx.world, ctx.init_pg(...), ctx.run_cases([...])
        return something_picklable

    res = run_group(body, world=2, init="sdma", timeout=120)
    res.check()                         # raises AssertionError listing every failing rank / case

Design:
- the parent hosts a TCPStore bound to port 0 (no port race); every process group of the run uses its own
  PrefixStore on it (so destroy + init again in the same process works);
- each rank is a `spawn`ed process; its stdout/stderr go to a per-rank log file; it dies with the parent
  (PR_SET_PDEATHSIG) and is SIGKILLed when the run's time limit passes, or `grace` seconds after another rank
  ended with an error (a missing peer must become an error within the group's timeout, never a hang);
- `ctx.run_cases(cases)` runs many named checks inside one group and records each outcome in a per-rank
  JSON-lines file as it goes, so that a rank killed by the time limit still reports what it had done, and the
  case it was stuck in.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass, field

DEFAULT_PG_TIMEOUT_S = 60.0
ASYNC_ERROR_HANDLING = "TORCH_SDMA_ASYNC_ERROR_HANDLING"


# --------------------------------------------------------------------------------------------- child side
def _set_pdeathsig():
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:
        pass


class CaseFailure(AssertionError):
    pass


class Ctx:
    """What a rank's function receives."""

    def __init__(self, rank, world, run_dir, store_port, pg_timeout_s, init, extra):
        self.rank = rank
        self.world = world
        self.run_dir = run_dir
        self.store_port = store_port
        self.pg_timeout_s = pg_timeout_s
        self.init = init
        self.extra = extra  # dict given by the test (picklable)
        self._store = None
        self._n_pg = 0
        self._cases_path = os.path.join(run_dir, f"cases.{rank}.jsonl")
        self._case_n = 0

    # --- rendezvous
    @property
    def store(self):
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                "127.0.0.1",
                self.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=max(60.0, self.pg_timeout_s)),
            )
        return self._store

    def fresh_store(self, tag="pg"):
        """A new PrefixStore (same name on every rank as long as every rank calls in the same order)."""
        import torch.distributed as dist

        self._n_pg += 1
        return dist.PrefixStore(f"{tag}{self._n_pg}", self.store)

    @property
    def device(self):
        """cuda:<local rank> in a cuda run, else cpu."""
        import torch

        if self.extra.get("cuda"):
            return torch.device("cuda", self.rank % torch.cuda.device_count())
        return torch.device("cpu")

    def init_pg(self, backend=None, timeout_s=None, **kwargs):
        """init_process_group(backend) over a fresh store; `backend` defaults to the run's init string.
        In a run with device_id=True, the default group is bound to this rank's GPU."""
        import torch.distributed as dist

        if self.extra.get("device_id") and "device_id" not in kwargs:
            kwargs["device_id"] = self.device

        if backend is None:
            backend = self.init
        if backend and "sdma" in backend:
            import torch_sdma  # noqa: F401  (registers the name)
        t = self.pg_timeout_s if timeout_s is None else timeout_s
        dist.init_process_group(
            backend,
            store=self.fresh_store(),
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=t),
            **kwargs,
        )

    def barrier_store(self, name, timeout_s=None, size=None):
        """A barrier through the store only (no process group involved), keyed by `name`, of `size` ranks
        (default: all)."""
        key = f"barrier/{name}"
        n = self.world if size is None else size
        t = timeout_s if timeout_s is not None else self.pg_timeout_s + 30
        if int(self.store.add(key, 1)) >= n:
            self.store.set(key + "/open", "1")
        try:  # a blocking wait on the store server: no polling (2-core CI machines)
            self.store.wait([key + "/open"], datetime.timedelta(seconds=t))
        except Exception as e:  # noqa: BLE001
            arrived = int(self.store.add(key, 0))
            raise TimeoutError(f"store barrier {name!r}: {arrived} of {n} ranks arrived within {t:.0f}s") from e

    def seed(self, name):
        """A seed that differs per rank and per case, stable across runs."""
        return zlib.crc32(f"{name}|{self.rank}".encode()) & 0x7FFFFFFF

    def generator(self, name):
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed(name))
        return g

    # --- many checks in one group
    def _log_case(self, **rec):
        with open(self._cases_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()

    def run_cases(self, cases, sync=True, stop_after_failures=None, barrier_size=None, barrier_tag="all"):
        """cases: iterable of (name, callable()). Every participating rank must run the same list in the same
        order.

        Each case's exception is recorded (with traceback) and the next case runs. With sync=True the ranks
        meet at a store barrier after each case, so a case that failed on one rank cannot shift the next ones.
        For cases run by a subset of the ranks (a subgroup), give barrier_size (the subset's size) and a
        barrier_tag unique to that subset and list. Returns the number of failed cases on this rank."""
        n_failed = 0
        self._lists = getattr(self, "_lists", {})
        list_n = self._lists.get(barrier_tag, 0) + 1
        self._lists[barrier_tag] = list_n
        for idx, (name, fn) in enumerate(cases):
            self._case_n += 1
            self._log_case(case=name, status="start", t=time.time())
            t0 = time.monotonic()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                n_failed += 1
                self._log_case(
                    case=name,
                    status="fail",
                    dt=time.monotonic() - t0,
                    error=f"{type(e).__name__}: {e}",
                    tb=traceback.format_exc(),
                )
                print(f"[rank {self.rank}] case {name} FAILED: {type(e).__name__}: {e}", flush=True)
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
            else:
                self._log_case(case=name, status="ok", dt=time.monotonic() - t0)
            if sync:
                self.barrier_store(f"cases/{barrier_tag}/{list_n}/{idx}:{name}", size=barrier_size)
            if stop_after_failures is not None and n_failed >= stop_after_failures:
                break
        return n_failed

    def publish(self, key, value):
        self.store.set(f"pub/{key}", pickle.dumps(value))

    def fetch(self, key, timeout_s=None):
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.pg_timeout_s + 30)
        k = f"pub/{key}"
        while not self.store.check([k]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"key {key!r} never published")
            time.sleep(0.005)
        return pickle.loads(self.store.get(k))


def _child_main(rank, world, fn, kwargs, init, env, run_dir, store_port, pg_timeout_s, destroy, hard_exit, extra):
    _set_pdeathsig()
    log_path = os.path.join(run_dir, f"log.{rank}.txt")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    # the harness sends SIGUSR1 before it SIGKILLs a rank that hangs: every thread's Python stack goes to the log
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    # and a crash (SIGSEGV, SIGABRT) leaves every thread's Python stack in the log too
    faulthandler.enable(file=sys.stderr, all_threads=True)
    for k, v in (env or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(store_port))

    out = {"rank": rank, "status": "error", "value": None, "error": None}
    ctx = Ctx(rank, world, run_dir, store_port, pg_timeout_s, init, dict(extra or {}))
    try:
        if ctx.extra.get("cuda"):
            import torch

            if init and "sdma" in init:
                # As users are told: loaded before CUDA starts, torch_sdma asks for its 32 hardware queues.
                import torch_sdma  # noqa: F401
            torch.cuda.set_device(ctx.device)
        if init:
            ctx.init_pg(init)
        out["value"] = fn(ctx, **(kwargs or {}))
        out["status"] = "ok"
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        print(out["error"], flush=True)
    # write the result before any teardown, so that a teardown hang cannot lose it
    tmp = os.path.join(run_dir, f"result.{rank}.pkl.tmp")
    with open(tmp, "wb") as f:
        try:
            pickle.dump(out, f)
        except Exception as e:  # value not picklable
            f.seek(0)
            f.truncate()
            out["value"] = None
            out["status"] = "error"
            out["error"] = f"result not picklable: {e!r}"
            pickle.dump(out, f)
    os.replace(tmp, os.path.join(run_dir, f"result.{rank}.pkl"))
    if destroy and out["status"] == "ok":
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001
            print("destroy_process_group failed:\n" + traceback.format_exc(), flush=True)
            with open(os.path.join(run_dir, f"teardown.{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    if hard_exit or out["status"] != "ok":
        os._exit(0 if out["status"] == "ok" else 3)


# --------------------------------------------------------------------------------------------- parent side
@dataclass
class RankResult:
    rank: int
    exitcode: int | None = None  # negative: killed by that signal
    status: str = "missing"  # ok | error | missing (no result written)
    value: object = None
    error: str | None = None
    killed_by_harness: bool = False
    cases: list = field(default_factory=list)  # [(name, "ok"|"fail"|"unfinished", detail)]
    log_tail: str = ""
    teardown_error: str | None = None
    elapsed_s: float = 0.0


@dataclass
class GroupResult:
    world: int
    init: str | None
    ranks: list
    wall_s: float
    timed_out: bool
    run_dir: str

    def values(self):
        return [r.value for r in self.ranks]

    def failed_cases(self):
        out = []
        for r in self.ranks:
            for name, st, detail in r.cases:
                if st != "ok":
                    out.append((r.rank, name, st, detail))
        return out

    def case_names(self, rank=0):
        return [c[0] for c in self.ranks[rank].cases]

    def describe(self, expect_dead=()):
        lines = [f"world={self.world} init={self.init!r} wall={self.wall_s:.1f}s timed_out={self.timed_out}"]
        for r in self.ranks:
            bad = (r.status != "ok" or r.exitcode != 0) and r.rank not in expect_dead
            if bad or any(st != "ok" for _, st, _ in r.cases) or r.teardown_error:
                lines.append(
                    f"--- rank {r.rank}: status={r.status} exitcode={r.exitcode} "
                    f"killed_by_harness={r.killed_by_harness}"
                )
                if r.error:
                    lines.append(r.error.rstrip())
                for name, st, detail in r.cases:
                    if st != "ok":
                        lines.append(f"  case {name!r}: {st}\n" + _indent(detail or "", 4))
                if r.teardown_error:
                    lines.append("  teardown (destroy_process_group) failed:\n" + _indent(r.teardown_error, 4))
                if bad and r.log_tail:
                    lines.append("  log tail:\n" + _indent(r.log_tail, 4))
        return "\n".join(lines)

    def check(self, expect_dead=(), allow_teardown_errors=False):
        """Raise AssertionError naming every failing rank and case."""
        problems = False
        for r in self.ranks:
            if r.rank in expect_dead:
                continue
            if r.status != "ok" or r.exitcode != 0:
                problems = True
            if any(st != "ok" for _, st, _ in r.cases):
                problems = True
            if r.teardown_error and not allow_teardown_errors:
                problems = True
        if problems or self.timed_out:
            fails = self.failed_cases()
            summary = sorted({name for _, name, _, _ in fails})
            head = f"{len(summary)} failing case(s): {summary}\n" if summary else ""
            raise AssertionError(head + self.describe(expect_dead))
        return self


def _indent(s, n):
    pad = " " * n
    return "\n".join(pad + line for line in str(s).splitlines())


def _read_cases(path):
    cases = {}
    order = []
    if not os.path.exists(path):
        return []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            name = rec["case"]
            if rec["status"] == "start":
                if name not in cases:
                    order.append(name)
                cases[name] = ("unfinished", "started, never finished (hang, crash or killed by the time limit)")
            elif rec["status"] == "ok":
                cases[name] = ("ok", "")
            else:
                cases[name] = ("fail", rec.get("tb") or rec.get("error"))
    return [(n, *cases[n]) for n in order]


def _tail(path, n=12000):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def run_group(
    fn,
    world,
    init="sdma",
    *,
    env=None,
    per_rank_env=None,
    timeout=180.0,
    pg_timeout_s=DEFAULT_PG_TIMEOUT_S,
    grace=None,
    destroy=True,
    hard_exit=False,
    kwargs=None,
    extra=None,
    keep_dir=False,
    on_started=None,
    cuda=False,
    device_id=False,
):
    """Run fn(ctx, **kwargs) in `world` spawned processes.

    init: backend string for init_process_group before fn runs (None: fn does it itself with ctx.init_pg).
    env: environment set in every child before anything runs (None values unset a variable); over
         TORCH_SDMA_ASYNC_ERROR_HANDLING=0, so that a rank outlives a failure found after its call returned unless
         env names the variable;
    per_rank_env: {rank: {...}} on top of env.
    timeout: hard limit for the whole run; every child still alive then is SIGKILLed.
    grace: after a rank ends with an error or a signal, the others get this long before being SIGKILLed
           (default: pg_timeout_s + 30).
    on_started(procs): called in the parent once all children are started (e.g. to kill one later).
    cuda: each rank sets its current device to cuda:<rank> before anything; device_id: init_process_group
    gets device_id=cuda:<rank> (binds the default group to the GPU, needed by split_group).
    """
    extra = dict(extra or {})
    extra.setdefault("cuda", bool(cuda or device_id))
    extra.setdefault("device_id", bool(device_id))
    import torch.distributed as dist

    if grace is None:
        grace = pg_timeout_s + 30.0
    run_dir = tempfile.mkdtemp(prefix="sdma_mp_")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    port = store.port
    ctx_mp = multiprocessing.get_context("spawn")
    procs = []
    t0 = time.monotonic()
    for rank in range(world):
        # The tests check errors on every rank after a failure, so their ranks outlive one found after the call
        # returned (TORCH_SDMA_ASYNC_ERROR_HANDLING=0); a test of the default exit names the variable itself (None:
        # unset, the default).
        e = {ASYNC_ERROR_HANDLING: "0"}
        e.update(env or {})
        e.update((per_rank_env or {}).get(rank, {}))
        p = ctx_mp.Process(
            target=_child_main,
            args=(rank, world, fn, kwargs, init, e, run_dir, port, pg_timeout_s, destroy, hard_exit, extra),
            name=f"sdma-rank{rank}",
            daemon=False,
        )
        p.start()
        procs.append(p)
    if on_started is not None:
        on_started(procs)
    deadline = t0 + timeout
    first_bad = None
    killed = set()
    end_time = {}
    timed_out = False
    try:
        while True:
            alive = [p for p in procs if p.exitcode is None]
            now = time.monotonic()
            for i, p in enumerate(procs):
                if p.exitcode is not None and i not in end_time:
                    end_time[i] = now - t0
                    if p.exitcode != 0 and first_bad is None:
                        first_bad = now
            if not alive:
                break
            if now > deadline or (first_bad is not None and now > first_bad + grace):
                timed_out = now > deadline
                stuck = [(i, p) for i, p in enumerate(procs) if p.exitcode is None]
                for i, p in stuck:  # stacks into the logs first
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)
                if os.environ.get("MP_HARNESS_GDB") == "1" and shutil.which("gdb"):
                    for i, p in stuck:  # native stacks of every thread, for a bug report
                        import subprocess

                        with open(os.path.join(run_dir, f"log.{i}.txt"), "a") as f:
                            f.write("\n==== gdb: thread apply all bt ====\n")
                            f.flush()
                            subprocess.run(["gdb", "-p", str(p.pid), "-batch", "-ex", "thread apply all bt"],
                                           stdout=f, stderr=subprocess.STDOUT, timeout=120)
                for i, p in enumerate(procs):
                    if p.exitcode is None:
                        killed.add(i)
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p.pid, signal.SIGKILL)
                for p in procs:
                    p.join(10)
                break
            time.sleep(0.02)
    finally:
        for i, p in enumerate(procs):
            if p.exitcode is None:
                killed.add(i)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join(10)
    wall = time.monotonic() - t0
    ranks = []
    for i, p in enumerate(procs):
        rr = RankResult(rank=i, exitcode=p.exitcode, killed_by_harness=i in killed, elapsed_s=end_time.get(i, wall))
        rp = os.path.join(run_dir, f"result.{i}.pkl")
        if os.path.exists(rp):
            with open(rp, "rb") as f:
                d = pickle.load(f)
            rr.status, rr.value, rr.error = d["status"], d["value"], d["error"]
        elif i in killed:
            rr.error = f"rank {i} killed by the harness (time limit or peer failure) with no result"
        else:
            rr.error = f"rank {i} exited with code {p.exitcode} and no result"
        tp = os.path.join(run_dir, f"teardown.{i}.txt")
        if os.path.exists(tp):
            with open(tp) as f:
                rr.teardown_error = f.read()
        rr.cases = _read_cases(os.path.join(run_dir, f"cases.{i}.jsonl"))
        rr.log_tail = _tail(os.path.join(run_dir, f"log.{i}.txt"))
        ranks.append(rr)
    del store
    if not keep_dir and not os.environ.get("MP_HARNESS_KEEP_DIRS"):
        shutil.rmtree(run_dir, ignore_errors=True)
    return GroupResult(world=world, init=init, ranks=ranks, wall_s=wall, timed_out=timed_out, run_dir=run_dir)
