"""A rank of a script that ends with all-gathers in flight, never waited for (test_exit_in_flight_cpu.py, _cuda.py).

    python exit_in_flight.py --store-port P --rank R --world W --mode MODE --device cpu|cuda --status S

Modes: `in_flight` (every rank makes --calls async all-gathers and ends), `late_peer` (rank 1 starts its calls
--late-s after rank 0 made its own, so that rank 0's are still waiting for it when rank 0 exits), `temporaries` (the
outputs are temporaries: Python drops them at once, and the worker's drop is the last), `callbacks` (a Python
callback on each call's future), `destroy` (destroy_process_group with the calls in flight, then the end). On CUDA
the calls are held behind a spin on the stream. Exits
with --status, as a script on gloo or NCCL does; the parent checks that it does, and that no signal ended it.
"""
import argparse
import datetime
import sys
import time

import torch
import torch.distributed as dist

import torch_sdma  # noqa: F401  (registers "sdma"; its atexit hook is what is under test)

p = argparse.ArgumentParser()
p.add_argument("--store-port", type=int, required=True)
p.add_argument("--rank", type=int, required=True)
p.add_argument("--world", type=int, default=2)
p.add_argument("--mode", required=True)
p.add_argument("--device", default="cpu")
p.add_argument("--status", type=int, default=0)
p.add_argument("--calls", type=int, default=24)
p.add_argument("--numel", type=int, default=1 << 18)
p.add_argument("--late-s", type=float, default=1.5)
p.add_argument("--hold-gpu-cycles", type=int, default=2_000_000_000,
               help="CUDA: a spin of this many GPU cycles (about a second) on the stream before the calls")
args = p.parse_args()

if args.device == "cuda":
    # With SDMA_TEST_SHARE_GPU=1 on one GPU, both ranks share it.
    dev = torch.device("cuda", args.rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    backend = "cpu:gloo,cuda:sdma"
else:
    dev = torch.device("cpu")
    backend = "sdma"
store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
dist.init_process_group(backend, store=dist.PrefixStore("exit", store), rank=args.rank, world_size=args.world,
                        timeout=datetime.timedelta(seconds=30))
W, n = args.world, args.numel
# One call that completes first, so that every rank is connected before the calls that are left in flight.
x = torch.full((n,), float(args.rank), device=dev)
out = torch.empty(W * n, device=dev)
dist.all_gather_into_tensor(out, x)
if dev.type == "cuda":
    torch.cuda.synchronize()
assert torch.equal(out.cpu(), torch.arange(W).repeat_interleave(n).float()), "the first all-gather is wrong"
store.set(f"connected/{args.rank}", "1")
store.wait([f"connected/{r}" for r in range(W)])

if args.mode == "late_peer" and args.rank == 1:
    store.wait(["ended/0"])  # rank 0 has made its calls and is about to exit with them in flight
    time.sleep(args.late_s)

if dev.type == "cuda":
    # The calls wait for the caller's stream, held here: they are still in flight when the script ends, whichever
    # rank runs first (under MPS both run at once, and 24 calls of 1 MiB could all complete before the end).
    # torch's stream pool is made at its first use, and making it waits for the work queued on the GPU: a then()
    # callback takes streams of it, so it is made before the spin, as any script's has been by then.
    torch.cuda.Stream()
    torch.cuda._sleep(args.hold_gpu_cycles)
outputs, works, callbacks_ran = [], [], []
t_calls = time.monotonic()
for i in range(args.calls):
    x = torch.full((n,), float(args.rank * 1000 + i), device=dev)
    if args.mode == "temporaries":
        works.append(dist.all_gather_into_tensor(torch.empty(W * n, device=dev), x, async_op=True))
        continue
    o = torch.empty(W * n, device=dev)
    outputs.append(o)
    try:
        w = dist.all_gather_into_tensor(o, x, async_op=True)
    except RuntimeError as e:
        # The late rank's calls meet a peer that may have exited already: they fail, and once one did, the group
        # refuses the next ones. What is tested is the other rank's exit.
        assert args.mode == "late_peer" and args.rank == 1 and "exited" in str(e), e
        break
    if args.mode == "callbacks":
        w.get_future().then(lambda f: callbacks_ran.append(len(f.value())))
    works.append(w)
del x
if args.rank == 0:
    store.set("ended/0", "1")
if args.mode == "destroy":
    dist.destroy_process_group()
elapsed = time.monotonic() - t_calls
pending = sum(1 for w in works if not w.is_completed())
# A completed call's wait() does not block: it raises if the call failed (Work.exception() has no Python binding).
errors = []
for w in works:
    if w.is_completed():
        try:
            w.wait()
        except RuntimeError as e:
            errors.append(str(e).splitlines()[0][:200])
print(f"rank {args.rank} ends with {len(works)} calls in flight, {pending} not completed, {len(errors)} failed "
      f"{errors[:1]}, {elapsed:.2f} s after its first call", flush=True)
sys.exit(args.status)
