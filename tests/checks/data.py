"""Random inputs, poisoned outputs and byte-exact comparison, for every check.

Every check compares bytes exactly. Inputs are random (seeded per case and per rank, so that every rank can
also rebuild every peer's input locally); outputs are poisoned first with the bitwise NOT of the expected
bytes, so that any byte the backend fails to write differs from what is expected.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
import zlib

import torch
import torch.distributed as dist

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _every_dtype():
    """Every dtype this torch can hold data in: it makes, copies and views as bytes a tensor of it (not quantized,
    bit-packed or the sub-byte placeholders int1-7/uint1-7, which torch cannot even copy)."""
    found = []
    for name in sorted(dir(torch)):
        dt = getattr(torch, name)
        if not isinstance(dt, torch.dtype) or dt in found or name.startswith(("bits", "q")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "experimental" complex32 and bcomplex32
                torch.empty(4, dtype=dt).copy_(torch.empty(4, dtype=dt)).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found.append(dt)
    return found


# For "every dtype at every size": NCCL and gloo refuse some of these (int16, uint16-64, float8 on gloo), which the
# inner path then gathers as bytes.
EVERY_DTYPE = _every_dtype()

# SDMA_TEST_SHARE_GPU=1: the two-rank GPU tests run with both ranks on one GPU. NCCL refuses two ranks of one
# communicator on one GPU, so there the expected bytes are rebuilt locally from every rank's seed instead of coming from
# an NCCL reference group, and the cases about NCCL itself skip with this reason.
SHARE_GPU = os.environ.get("SDMA_TEST_SHARE_GPU") == "1"
NCCL_SHARED_REASON = "NCCL refuses two ranks on one GPU (SDMA_TEST_SHARE_GPU=1)"

TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

# words NCCL uses (ProcessGroupNCCL.cpp), that the sdma backend must reuse
MSG_SIZE = "output tensor size must be equal to world_size times input tensor size"
MSG_TYPE = "output tensor must have the same type as input tensor"
MSG_CONTIG = "Tensors must be contiguous"

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", message=".*is deprecated.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*will be deprecated.*", category=FutureWarning)


# ----------------------------------------------------------------------------------------------- data
def seed_of(name, rank):
    return zlib.crc32(f"{name}|{rank}".encode()) & 0x7FFFFFFF


def rand(name, rank, shape, dtype, device="cpu", kind="bytes"):
    """Random tensor for (case name, rank). kind: 'bytes' (any bit pattern), 'normal', 'int' (small ints)."""
    if isinstance(shape, int):
        shape = (shape,)
    g = torch.Generator()
    g.manual_seed(seed_of(name, rank))
    n = math.prod(shape)
    if dtype == torch.bool:
        t = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
    elif kind == "normal" and (dtype.is_floating_point or dtype.is_complex):
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    elif kind == "int":
        t = torch.randint(-8, 9, (n,), generator=g, dtype=torch.int64).to(dtype)
        if dtype.is_floating_point:
            t = t.to(dtype)
    else:
        es = torch.empty((), dtype=dtype).element_size()
        t = torch.randint(0, 256, (n * es,), generator=g, dtype=torch.uint8).view(dtype)
    return t.reshape(shape).to(device)


def raw(t):
    """The bytes of a tensor, flat uint8 on the CPU."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).cpu()


def nbytes(t):
    return t.numel() * t.element_size()


def poison_(t, expected_bytes=None, pattern=0xA5):
    """Fill t's bytes with NOT(expected) (so every byte differs from what is expected), or with `pattern`."""
    with torch.no_grad():
        b = t.view(-1).view(torch.uint8) if t.numel() else t.reshape(-1).view(torch.uint8)
        if expected_bytes is None:
            b.fill_(pattern)
        else:
            assert expected_bytes.numel() == b.numel(), (expected_bytes.numel(), b.numel())
            b.copy_(torch.bitwise_not(expected_bytes).to(b.device))
    return t


def assert_bytes_equal(got, expected, what=""):
    g = raw(got)
    e = raw(expected)
    e = e.cpu()
    if g.numel() != e.numel():
        raise AssertionError(f"{what}: {g.numel()} bytes, expected {e.numel()}")
    if not torch.equal(g, e):
        bad = (g != e).nonzero().flatten()
        first = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {e.numel()} bytes differ; first at byte {first}: "
            f"got 0x{int(g[first]):02x} expected 0x{int(e[first]):02x}; "
            f"last at byte {int(bad[-1])}; poison-like bytes (unwritten): "
            f"{int((g[bad] == torch.bitwise_not(e[bad])).sum())}"
        )


def expected_concat(name, ranks, shape, dtype, kind="bytes", device="cpu"):
    """Bytes of the concatenation of every member's input, rebuilt locally from the seeds (on `device`, for a
    comparison where the output is)."""
    return torch.cat([raw(rand(name, r, shape, dtype, "cpu", kind)) for r in ranks]).to(device)


def group_ranks(g):
    """Global ranks of g's members, in group-rank order."""
    return [dist.get_global_rank(g, i) for i in range(dist.get_world_size(g))]


# -------------------------------------------------------------------------------------------- helpers
def call_both(ref_fn, sdma_fn, what, sdma_may_support_more=False):
    """Run ref_fn() then sdma_fn(). If the reference raised, the sdma call must raise the same type.

    Returns (ref_result, sdma_result, ref_exc)."""
    ref_exc = None
    ref_res = None
    try:
        ref_res = ref_fn()
    except Exception as e:  # noqa: BLE001
        ref_exc = e
    try:
        res = sdma_fn()
    except Exception as e:  # noqa: BLE001
        if ref_exc is None:
            raise AssertionError(f"{what}: the reference succeeded but sdma raised {type(e).__name__}: {e}") from e
        if not isinstance(e, type(ref_exc)) and not isinstance(ref_exc, type(e)):
            raise AssertionError(
                f"{what}: reference raised {type(ref_exc).__name__}: {ref_exc}; sdma raised a different kind: "
                f"{type(e).__name__}: {e}"
            ) from e
        return None, None, ref_exc
    if ref_exc is not None and not sdma_may_support_more:
        raise AssertionError(
            f"{what}: reference raised {type(ref_exc).__name__}: {ref_exc} but sdma silently succeeded"
        )
    return ref_res, res, ref_exc


def wait_work(w):
    if w is not None:
        w.wait()


# The stats keys of an eager all-gather on the DMA path: staging, or the direct path (all_gather_into_tensor, on by
# default for CUDA tensors).
DMA_KEYS = ("dma", "dma:direct")


def stats_calls(stats, pred):
    c = b = 0
    for k, v in stats.items():
        if pred(k):
            c += int(v["calls"])
            b += int(v["bytes"])
    return c, b


def normalized(k):
    return k.lower().replace("_", "").replace(" ", "")


@contextlib.contextmanager
def coalescing_manager(group, device=None, async_ops=False):
    """dist._coalescing_manager that never leaves the group in 'coalescing' state after an error
    (torch leaves its op list behind when start_coalescing raises, which silently swallows every later
    collective on that group)."""
    try:
        with dist._coalescing_manager(group=group, device=device, async_ops=async_ops) as cm:
            yield cm
    except BaseException:
        dist.distributed_c10d._world.pg_coalesce_state.pop(group, None)
        raise
