"""torch_sdma: a torch.distributed backend whose all-gathers move data with DMA engines.

    import torch_sdma
    torch.distributed.init_process_group("cpu:gloo,cuda:sdma")
"""
import atexit

import torch.distributed as dist

from . import _hw_queues

# Before anything below can start CUDA: the hardware-queue count is fixed when CUDA creates its context.
_hw_queues.request_before_cuda_starts()

from . import _C, _default_backend, _nccl_split_source
from ._registration import BACKEND_NAME, create_backend, perform_nocolor_split
from ._stats import group_path, node_layout, peer_mapped_bytes, reset_stats, staging_bytes, stats

__all__ = ["stats", "reset_stats", "group_path", "node_layout", "staging_bytes", "peer_mapped_bytes",
           "ProcessGroupSDMA"]

ProcessGroupSDMA = _C.ProcessGroupSDMA
ProcessGroupSDMA.perform_nocolor_split = perform_nocolor_split


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu", "cuda"])
    _default_backend.apply(BACKEND_NAME)
    _nccl_split_source.apply()


_register()
# Before the interpreter finalizes, our threads stop letting go of tensors and running callbacks: once it does, a
# thread that takes the GIL is ended in a way that aborts the process (csrc/work/interpreter_exit.hpp).
atexit.register(_C._interpreter_exiting)
