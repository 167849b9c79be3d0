"""How many hardware queues CUDA spreads this process's streams over, and why torch_sdma asks for 32.

A copy-engine all-gather orders itself after its peers with stream memory operations (cuStreamWaitValue32). While
such a wait is pending it holds the hardware queue its stream is mapped to, and CUDA maps every stream of the
process onto CUDA_DEVICE_MAX_CONNECTIONS queues (8 when unset): a compute stream that shares the queue stalls until
the peer arrives. NCCL's kernels wait on SMs instead, so they never hold a queue. On 2x H200 (README), FSDP2 ran
5.6% slower than NCCL with 8 queues and 0.3-3.8% faster with 32 (four runs).

The variable is read once, when CUDA creates the process's context, so it can only be set before CUDA starts:
loading torch_sdma sets it to 32 when the user has not set it and torch has not initialised CUDA yet. A value the
user set is never changed (Megatron's tensor-parallel overlap needs 1, for example); the group log line says when
the value in effect is below 32.

torch_sdma is loaded by `import torch_sdma`, or, on torch >= 2.14 with no import, by init_process_group through
the package's entry point. The latter usually runs after torch.cuda.set_device has started CUDA: too late, so the
process keeps CUDA's 8 queues unless the variable was set in the environment that launched it.
"""
import os

import torch

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
RECOMMENDED = 32
CUDA_DEFAULT = 8

# What loading torch_sdma did: "set" (we set it to RECOMMENDED), "user" (the user's value was kept), or "late"
# (CUDA had already started, so the value in effect is whatever the context was created with).
decision = None


def request_before_cuda_starts(environ=os.environ, cuda_started=None) -> str:
    """Sets CUDA_DEVICE_MAX_CONNECTIONS=32 unless the user chose a value or CUDA already started; says which."""
    global decision
    if decision is not None:  # importlib.reload(torch_sdma): the first import already decided
        return decision
    if cuda_started is None:
        cuda_started = torch.cuda.is_initialized()
    if environ.get(VARIABLE, "").strip():
        decision = "user"
    elif cuda_started:
        decision = "late"
    else:
        environ[VARIABLE] = str(RECOMMENDED)
        decision = "set"
    return decision


def queues_in_effect(environ=os.environ) -> int:
    raw = environ.get(VARIABLE, "").strip()
    return int(raw) if raw.isdigit() else CUDA_DEFAULT


def hint(environ=os.environ, how=None) -> str:
    """Empty when all-gather waits get enough hardware queues; otherwise what the user should do about it."""
    how = decision if how is None else how
    queues = queues_in_effect(environ)
    if queues >= RECOMMENDED:
        return ""
    if how == "late":
        # Loaded by init_process_group's entry point after torch.cuda.set_device, most often: say both fixes.
        return (f"{VARIABLE} unset, and CUDA had started before torch_sdma was loaded (by `import torch_sdma` "
                f"or by init_process_group), too late to set it; a compute stream that shares a hardware queue "
                f"with an all-gather waits while the all-gather waits for its peers. Export "
                f"{VARIABLE}={RECOMMENDED} where the job is launched, or `import torch_sdma` before CUDA starts "
                f"(before torch.cuda.set_device)")
    return (f"{VARIABLE}={environ.get(VARIABLE, '').strip() or 'unset'} gives {queues} hardware queues; with "
            f"{RECOMMENDED}, compute streams rarely share one with an all-gather that waits for a peer")
