"""TORCH_SDMA_* knobs (docs/api.md), read when a group is created: a bad value is a ValueError naming the
variable; TORCH_SDMA_DISABLE and TORCH_SDMA_MIN_BYTES route all-gathers to the inner backend and say so in
torch_sdma.stats / group_path; results stay bit-exact either way. The same knobs as a ProcessGroupSDMA.Options
passed as pg_options."""
import os

import torch
import torch.distributed as dist

from checks.allgather import AG
from checks.data import stats_calls
from mp_harness import run_group

CPU = torch.device("cpu")

BAD = [
    ("TORCH_SDMA_STAGING_BYTES", "abc"),
    ("TORCH_SDMA_STAGING_BYTES", "12Q"),
    ("TORCH_SDMA_STAGING_BYTES", "-1"),
    ("TORCH_SDMA_DISABLE", "maybe"),
    ("TORCH_SDMA_MIN_BYTES", "lots"),
    ("TORCH_SDMA_MIN_BYTES_ACROSS_NODES", "16 MiB please"),
    ("TORCH_SDMA_LOG", "loud"),
    ("TORCH_SDMA_CHUNK_BYTES", "100"),
    ("TORCH_SDMA_CHUNK_BYTES", "6000"),
    ("TORCH_SDMA_DIRECT_PEER_WAIT_US", "-5"),
    ("TORCH_SDMA_DIRECT_PEER_WAIT_US", "soon"),
    ("TORCH_SDMA_DIRECT", "sometimes"),
    ("TORCH_SDMA_PEER_LANES", "0"),
    ("TORCH_SDMA_PEER_LANES", "many"),
    ("TORCH_SDMA_ASYNC_ERROR_HANDLING", "2"),
    ("TORCH_SDMA_ASYNC_ERROR_HANDLING", "yes"),
]


