"""TORCH_SDMA_* environment knobs (docs/api.md), read when a group is created into the group's
ProcessGroupSDMA.Options, whose defaults live in C++ (csrc/backend/sdma_options.hpp). A bad value is an error naming
the variable."""
import difflib
import os
import re
import warnings
from typing import Optional

from . import _C

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# The C++ side cuts staging into page-sized pieces (csrc/transport/staging_geometry.hpp).
_PAGE = 4096
# Every TORCH_SDMA_* variable torch_sdma reads, at run time or when it is built (setup.py): any other is a misspelling.
KNOWN_VARIABLES = (
    "TORCH_SDMA_DISABLE",
    "TORCH_SDMA_STAGING_BYTES",
    "TORCH_SDMA_MIN_BYTES",
    "TORCH_SDMA_MIN_BYTES_ACROSS_NODES",
    "TORCH_SDMA_SLOTS",
    "TORCH_SDMA_CHUNK_BYTES",
    "TORCH_SDMA_LOG",
    "TORCH_SDMA_DIRECT",
    "TORCH_SDMA_DIRECT_PEER_WAIT_US",
    "TORCH_SDMA_PEER_LANES",
    "TORCH_SDMA_DELEGATE",
    "TORCH_SDMA_ASYNC_ERROR_HANDLING",
    "TORCH_SDMA_TEST_PSEUDO_NODES",
    "TORCH_SDMA_TEST_FAULT",
    "TORCH_SDMA_TEST_SYNC_ON_CALLER",
    "TORCH_SDMA_TEST_UNORDERED",
    "TORCH_SDMA_CHECK_PLANT_WRONG_BYTE",
    "TORCH_SDMA_BUILD_CUDA",
    "TORCH_SDMA_KEEP_CXX",
)
_warned_unknown = set()


def warn_unknown_variables() -> None:
    """One warning per unknown TORCH_SDMA_* variable and process, naming the closest knob: a misspelt knob would
    otherwise leave its default in force without a word."""
    for name in sorted(os.environ):
        if not name.startswith("TORCH_SDMA_") or name in KNOWN_VARIABLES or name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"torch_sdma: {name} is not a torch_sdma variable and is ignored{hint}", stacklevel=3)


def _parse_bool(name: str, default: Optional[bool]) -> Optional[bool]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 0 or 1")


def _parse_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", raw, re.IGNORECASE)
    if not m:
        raise ValueError(f"{name}={raw!r} is not a byte count; use e.g. 65536, 64K, 64M or 1G")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def _parse_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if not raw.strip().isdigit():
        raise ValueError(f"{name}={raw!r} is not a whole number")
    return int(raw)


# The collectives TORCH_SDMA_DELEGATE may send to the inner backend ("all_to_all": both all-to-all forms; "send" or
# "recv": both, since the two sides of a pair must take the same route).
DELEGABLE = ("all_to_all", "broadcast", "gather", "scatter", "send", "recv")


def _parse_delegate(name: str) -> str:
    raw = os.environ.get(name, "")
    ops = [op.strip() for op in raw.split(",") if op.strip()]
    for op in ops:
        if op not in DELEGABLE:
            raise ValueError(f"{name}={raw!r}: {op!r} is not one of {', '.join(DELEGABLE)}")
    return ",".join(sorted(set(ops)))


