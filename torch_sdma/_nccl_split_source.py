"""new_group(backend="nccl") beside a default sdma group bound to a GPU.

When the default group is bound to a device (init_process_group(device_id=...)), torch builds every new NCCL
group by splitting the communicator of the default group's CUDA backend, and assumes that backend is a
ProcessGroupNCCL: with sdma there, new_group(backend="nccl") fails (a TypeError, seen on torch 2.11; 2.14's
code raises an AssertionError). This module gives NCCL no split source in that case, so it creates its
communicator from scratch, as it does beside an unbound default group. Groups of the sdma backend itself are
unaffected: torch never hands a split source to a registered backend's creator."""
import torch.distributed.distributed_c10d as c10d

from . import _C


def apply() -> None:
    original = getattr(c10d, "_get_split_source", None)
    if original is None or getattr(original, "_sdma_wrapped", False):
        return

    def _get_split_source(pg):
        source = original(pg)
        return None if isinstance(source, _C.ProcessGroupSDMA) else source

    _get_split_source._sdma_wrapped = True
    _get_split_source.__doc__ = original.__doc__
    c10d._get_split_source = _get_split_source
