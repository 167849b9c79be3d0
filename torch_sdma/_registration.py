"""The creator torch.distributed calls for every group whose backend string names "sdma"."""
import logging
import sys
import uuid

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

from . import _C, _config, _hw_queues
from ._torch_version import torch_version

logger = logging.getLogger("torch_sdma")

BACKEND_NAME = "sdma"
_DEVICE_PROBE_KEY = "torch_sdma_device_probe"


def _first_served_device(store) -> str:
    """torch hands the creator PrefixStore("<device>/", group store) for the first device the backend serves.

    Devices are registered as ["cpu", "cuda"], so "cpu" means this group's CPU tensors come here (backend string
    "sdma" or "cpu:sdma") and "cuda" means only CUDA tensors do ("cpu:gloo,cuda:sdma", "cuda:sdma").
    """
    # A key of this call's own: a store outlives destroy_process_group (torchrun's agent store, a store the caller
    # passes again), and a probe left there by an earlier group under the other device's prefix would make this
    # group serve that earlier string's devices.
    key = f"{_DEVICE_PROBE_KEY}/{uuid.uuid4().hex}"
    try:
        store.set(key, "1")
        parent = store.underlying_store
        try:
            for device in ("cuda", "cpu"):
                # PrefixStore joins prefix and key with "/", and torch's prefix already ends in one.
                if any(parent.check([f"{device}{sep}{key}"]) for sep in ("//", "/")):
                    return device
        finally:
            try:
                store.delete_key(key)
            except Exception:  # a store without deletion keeps a few bytes: harmless, the key is never read again
                pass
    except Exception:  # an unusual store: serve both, which is always correct
        pass
    return "cpu"


def _cuda_unavailable_reason() -> str:
    if torch.version.cuda is None and torch.version.hip is None:
        return "this torch has no CUDA (a CPU-only build)"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process"
    return ""


def _sync_sequence_numbers(backend) -> None:
    # What torch does for its own gloo and nccl groups; a deprecated no-op from torch 2.14 on.
    if torch_version() < (2, 14):
        backend._set_sequence_number_for_group()


def _inner_gloo(store, opts):
    gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), opts.group_rank, opts.group_size, timeout=opts.timeout)
    gloo.options.global_ranks_in_group = opts.global_ranks_in_group
    gloo.options.group_name = opts.group_id
    _sync_sequence_numbers(gloo)
    return gloo


def _inner_nccl(store, opts, backend_options):
    if isinstance(backend_options, dist.ProcessGroupNCCL.Options):
        nccl_opts = backend_options  # Megatron and others pass their own (priority streams, NCCL config)
    else:
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts.is_high_priority_stream = False
    nccl_opts._timeout = opts.timeout
    nccl_opts.global_ranks_in_group = opts.global_ranks_in_group
    nccl_opts.group_name = opts.group_id
    nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), opts.group_rank, opts.group_size, nccl_opts)
    _sync_sequence_numbers(nccl)
    return nccl


def _rail_backend(store, rank, size, device, timeout, name):
    """The inner backend of one rail of a group that spans nodes (docs/multinode.md): the ranks with one local index
    on every node, over a store of the rail's own. The C++ side calls it at the group's first hierarchical
    all-gather, on every member at once."""
    if device == "cuda":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts.is_high_priority_stream = False
        nccl_opts._timeout = timeout
        nccl_opts.group_name = name
        backend = dist.ProcessGroupNCCL(store, rank, size, nccl_opts)
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
    _sync_sequence_numbers(backend)
    return backend


def _options(opts, backend_options):
    """The group's knobs: a ProcessGroupSDMA.Options passed as pg_options as it is, else the environment's."""
    _config.check_async_error_handling()
    if isinstance(backend_options, _C.ProcessGroupSDMA.Options):
        _config.validate(backend_options, opts.group_size)
        options = backend_options
    else:
        options = _config.options_from_env(opts.group_size)
    options._timeout = opts.timeout
    options.group_name = str(opts.group_id)
    # torch passes no list for the default group, whose ranks are the global ones.
    options.global_ranks = list(opts.global_ranks_in_group or range(opts.group_size))
    options.test_pseudo_node = _config.pseudo_node(options.global_ranks[opts.group_rank])
    return options