def options_from_env(group_size: int) -> "_C.ProcessGroupSDMA.Options":
    """The knobs as the environment sets them, over the C++ defaults. One byte-count variable sets both devices."""
    warn_unknown_variables()
    o = _C.ProcessGroupSDMA.Options()
    o.disable = _parse_bool("TORCH_SDMA_DISABLE", o.disable)
    o.staging_bytes_cuda = _parse_bytes("TORCH_SDMA_STAGING_BYTES", o.staging_bytes_cuda)
    o.staging_bytes_cpu = _parse_bytes("TORCH_SDMA_STAGING_BYTES", o.staging_bytes_cpu)
    o.min_bytes_cuda = _parse_bytes("TORCH_SDMA_MIN_BYTES", o.min_bytes_cuda)
    o.min_bytes_cpu = _parse_bytes("TORCH_SDMA_MIN_BYTES", o.min_bytes_cpu)
    o.min_bytes_cuda_across_nodes = _parse_bytes("TORCH_SDMA_MIN_BYTES_ACROSS_NODES", o.min_bytes_cuda_across_nodes)
    o.slots = _parse_int("TORCH_SDMA_SLOTS", o.slots)
    o.chunk_bytes = _parse_bytes("TORCH_SDMA_CHUNK_BYTES", o.chunk_bytes)
    o.log = _parse_bool("TORCH_SDMA_LOG", o.log)
    # Unset: on for CUDA (off where the caching allocator makes expandable segments, which peers cannot map), off
    # for CPU. Set: both devices.
    direct = _parse_bool("TORCH_SDMA_DIRECT", None)
    if direct is not None:
        o.direct_cuda = o.direct_cpu = direct
    elif _C._caching_allocator_uses_expandable_segments():
        o.direct_cuda = False
        o.direct_cuda_from_allocator = True
    o.direct_peer_wait_us = _parse_int("TORCH_SDMA_DIRECT_PEER_WAIT_US", o.direct_peer_wait_us)
    o.peer_lanes = _parse_int("TORCH_SDMA_PEER_LANES", o.peer_lanes)
    o.delegate = _parse_delegate("TORCH_SDMA_DELEGATE")
    validate(o, group_size)
    return o


ASYNC_ERROR_HANDLING = "TORCH_SDMA_ASYNC_ERROR_HANDLING"


def check_async_error_handling() -> None:
    """TORCH_SDMA_ASYNC_ERROR_HANDLING is the process's, not a group's: the C++ side reads it from the environment
    the first time a failure asks (csrc/runner/async_error_exit.hpp). Checked at every group's creation, so that a
    bad value is refused before any call can fail."""
    raw = os.environ.get(ASYNC_ERROR_HANDLING)
    if raw is None or raw.strip() in ("", "0", "1"):
        return
    raise ValueError(
        f"{ASYNC_ERROR_HANDLING}={raw!r} is not 0 or 1: 1 (the default) ends the process, naming the failure, when "
        "a call fails after it returned; 0 keeps it running with that call's outputs undefined"
    )


def pseudo_node(global_rank: int) -> str:
    """Test-only (docs/api.md): the pseudo-node TORCH_SDMA_TEST_PSEUDO_NODES places this process on, "" when unset.

    The variable lists one node name per global rank (the rank in the default group), e.g. "0,0,1,1" (contiguous),
    "0,1,0,1" (strided) or "a,b,c,a,b,c". A node is a property of a process, as a host is: indexing by global rank
    gives every group, subgroups and strided ones included, the layout real hosts would give it.
    """
    name = "TORCH_SDMA_TEST_PSEUDO_NODES"
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return ""
    names = [n.strip() for n in raw.split(",")]
    if any(not re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names):
        raise ValueError(f"{name}={raw!r}: node names are letters, digits, '_', '.' or '-', separated by commas")
    if global_rank >= len(names):
        raise ValueError(f"{name}={raw!r} names {len(names)} ranks; global rank {global_rank} has no node")
    return names[global_rank]


def validate(o, group_size: int) -> None:
    """Refuses options the C++ side could not honour, naming the variable that sets each."""
    if o.slots < 2 or o.slots & (o.slots - 1):
        raise ValueError(f"TORCH_SDMA_SLOTS={o.slots} must be a power of two, at least 2")
    if o.chunk_bytes % _PAGE:
        raise ValueError(f"TORCH_SDMA_CHUNK_BYTES={o.chunk_bytes} must be 0 (automatic) or a multiple of {_PAGE}")
    if o.direct_peer_wait_us < 0:
        raise ValueError(f"TORCH_SDMA_DIRECT_PEER_WAIT_US={o.direct_peer_wait_us} must be 0 or more")
    if o.peer_lanes < 1:
        raise ValueError(f"TORCH_SDMA_PEER_LANES={o.peer_lanes} must be 1 or more")
    floor = o.slots * max(group_size, 1) * _PAGE
    staging = min(o.staging_bytes_cuda, o.staging_bytes_cpu)
    if staging < floor:
        raise ValueError(
            f"TORCH_SDMA_STAGING_BYTES={staging} is too small for a group of {group_size}: "
            f"it needs at least {floor} bytes ({o.slots} slots x {group_size} ranks x {_PAGE} bytes)"
        )
