"""sdma from the backend string alone: no `import torch_sdma` (torch >= 2.14 with the package installed).

    pip install --no-build-isolation .            # once; see docs/install.md
    torchrun --nproc_per_node 2 examples/torchrun_backend_string.py

init_process_group("cpu:gloo,cuda:sdma") loads torch_sdma through its `torch.distributed.backends` entry point.
The script sets its GPU first, as most training scripts do, so CUDA has started when torch_sdma is loaded: the
group's log line then reports 8 hardware queues unless CUDA_DEVICE_MAX_CONNECTIONS was exported (docs/install.md).
It all-gathers 64 MiB of bf16 per rank on the default group and on an NCCL group, compares the bytes, and prints
the path sdma took. Without a GPU the CPU tensors go to gloo, which this string gives them, and only the
loading is shown.
"""
import os
import sys

import torch
import torch.distributed as dist


def main():
    assert "torch_sdma" not in sys.modules
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:sdma")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch_sdma = sys.modules["torch_sdma"]  # loaded by init_process_group, not by this script

    reference = dist.new_group(backend="nccl" if cuda else "gloo")
    # torch 2.14 deprecates all_gather_into_tensor in favour of all_gather_single, the same call underneath.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(32 << 20, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
    want = torch.empty(world * x.numel(), dtype=x.dtype, device=device)
    gather_single(want, x, group=reference)
    got = (~want.view(torch.int16)).view(torch.bfloat16)  # poisoned: every byte differs from the answer
    gather_single(got, x)
    if cuda:
        torch.cuda.synchronize()
    same = torch.equal(got.view(torch.int16), want.view(torch.int16))
    path = torch_sdma.group_path() if cuda else "gloo (CPU tensors, as the string says)"
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    print(f"rank {rank}: torch_sdma loaded from {os.path.dirname(torch_sdma.__file__)}; all-gather of "
          f"{want.numel() * 2 >> 20} MiB {'bit-identical to' if same else 'DIFFERS from'} the reference; path "
          f"{path}; CUDA_DEVICE_MAX_CONNECTIONS {queues} ({torch_sdma._hw_queues.decision})", flush=True)
    dist.destroy_process_group()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
