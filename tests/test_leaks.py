"""No /dev/shm entry, file descriptor or shared mapping of ours outlives a group, after a normal exit
and after every member crashed; while a group lives, its segments are owner-only (0600) and already unlinked
once every member has mapped them."""
import gc
import os
import signal
import stat
import threading
import time

import pytest
import torch
import torch.distributed as dist

from checks.allgather import AG
from mp_harness import run_group

CPU = torch.device("cpu")


def shm_names():
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def shm_fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            out.append((fd, target))
    return out


def shm_maps():
    """(address range, path) of every mapping of a /dev/shm file in this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip().startswith("/dev/shm/"):
                out.append((parts[0], parts[5].strip()))
    return out


def segment_modes():
    """st_mode and st_uid of every shared-memory object this process maps or holds open (works after unlink,
    through /proc/self/map_files and /proc/self/fd)."""
    handles = [(f"/proc/self/map_files/{rng}", path) for rng, path in shm_maps()]
    handles += [(f"/proc/self/fd/{fd}", path) for fd, path in shm_fds()]
    seen = {}
    for handle, path in handles:
        try:
            st = os.stat(handle)
            seen[path] = (stat.S_IMODE(st.st_mode), st.st_uid)
        except OSError:
            pass
    return seen


class ShmWatcher:
    """Polls /dev/shm and records the mode and owner of every new entry it manages to see."""

    def __init__(self, before):
        self.before = set(before)
        self.seen = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for name in shm_names() - self.before:
                if name in self.seen:
                    continue
                try:
                    st = os.stat(f"/dev/shm/{name}")
                    self.seen[name] = (stat.S_IMODE(st.st_mode), st.st_uid)
                except OSError:
                    self.seen.setdefault(name, None)  # already unlinked
            time.sleep(0.0005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._t.join()


def _use_group(ctx, tag, backend):
    """Create the default group, use every all-gather form (small and chunked) and a subgroup, then leave."""
    W = ctx.world
    ctx.init_pg(backend)
    ref = dist.new_group(backend="gloo")
    ag = AG(dist.group.WORLD, ref, CPU, tag)
    ag.into_tensor("a", (1000,), torch.float32)
    ag.into_tensor("b", (300000,), torch.uint8, inplace=True)  # > 64K staging: chunked
    ag.as_list("c", (77,), torch.bfloat16)
    # one dtype: gloo (the baseline life cycle runs this too) mishandles mixed-dtype coalesced all-gathers
    ag.coalesced_cm("d", [((5,), torch.float32), ((9,), torch.float32)], async_op=True)
    ag.coalesced_legacy("e", [(3,), (4,)], torch.float32)
    sub_ranks = list(range(0, W, 2))
    sg = dist.new_group(ranks=sub_ranks)
    sr = dist.new_group(ranks=sub_ranks, backend="gloo")
    if ctx.rank in sub_ranks:
        AG(sg, sr, CPU, tag + "sub").into_tensor("s", (4097,), torch.uint8)
    ctx.barrier_store(f"{tag}/used")


def normal_exit_body(ctx, cycles):
    failures = []
    ctx.store  # noqa: B018  (connect to the store before taking the baseline)
    info = {"fd": {}, "modes": {}, "visible_alive": {}, "maps_alive": {}}

    # baseline: the same life cycle on plain gloo (what torch itself keeps open is not ours)
    _use_group(ctx, "gloo0", "gloo")
    dist.destroy_process_group()
    gc.collect()
    fd_g0 = fd_count()
    _use_group(ctx, "gloo1", "gloo")
    dist.destroy_process_group()
    gc.collect()
    fd_g1 = fd_count()
    info["fd"]["gloo_growth_per_cycle"] = fd_g1 - fd_g0

    names0 = shm_names()
    maps0 = shm_maps()
    fds = [fd_count()]
    for c in range(cycles):
        with ShmWatcher(names0) as w:
            _use_group(ctx, f"sdma{c}", "sdma")
            # every member has mapped everything by now: nothing of ours may be visible
            alive = sorted(shm_names() - names0)
            info["visible_alive"][c] = alive
            if alive:
                failures.append(f"cycle {c}: /dev/shm entries still visible while the group lives: {alive}")
            maps = [m for m in shm_maps() if m not in maps0]
            info["maps_alive"][c] = maps
            if not maps:  # otherwise the checks below would check nothing
                failures.append(f"cycle {c}: no /dev/shm segment is mapped while the sdma group lives")
            not_unlinked = [p for _, p in maps if not p.endswith("(deleted)")]
            if not_unlinked:
                failures.append(f"cycle {c}: mapped segments not unlinked: {not_unlinked}")
            modes = segment_modes()
            for path, (mode, uid) in modes.items():
                info["modes"][path] = (oct(mode), uid)
                if mode != 0o600 or uid != os.getuid():
                    failures.append(f"cycle {c}: segment {path} has mode {oct(mode)} uid {uid}, want 0600 and "
                                    f"uid {os.getuid()}")
            ctx.barrier_store(f"checked{c}")
            dist.destroy_process_group()
            gc.collect()
            ctx.barrier_store(f"destroyed{c}")
        for name, m in w.seen.items():
            if m is not None and (m[0] != 0o600 or m[1] != os.getuid()):
                failures.append(f"cycle {c}: /dev/shm/{name} was created with mode {oct(m[0])} uid {m[1]}")
        info.setdefault("seen_entries", {})[c] = {k: (oct(v[0]) if v else None) for k, v in w.seen.items()}
        fds.append(fd_count())
        left = sorted(shm_names() - names0)
        if left:
            failures.append(f"cycle {c}: /dev/shm entries left after destroy_process_group: {left}")
        maps_left = [m for m in shm_maps() if m not in maps0]
        if maps_left:
            failures.append(f"cycle {c}: shared mappings left after destroy_process_group: {maps_left}")
        fds_left = shm_fds()
        if fds_left:
            failures.append(f"cycle {c}: /dev/shm file descriptors left open after destroy: {fds_left}")
    info["fd"]["sdma_after_each_cycle"] = fds
    growth = fds[1] - fds[0]
    if growth > max(0, info["fd"]["gloo_growth_per_cycle"]):
        failures.append(f"open fds grew by {growth} over the first sdma group's life (gloo's own: "
                        f"{info['fd']['gloo_growth_per_cycle']}); per cycle: {fds}")
    if fds[-1] > fds[1]:
        failures.append(f"open fds keep growing from one sdma group to the next: {fds}")
    return {"failures": failures, "info": info}


@pytest.mark.parametrize("world", [2, 4])
def test_no_leak_after_normal_exit(world):
    before = shm_names()
    res = run_group(normal_exit_body, world, init=None, kwargs={"cycles": 3}, timeout=180, pg_timeout_s=20,
                    env={"TORCH_SDMA_STAGING_BYTES": "64K"})
    res.check()
    problems = [f"rank {r.rank}: {f}" for r in res.ranks for f in r.value["failures"]]
    left = sorted(shm_names() - before)
    if left:
        problems.append(f"/dev/shm entries left after every process exited: {left}")
    assert not problems, "\n".join(problems) + f"\ninfo rank 0: {res.ranks[0].value['info']}"


def crash_body(ctx, when):
    """Use the groups, then SIGKILL this process: after the all-gathers ('after'), or while large chunked
    all-gathers are in flight ('during')."""
    W = ctx.world
    _use_group(ctx, "crash", "sdma")
    if when == "after":
        ctx.barrier_store("before-kill")
        os.kill(os.getpid(), signal.SIGKILL)
    n = 1 << 20
    x = torch.randn(n)
    out = torch.empty(W * n)
    ctx.barrier_store("loop")
    threading.Timer(0.2 + 0.05 * ctx.rank, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            dist.all_gather_into_tensor(out, x, async_op=True)
    except Exception:  # noqa: BLE001  (a peer died first: the survivors may see an error before their own end)
        pass
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("world,when", [(2, "after"), (3, "after"), (2, "during"), (3, "during")])
def test_no_shm_left_after_every_member_crashed(world, when):
    before = shm_names()
    res = run_group(crash_body, world, init=None, kwargs={"when": when}, timeout=180, pg_timeout_s=15,
                    grace=60, env={"TORCH_SDMA_STAGING_BYTES": "64K"}, destroy=False)
    codes = [r.exitcode for r in res.ranks]
    assert all(c == -signal.SIGKILL for c in codes), f"exit codes {codes}\n{res.describe(expect_dead=range(world))}"
    time.sleep(0.2)
    left = sorted(shm_names() - before)
    assert not left, f"/dev/shm entries left after every member was SIGKILLed: {left}"
