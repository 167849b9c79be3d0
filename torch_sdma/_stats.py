"""Which path each collective of a group took: torch_sdma.stats(group)."""
from typing import Dict, Optional

import torch
import torch.distributed as dist


def _sdma_backends(group: Optional[dist.ProcessGroup]):
    group = group or dist.distributed_c10d._get_default_group()
    seen = []
    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
        except RuntimeError:
            continue
        if hasattr(backend, "_sdma_stats") and all(backend is not b for b in seen):
            if backend._sdma_destroyed:
                # A handle kept across destroy_process_group: its numbers would describe a group that is gone.
                raise ValueError(f"torch_sdma: group '{backend._sdma_group_name}' was destroyed "
                                 "(destroy_process_group); it has no stats or path any more")
            seen.append(backend)
    return seen


def stats(group: Optional[dist.ProcessGroup] = None) -> Dict[str, Dict[str, int]]:
    """Calls and output bytes per path ("dma", "dma:direct", "inner:<reason>", "delegated:<op>") of this process.
    "dma:direct" also counts how this rank's pairs (one per peer per call) shared their copies:
    "pairs_each_pushing_own" (both GPUs' copy engines at work) and "pairs_one_moving_both" (one rank had posted no
    buffers within TORCH_SDMA_DIRECT_PEER_WAIT_US of the other, so the later one moved both directions, at half the
    rate).
    "kept_after_failures", present once a failure made this process keep memory for good (docs/errors.md): the bytes
    and items (buffers a peer may still copy with, a destroyed group's memory that peers may still reach) held for
    the life of the process, over all groups."""
    out: Dict[str, Dict[str, int]] = {}
    for backend in _sdma_backends(group):
        for path, v in backend._sdma_stats().items():
            acc = out.setdefault(path, {})
            for field, count in v.items():
                acc[field] = acc.get(field, 0) + count
    from torch_sdma import _C

    kept = _C._kept_after_failures()
    if kept["items"]:
        out["kept_after_failures"] = dict(kept)
    return out


def reset_stats(group: Optional[dist.ProcessGroup] = None) -> None:
    for backend in _sdma_backends(group):
        backend._sdma_reset_stats()


def group_path(group: Optional[dist.ProcessGroup] = None, device: Optional[str] = None,
               op: Optional[str] = None) -> str:
    """"dma", "dma:hierarchical" or "inner:<reason>" for all-gathers of `group` on `device` ("cuda" or "cpu");
    "unknown" before the first one. Without a device: the device whose all-gathers the group serves, CUDA where it
    serves both (backend string "sdma" on a machine with GPUs).
    With `op` (all_to_all_single, all_to_all, broadcast, gather, scatter, send, recv): the path that op last took on
    that device, "dma:direct" or "inner:<reason>", "unknown" before its first call.
    "unavailable:<reason>" where the group's sdma backend serves no such device, e.g. "cpu:gloo,cuda:sdma" on a torch
    without CUDA: "unavailable:this torch has no CUDA (a CPU-only build)"."""
    backends = _sdma_backends(group)
    if op is not None:
        for backend in backends:
            for served in ((device,) if device else ("cuda", "cpu")):
                if backend._sdma_creation_verdict(served)[0]:
                    return backend._sdma_op_path(served, op)
        return "unavailable:" + _why_unserved(group, backends, device)
    for backend in backends:
        for served in ((device,) if device else ("cuda", "cpu")):
            # The verdict's kind is "" for a device this backend does not serve.
            if backend._sdma_creation_verdict(served)[0]:
                return backend._sdma_path(served)
    return "unavailable:" + _why_unserved(group, backends, device)


def _why_unserved(group, backends, device: Optional[str]) -> str:
    """Why no sdma backend of `group` runs `device`'s collectives (all devices when None): the reader of "unknown"
    could not tell a missing GPU from a backend string that sends the device elsewhere."""
    from ._registration import _cuda_unavailable_reason

    if not backends:
        return "this group has no sdma backend (its backend string does not name sdma)"
    cuda_served = any(b._sdma_creation_verdict("cuda")[0] for b in backends)
    cpu_served = any(b._sdma_creation_verdict("cpu")[0] for b in backends)
    reasons = []
    if device in (None, "cuda") and not cuda_served:
        reasons.append(_cuda_unavailable_reason() or "no CUDA backend was created for this group")
    if device in (None, "cpu") and not cpu_served:
        other = _backend_name(group, "cpu")
        reasons.append("CPU tensors go to " + (other or "no backend") + ", as the backend string says")
    return "; ".join(reasons) or "the group's sdma backend does not serve " + (device or "any device")


def _backend_name(group, device: str) -> str:
    try:
        backend = (group or dist.distributed_c10d._get_default_group())._get_backend(torch.device(device))
    except RuntimeError:
        return ""
    return "" if hasattr(backend, "_sdma_stats") else type(backend).__name__.replace("ProcessGroup", "").lower()


def node_layout(group: Optional[dist.ProcessGroup] = None) -> str:
    """How `group`'s members fall into nodes when they span several (docs/multinode.md), e.g.
    "2 nodes x 8 ranks (rails [0,8],[1,9],...)"; "" when they are all on one node."""
    for backend in _sdma_backends(group):
        return backend._sdma_node_layout()
    return ""


def staging_bytes(group: Optional[dist.ProcessGroup] = None) -> int:
    """Memory this process holds for `group` outside the caching allocator: staging (device memory for CUDA, shared
    memory for CPU) and the direct path's bounce area."""
    return sum(b._sdma_staging_bytes() for b in _sdma_backends(group))


def peer_mapped_bytes(group: Optional[dist.ProcessGroup] = None) -> int:
    """Bytes of the other members' device memory that this process maps for `group`'s direct path (their memory,
    which they cannot give back while it is mapped here; unmapped once they free it and all-gather again)."""
    return sum(b._sdma_peer_mapped_bytes() for b in _sdma_backends(group))
