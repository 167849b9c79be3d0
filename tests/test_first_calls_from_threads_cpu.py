"""Groups connect without deadlock across threads: two threads of each rank make the first all-gathers of two
different groups at once (a barrier before), and both groups connect and then run their calls bit-exact, well
within the groups' timeout. Every group of a process shares one store client, which serves one request at a time;
a connect that waited for a peer's key inside a blocking store read kept the other group's connect from publishing
its own key, and both groups waited for each other until the timeout (csrc/transport/group_timeout_store.hpp).
CPU ranks in real processes; the GPU twin is test_first_calls_from_threads_cuda.py."""
import contextlib
import threading
import time

import torch
import torch.distributed as dist

from checks.data import assert_bytes_equal, expected_concat, poison_, rand
from mp_harness import run_group

PG_TIMEOUT_S = 20.0
ROUNDS = 6
CALLS = 40
# The first calls' connect must come well within the group's timeout, with room for a loaded 2-core machine.
CONNECT_LIMIT_S = 8.0


class CallTurns:
    """Call i > 0 of thread t enqueues at turn 2 * (i - 1) + t, the same order on every rank: groups' GPU work in
    crossed orders may wait on each other through a shared hardware queue (docs/errors.md), as NCCL's communicators
    may, so only the first calls, whose connects are what is tested, go at once."""

    def __init__(self):
        self.turn = 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def take(self, t, i):
        mine = 2 * (i - 1) + t
        with self.cond:
            if not self.cond.wait_for(lambda: self.turn == mine, timeout=PG_TIMEOUT_S * 3):
                raise TimeoutError(f"thread {t} call {i}: turn {mine} never came (at {self.turn})")
        try:
            yield
        finally:
            with self.cond:
                self.turn += 1
                self.cond.notify_all()


def first_calls_from_threads_body(ctx, rounds, calls, numel, one_order_after_first=False):
    W, rank, dev = ctx.world, ctx.rank, ctx.device
    errors, first_call_s = [], []
    for r in range(rounds):
        # A fresh pair of groups each round: every round's first calls connect again.
        groups = [dist.new_group(list(range(W))) for _ in range(2)]
        ctx.barrier_store(f"round{r}")
        start = threading.Barrier(2)
        turns = CallTurns()

        def run(t, group):
            # On GPUs each thread issues on a stream of its own: two groups' calls interleaved on one stream in
            # different orders on the two ranks wait for each other, as NCCL's communicators do.
            stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
            try:
                start.wait()
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    run_calls(t, group)
            except Exception as e:  # noqa: BLE001
                errors.append(f"round {r}, thread {t}: {type(e).__name__}: {e}")

        def run_calls(t, group):
            for i in range(calls):
                name = f"r{r}/t{t}/i{i}"
                n = numel + 97 * i  # sizes vary, so a call cannot pass with another call's bytes
                x = rand(name, rank, (n,), torch.float32, device=dev)
                out = poison_(torch.empty(W * n, device=dev))
                t0 = time.monotonic()
                with turns.take(t, i) if one_order_after_first and i > 0 else contextlib.nullcontext():
                    dist.all_gather_into_tensor(out, x, group=group)
                if i == 0:
                    first_call_s.append(time.monotonic() - t0)
                assert_bytes_equal(out, expected_concat(name, range(W), (n,), torch.float32, device=dev),
                                   f"{name} on group {t}")

        threads = [threading.Thread(target=run, args=(t, g)) for t, g in enumerate(groups)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        for g in groups:
            dist.destroy_process_group(g)
        if errors:
            break
    return {"errors": errors, "slowest_first_call_s": max(first_call_s) if first_call_s else None}


def run_first_calls_from_threads(cuda=False, env=None, rounds=ROUNDS, one_order_after_first=False):
    res = run_group(first_calls_from_threads_body, world=2, init="cpu:gloo,cuda:sdma" if cuda else "sdma",
                    cuda=cuda, env=env, pg_timeout_s=PG_TIMEOUT_S, timeout=60 + rounds * (PG_TIMEOUT_S + 10),
                    kwargs={"rounds": rounds, "calls": CALLS, "numel": 4096,
                            "one_order_after_first": one_order_after_first})
    res.check()
    for rank, v in enumerate(res.values()):
        assert not v["errors"], f"rank {rank}: {v['errors']}"
        assert v["slowest_first_call_s"] < CONNECT_LIMIT_S, f"rank {rank}: a first call took {v}"


def test_first_calls_on_two_groups_from_two_threads():
    run_first_calls_from_threads()


def test_first_calls_on_two_groups_from_two_threads_direct():
    run_first_calls_from_threads(env={"TORCH_SDMA_DIRECT": "1"}, rounds=3)
