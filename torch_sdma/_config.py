"""TORCH_SDMA_* environment knobs, read when a group is created. A bad value is an error naming the variable."""
import os
import re
from dataclasses import dataclass

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_MIN_CHUNK = 4096
# Defaults per device, each overridden by its environment variable for both devices. GPU, measured on 2x H200
# (README): 256 MiB of staging lets 1 GiB all-gathers run in 128 MiB chunks on two ranks. At 16 MiB of output the copy
# engines did not beat NCCL (ratio 0.99-1.01 in three runs of session 4, 0.97-0.98 in three of session 5); at 32 MiB
# they did in every run (1.04-1.14). So they start at 20 MiB, which keeps ZeRO-3's 22 and 24 MiB parameter fetches of
# the 1B model on them. CPU: one worker copies serially, so a small staging area loses nothing.
DEFAULT_STAGING_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}
DEFAULT_MIN_BYTES = {"cuda": 20 << 20, "cpu": 0}


@dataclass(frozen=True)
class Config:
    disable: bool
    staging_bytes: dict  # device type -> bytes
    min_bytes: dict  # device type -> bytes
    slots: int
    chunk_bytes: int  # 0: automatic
    log: bool
    direct: bool  # all_gather_into_tensor straight between the members' memory (CPU only so far)


def _parse_bool(name: str, default: bool) -> bool:
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


def _per_device(name: str, defaults: dict) -> dict:
    if os.environ.get(name, "").strip() == "":
        return dict(defaults)
    value = _parse_bytes(name, 0)
    return {device: value for device in defaults}


def from_env(group_size: int) -> Config:
    cfg = Config(
        disable=_parse_bool("TORCH_SDMA_DISABLE", False),
        staging_bytes=_per_device("TORCH_SDMA_STAGING_BYTES", DEFAULT_STAGING_BYTES),
        min_bytes=_per_device("TORCH_SDMA_MIN_BYTES", DEFAULT_MIN_BYTES),
        slots=_parse_int("TORCH_SDMA_SLOTS", 2),
        chunk_bytes=_parse_bytes("TORCH_SDMA_CHUNK_BYTES", 0),
        log=_parse_bool("TORCH_SDMA_LOG", True),
        direct=_parse_bool("TORCH_SDMA_DIRECT", False),
    )
    if cfg.slots < 2 or cfg.slots & (cfg.slots - 1):
        raise ValueError(f"TORCH_SDMA_SLOTS={cfg.slots} must be a power of two, at least 2")
    if cfg.chunk_bytes % _MIN_CHUNK:
        raise ValueError(
            f"TORCH_SDMA_CHUNK_BYTES={cfg.chunk_bytes} must be 0 (automatic) or a multiple of {_MIN_CHUNK}"
        )
    floor = cfg.slots * max(group_size, 1) * _MIN_CHUNK
    if min(cfg.staging_bytes.values()) < floor:
        raise ValueError(
            f"TORCH_SDMA_STAGING_BYTES={min(cfg.staging_bytes.values())} is too small for a group of {group_size}: "
            f"it needs at least {floor} bytes ({cfg.slots} slots x {group_size} ranks x {_MIN_CHUNK} bytes)"
        )
    return cfg
