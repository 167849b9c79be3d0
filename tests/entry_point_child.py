"""One rank of test_install.py's entry-point test; run as a script, never imported by the test suite.

argv: BACKEND_STRING EXPECTED_PACKAGE_DIR. Rendezvous comes from the environment as torchrun sets it. This process
never imports torch_sdma before init_process_group: torch must find it through the installed distribution's
`torch.distributed.backends` entry point. Prints one line "RESULT <json>" at the end.
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

backend, package_dir = sys.argv[1], os.path.realpath(sys.argv[2])
out = {"backend": backend}

assert "torch_sdma" not in sys.modules, "torch_sdma was imported before init_process_group"
assert "SDMA" not in dist.Backend._plugins, "sdma was registered before init_process_group"
assert not torch.cuda.is_initialized()

dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()

# What the entry point loaded, and that it is what `import torch_sdma` would have done.
assert "torch_sdma" in sys.modules, "init_process_group did not load torch_sdma"
torch_sdma = sys.modules["torch_sdma"]
out["package"] = os.path.dirname(os.path.realpath(torch_sdma.__file__))
assert out["package"].startswith(package_dir), (out["package"], package_dir)
plugin = dist.Backend._plugins["SDMA"]
assert plugin.extended_api is True
assert plugin.creator_fn is torch_sdma.create_backend
assert dist.Backend.backend_capability["sdma"] == ["cpu", "cuda"], dist.Backend.backend_capability["sdma"]
assert getattr(c10d._get_split_source, "_sdma_wrapped", False), "the nccl split-source patch is missing"
# CUDA had not started when torch loaded the entry point, so the hardware-queue request was made in time.
assert torch_sdma._hw_queues.decision == "set", torch_sdma._hw_queues.decision
assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "32"
assert dist.get_backend() == backend, (dist.get_backend(), backend)

import torch_sdma as again  # noqa: E402  (importing after the entry point must change nothing)

torch_sdma._register()
assert again is torch_sdma and dist.Backend._plugins["SDMA"] is plugin

cpu_backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
out["cpu_backend"] = cpu_backend
expected_cpu_backend = "ProcessGroupGloo" if backend.startswith("cpu:gloo") else "ProcessGroupSDMA"
assert cpu_backend == expected_cpu_backend, (cpu_backend, expected_cpu_backend)
if backend == "sdma" or "cuda:sdma" in backend:
    # torch makes the sdma backend for the cuda slot even with no GPU (which then refuses CUDA collectives, saying
    # why): so the entry point ran for "cpu:gloo,cuda:sdma" too, though no CPU tensor reaches sdma there.
    out["cuda_backend"] = type(dist.group.WORLD._get_backend(torch.device("cuda"))).__name__
    assert out["cuda_backend"] == "ProcessGroupSDMA", out["cuda_backend"]

# Every all-gather against the same all-gather on a plain gloo group: random data per rank and case, outputs
# poisoned with the bitwise NOT of the expected bytes, compared byte for byte.
gloo = dist.new_group(backend="gloo")
gen = torch.Generator().manual_seed(1234 + rank)


def random(numel, dtype):
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    return torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def poison(expected):
    return (~expected.contiguous().view(torch.uint8)).view(expected.dtype).reshape(expected.shape).clone()


def same_bytes(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


checked = 0
for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float64):
    for numel in (1, 1000, 4097, 1 << 20):
        x = random(numel, dtype)
        want = torch.empty(world * numel, dtype=dtype)
        dist.all_gather_into_tensor(want, x, group=gloo)
        got = poison(want)
        dist.all_gather_into_tensor(got, x)
        assert same_bytes(got, want), f"all_gather_into_tensor {dtype} x {numel}"
        got_list = [poison(p) for p in want.chunk(world)]
        dist.all_gather(got_list, x)
        assert all(same_bytes(g, w) for g, w in zip(got_list, want.chunk(world))), f"all_gather {dtype} x {numel}"
        checked += 2
out["all_gathers_checked"] = checked

if cpu_backend == "ProcessGroupSDMA":
    s = torch_sdma.stats()
    out["stats"] = s
    assert s.get("dma", {}).get("calls", 0) == checked, s  # every one took the shared-memory path, none delegated

dist.barrier()
dist.destroy_process_group()
print("RESULT " + json.dumps(out), flush=True)