def knobs_body(ctx):
    import torch_sdma

    W = ctx.world
    ref = dist.new_group(backend="gloo")
    cases = []

    for var, val in BAD:

        def bad(var=var, val=val):
            os.environ[var] = val
            try:
                try:
                    dist.new_group()
                except ValueError as e:
                    assert var in str(e), f"ValueError does not name {var}: {e}"
                else:
                    raise AssertionError(f"{var}={val!r}: new_group() succeeded")
            finally:
                os.environ.pop(var, None)
            # the next group is fine
            g = dist.new_group()
            AG(g, ref, CPU, f"afterbad{var}{val}").into_tensor("x", (100,), torch.float32)

        cases.append((f"bad_value[{var}={val}]", bad))

    for val in ("65536", "64K", "1M", "64k", "128KiB"):

        def good(val=val):
            os.environ["TORCH_SDMA_STAGING_BYTES"] = val
            try:
                g = dist.new_group()
            finally:
                os.environ.pop("TORCH_SDMA_STAGING_BYTES", None)
            ag = AG(g, ref, CPU, f"good{val}")
            ag.into_tensor("x", (300001,), torch.uint8)
            ag.into_tensor("y", (17,), torch.float32, inplace=True)

        cases.append((f"good_staging_value[{val}]", good))

    def group_with(name, value, **kw):
        """A new group created while one knob is set (knobs are read at group creation)."""
        os.environ[name] = value
        try:
            return dist.new_group(**kw)
        finally:
            os.environ.pop(name, None)

    def disabled():
        g = group_with("TORCH_SDMA_DISABLE", "1")
        ag = AG(g, ref, CPU, "dis")
        torch_sdma.reset_stats(g)
        ag.into_tensor("a", (1000,), torch.float32)
        ag.as_list("b", (10,), torch.int64)
        ag.coalesced_cm("c", [((5,), torch.float32), ((7,), torch.float32)])
        # mixed dtypes: gloo's coalesced all-gather would convert the bf16 NaNs among these random bits
        ag.coalesced_cm("m", [((5000,), torch.float32), ((3,), torch.uint8), ((7001,), torch.bfloat16)])
        ag.into_tensor("d", (4096,), torch.uint8, inplace=True)
        s = torch_sdma.stats(g)
        assert "dma" not in s, f"TORCH_SDMA_DISABLE=1 but all-gathers took the dma path: {s}"
        key = "inner:TORCH_SDMA_DISABLE=1"
        assert key in s and s[key]["calls"] >= 4, s
        assert torch_sdma.group_path(g, device="cpu") == key, torch_sdma.group_path(g, device="cpu")

    cases.append(("TORCH_SDMA_DISABLE=1", disabled))

    def min_bytes():
        g = group_with("TORCH_SDMA_MIN_BYTES", "4K")
        ag = AG(g, ref, CPU, "minb")
        torch_sdma.reset_stats(g)
        small = 4096 // W - 1  # output bytes just below the threshold
        ag.into_tensor("small", (small,), torch.uint8)
        s = torch_sdma.stats(g)
        key = "inner:below TORCH_SDMA_MIN_BYTES"
        assert s.get(key, {}).get("calls") == 1 and "dma" not in s, s
        assert s[key]["bytes"] == W * small, s
        ag.into_tensor("big", (4096,), torch.uint8)  # W * 4096 output bytes: above
        s = torch_sdma.stats(g)
        assert s.get("dma", {}).get("calls") == 1, s
        assert s["dma"]["bytes"] == W * 4096, s
        ag.into_tensor("exact", (4096 // W + (1 if 4096 % W else 0),), torch.uint8)  # >= threshold: dma
        s = torch_sdma.stats(g)
        assert s.get("dma", {}).get("calls") == 2, f"an all-gather of >= TORCH_SDMA_MIN_BYTES did not take dma: {s}"

    cases.append(("TORCH_SDMA_MIN_BYTES=4K", min_bytes))

    def min_bytes_across_nodes():
        # Its own variable: it sets the threshold of groups that span nodes and leaves the one-node threshold alone.
        o = group_with("TORCH_SDMA_MIN_BYTES_ACROSS_NODES", "64K")._get_backend(CPU)._sdma_options
        assert (o.min_bytes_cuda_across_nodes, o.min_bytes_cuda, o.min_bytes_cpu) == (64 << 10, -1, 0), (
            o.min_bytes_cuda_across_nodes, o.min_bytes_cuda, o.min_bytes_cpu)
        o = group_with("TORCH_SDMA_MIN_BYTES", "8M")._get_backend(CPU)._sdma_options
        assert (o.min_bytes_cuda_across_nodes, o.min_bytes_cuda) == (16 << 20, 8 << 20), (
            o.min_bytes_cuda_across_nodes, o.min_bytes_cuda)

    cases.append(("TORCH_SDMA_MIN_BYTES_ACROSS_NODES", min_bytes_across_nodes))

    def path_unknown_then_dma():
        g = dist.new_group()
        p0 = torch_sdma.group_path(g, device="cpu")
        assert p0 in ("unknown", "dma"), p0
        AG(g, ref, CPU, "pth").into_tensor("x", (10,), torch.float32)
        assert torch_sdma.group_path(g, device="cpu") == "dma", torch_sdma.group_path(g, device="cpu")
        assert stats_calls(torch_sdma.stats(g), lambda k: k == "dma")[0] == 1, torch_sdma.stats(g)

    cases.append(("group_path", path_unknown_then_dma))

    def small_chunks():
        # A message cut into many chunks that cycle through the slots: still bit-exact.
        g = group_with("TORCH_SDMA_CHUNK_BYTES", "4K")
        ag = AG(g, ref, CPU, "chunk")
        ag.into_tensor("x", (50001,), torch.float32)
        ag.coalesced_cm("c", [((3001,), torch.float32), ((4099,), torch.uint8)])

    cases.append(("TORCH_SDMA_CHUNK_BYTES=4K", small_chunks))

    def options_as_pg_options():
        # The knobs as an object instead of the environment: the environment is then not read.
        o = torch_sdma.ProcessGroupSDMA.Options()
        assert (o.staging_bytes_cuda, o.min_bytes_cuda, o.slots) == (256 << 20, -1, 2), "C++ defaults moved"
        assert o.min_bytes_cuda_across_nodes == 16 << 20, "C++ default of the across-nodes threshold moved"
        assert (o.direct_cuda, o.direct_cpu) == (True, False), "C++ defaults of the direct path moved"
        o.min_bytes_cpu = 4096
        o.staging_bytes_cpu = 64 << 10
        g = group_with("TORCH_SDMA_DISABLE", "1", pg_options=o)
        backend = g._get_backend(CPU)
        assert backend._sdma_options.staging_bytes_cpu == 64 << 10, "pg_options were not used"
        ag = AG(g, ref, CPU, "opts")
        torch_sdma.reset_stats(g)
        ag.into_tensor("small", (100,), torch.uint8)
        ag.into_tensor("big", (70001,), torch.float32)  # larger than the 64K of staging
        s = torch_sdma.stats(g)
        assert s.get("inner:below TORCH_SDMA_MIN_BYTES", {}).get("calls") == 1 and s["dma"]["calls"] == 1, s
        # Options the C++ side could not honour are refused, naming the variable that sets the field.
        for field, bad, var in (("slots", 3, "TORCH_SDMA_SLOTS"), ("chunk_bytes", 100, "TORCH_SDMA_CHUNK_BYTES")):
            good = getattr(o, field)
            setattr(o, field, bad)
            try:
                dist.new_group(pg_options=o)
            except ValueError as e:
                assert var in str(e), e
            else:
                raise AssertionError(f"Options with {field}={bad!r} were accepted")
            setattr(o, field, good)

    cases.append(("ProcessGroupSDMA.Options as pg_options", options_as_pg_options))

    def direct_default_and_override():
        # Unset: CUDA on unless the caching allocator makes expandable segments, CPU off. Set: both devices.
        expandable = torch_sdma._C._caching_allocator_uses_expandable_segments()
        o = dist.new_group()._get_backend(CPU)._sdma_options
        assert (o.direct_cuda, o.direct_cpu) == (not expandable, False), (o.direct_cuda, o.direct_cpu, expandable)
        for value, on in (("1", True), ("0", False), ("off", False)):
            o = group_with("TORCH_SDMA_DIRECT", value)._get_backend(CPU)._sdma_options
            assert (o.direct_cuda, o.direct_cpu) == (on, on), (value, o.direct_cuda, o.direct_cpu)

    cases.append(("TORCH_SDMA_DIRECT default and override", direct_default_and_override))

    return ctx.run_cases(cases)


def test_env_knobs():
    res = run_group(knobs_body, 2, "sdma", timeout=180, pg_timeout_s=20,
                    env={"TORCH_SDMA_STAGING_BYTES": None, "TORCH_SDMA_DISABLE": None, "TORCH_SDMA_MIN_BYTES": None,
                         "TORCH_SDMA_MIN_BYTES_ACROSS_NODES": None, "TORCH_SDMA_DIRECT": None})
    res.check()


def min_bytes_by_size_body(ctx):
    """TORCH_SDMA_MIN_BYTES unset: none below three ranks, 32 MiB for CUDA collectives from three (sdma_options.hpp),
    none for CPU; set, what it says, whatever the size. Subgroups of 2 and 3 of the 3 ranks, as every member sees
    them."""
    pair = dist.new_group(ranks=[0, 1])
    whole = dist.new_group()
    os.environ["TORCH_SDMA_MIN_BYTES"] = "1M"
    try:
        set_whole = dist.new_group()
    finally:
        os.environ.pop("TORCH_SDMA_MIN_BYTES")
    seen = {}
    if ctx.rank < 2:
        b = pair._get_backend(CPU)
        seen["pair"] = (b._sdma_options.min_bytes_cuda, b._sdma_collective_min_bytes("cuda"),
                        b._sdma_collective_min_bytes("cpu"))
        assert seen["pair"] == (-1, 0, 0), seen
    b = whole._get_backend(CPU)
    seen["whole"] = (b._sdma_collective_min_bytes("cuda"), b._sdma_collective_min_bytes("cpu"))
    assert seen["whole"] == (32 << 20, 0), seen
    b = set_whole._get_backend(CPU)
    seen["set"] = (b._sdma_collective_min_bytes("cuda"), b._sdma_collective_min_bytes("cpu"))
    assert seen["set"] == (1 << 20, 1 << 20), seen
    return seen


def test_min_bytes_default_by_group_size():
    res = run_group(min_bytes_by_size_body, 3, "sdma", timeout=120, pg_timeout_s=20,
                    env={"TORCH_SDMA_MIN_BYTES": None})
    res.check()