def _store_of_this_instance(store, size: int):
    """A prefix of its own for this group's keys. A group made again under the same name after
    destroy_process_group gets the same store prefix from torch, in a store that may outlive the first (torchrun's
    agent store): the keys the first left there (shared-memory names, the inner backends' addresses) would be read
    as the new group's. Every member adds one to a counter at creation, and all members of one creation add before
    any finishes it (the settings agreement waits for all), so the count tells each the same generation."""
    try:
        n = int(store.add("torch_sdma_creations", 1))
    except Exception:  # a store without add: the keys stay where torch put them
        return store
    return PrefixStore(f"g{(n - 1) // size}/", store)


def create_backend(opts, backend_options):
    options = _options(opts, backend_options)
    served = _first_served_device(opts.store)
    store = _store_of_this_instance(opts.store, opts.group_size)
    inner_cpu = _inner_gloo(store, opts) if served == "cpu" else None
    cuda_unavailable = _cuda_unavailable_reason()
    inner_cuda = None if cuda_unavailable else _inner_nccl(store, opts, backend_options)
    pg = _C.ProcessGroupSDMA(store, opts.group_rank, opts.group_size, options, inner_cpu, inner_cuda,
                             cuda_unavailable, _rail_backend)
    pg._inner_cpu = inner_cpu
    pg._inner_cuda = inner_cuda
    if options.log and opts.group_rank == 0:
        _log_group_paths(pg, opts, options)
    return pg


def _describe(verdict, dma: str, between_nodes: str, layout: str) -> str:
    kind, reason = verdict
    if kind == "dma" and reason == "hierarchical":
        return f"{dma} inside each node, {between_nodes} between nodes: hierarchical over {layout}"
    if kind == "dma":
        return dma
    return f"the inner backend ({reason}{'; ' + layout if layout else ''})"


def _queues_part() -> str:
    queues = _hw_queues.queues_in_effect()
    source = " (set by torch_sdma)" if _hw_queues.decision == "set" else ""
    hint = _hw_queues.hint()
    return f"{queues} hardware queues{source}" + (f": {hint}" if hint else "")


def _human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _to_inner_backend(min_bytes: int) -> str:
    """TORCH_SDMA_MIN_BYTES in words: which all-gathers the inner backend gets instead."""
    if min_bytes <= 0:
        return "no size goes to the inner backend"
    return f"outputs below {_human_bytes(min_bytes)} go to the inner backend"


def _device_part(device: str, verdict, options, layout: str, collective_min_bytes: int) -> str:
    """What one device's all-gathers do in this group, with only that device's settings."""
    cuda = device == "cuda"
    dma, between = ("copy engines", "NCCL") if cuda else ("shared memory", "gloo")
    part = f"{'CUDA' if cuda else 'CPU'} all-gathers -> " + _describe(verdict, dma, between, layout)
    if verdict[0] != "dma":
        return part
    staging = options.staging_bytes_cuda if cuda else options.staging_bytes_cpu
    # TORCH_SDMA_MIN_BYTES as this group applies it (unset: by its size, for CUDA); a CUDA group that spans nodes
    # compares with TORCH_SDMA_MIN_BYTES_ACROSS_NODES as well (docs/multinode.md).
    min_bytes = collective_min_bytes
    if cuda and layout:
        min_bytes = max(min_bytes, options.min_bytes_cuda_across_nodes)
    direct = options.direct_cuda if cuda else options.direct_cpu
    part += (f" (staging {staging >> 20} MiB per rank, {_to_inner_backend(min_bytes)}"
             + f", direct path {'on' if direct else 'off'})")
    return part + ("; " + _queues_part() if cuda else "")


def _log_group_paths(pg, opts, options) -> None:
    # Only the devices this group serves: a CPU-only run hears nothing of CUDA staging, and the reverse.
    layout = pg._sdma_node_layout()
    parts = []
    for device in ("cuda", "cpu"):
        verdict = pg._sdma_creation_verdict(device)
        if verdict[0]:
            parts.append(_device_part(device, verdict, options, layout, pg._sdma_collective_min_bytes(device)))
    if not pg._sdma_creation_verdict("cuda")[0] and pg._inner_cpu is None:
        parts.append("CUDA collectives unavailable in this process: " + _cuda_unavailable_reason())
    line = f"torch_sdma: group '{opts.group_id}' ({opts.group_size} ranks): " + "; ".join(parts)
    if logger.hasHandlers():
        logger.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def perform_nocolor_split(self, device) -> None:
    """torch calls this on non-members when a bound default group creates a subgroup. The inner NCCL backends
    of new groups are created fresh, not split, so there is nothing to take part in."""
