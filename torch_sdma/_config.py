"""TORCH_SDMA_* environment knobs, read when a group is created. A bad value is an error naming the variable."""
import os
import re
from dataclasses import dataclass

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_MIN_CHUNK = 4096


@dataclass(frozen=True)
class Config:
    disable: bool
    staging_bytes: int
    min_bytes: int
    slots: int
    log: bool


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


def from_env(group_size: int) -> Config:
    cfg = Config(
        disable=_parse_bool("TORCH_SDMA_DISABLE", False),
        staging_bytes=_parse_bytes("TORCH_SDMA_STAGING_BYTES", 64 << 20),
        min_bytes=_parse_bytes("TORCH_SDMA_MIN_BYTES", 0),
        slots=_parse_bytes("TORCH_SDMA_SLOTS", 2),
        log=_parse_bool("TORCH_SDMA_LOG", True),
    )
    if cfg.slots < 2 or cfg.slots & (cfg.slots - 1):
        raise ValueError(f"TORCH_SDMA_SLOTS={cfg.slots} must be a power of two, at least 2")
    floor = cfg.slots * max(group_size, 1) * _MIN_CHUNK
    if cfg.staging_bytes < floor:
        raise ValueError(
            f"TORCH_SDMA_STAGING_BYTES={cfg.staging_bytes} is too small for a group of {group_size}: "
            f"it needs at least {floor} bytes ({cfg.slots} slots x {group_size} ranks x {_MIN_CHUNK} bytes)"
        )
    return cfg
