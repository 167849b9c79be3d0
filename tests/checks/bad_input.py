"""Bad input to every all-gather form: sdma must raise what NCCL raises, in NCCL's words, before it enqueues."""
from __future__ import annotations

import torch
import torch.distributed as dist

from checks.allgather import AG
from checks.data import MSG_CONTIG, MSG_SIZE, MSG_TYPE, assert_bytes_equal, coalescing_manager, poison_, raw


def bad_input_cases(g, dev, tag, ref=None, compare_messages=False):
    """Bad input raises NCCL's error before anything is enqueued; the next valid all-gather still works.

    With compare_messages and ref (an nccl group), the same bad call on ref must raise the same type and
    the same first line of message."""
    ag_ok = AG(g, g, dev, tag)  # valid follow-up checked against the locally rebuilt inputs
    W = dist.get_world_size(g)
    cases = []

    def follow_up(k):
        x = ag_ok.x(f"fu{k}", (257,), torch.float32)
        e = ag_ok.local_expected(f"fu{k}", (257,), torch.float32)
        o = poison_(torch.empty(W * 257, device=dev), e)
        dist.all_gather_into_tensor(o, x, group=g)
        assert_bytes_equal(o, e, "valid all-gather after the bad one")
        ol = [poison_(torch.empty(257, device=dev)) for _ in range(W)]
        dist.all_gather(ol, x, group=g)
        assert_bytes_equal(torch.cat([raw(t) for t in ol]), e, "valid list all-gather after the bad one")

    def expect(k, call, exc_type, msg, compare=None):
        # the reference (NCCL) is asked too only where it checks: it does not check list lengths (a short list
        # would make it write out of bounds) nor the sizes inside a coalesced all-gather
        compare = compare_messages and (msg is not None if compare is None else compare)

        def raised(grp, async_op):
            """The exception the call (and its wait) raised on grp, or None."""
            try:
                w = call(grp, async_op)
                if w is not None:
                    w.wait()
            except Exception as e:  # noqa: BLE001
                return e
            return None

        def fn():
            for async_op in (False, True):
                got = raised(g, async_op)
                if got is None:
                    raise AssertionError(f"no error raised (async_op={async_op})")
                if exc_type is not None and not isinstance(got, exc_type):
                    raise AssertionError(f"raised {type(got).__name__}: {got}; expected {exc_type.__name__}")
                if msg is not None and msg not in str(got):
                    raise AssertionError(f"message {str(got)!r} lacks {msg!r}")
                if compare and ref is not None:
                    rexc = raised(ref, async_op)
                    assert rexc is not None, "the reference accepted this input"
                    assert type(rexc) is type(got), (type(rexc), type(got))
                    l1r = str(rexc).splitlines()[0] if str(rexc) else ""
                    l1g = str(got).splitlines()[0] if str(got) else ""
                    # NCCL's words, then which operand where sdma names it ("...: the input is not ...").
                    assert l1g == l1r or l1g.startswith(l1r + ": "), (
                        f"message differs from the reference's:\n  ref:  {l1r!r}\n  sdma: {l1g!r}")
            follow_up(k)

        cases.append((f"{tag}/bad_input/{k}", fn))

    n = 10
    expect("output_too_big",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n + 1, device=dev), torch.ones(n, device=dev),
                                                      group=grp, async_op=a), ValueError, MSG_SIZE)
    expect("output_too_small",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n - 1, device=dev), torch.ones(n, device=dev),
                                                      group=grp, async_op=a), ValueError, MSG_SIZE)
    expect("dtype_mismatch",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, dtype=torch.float64, device=dev),
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           TypeError, MSG_TYPE)
    expect("dtype_mismatch_same_size",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, dtype=torch.int32, device=dev),
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           TypeError, MSG_TYPE)
    expect("noncontiguous_input",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n, device=dev),
                                                      torch.ones(2 * n, device=dev)[::2], group=grp, async_op=a),
           ValueError, MSG_CONTIG)
    expect("noncontiguous_output",
           lambda grp, a: dist.all_gather_into_tensor(torch.empty(2 * W * n, device=dev)[::2],
                                                      torch.ones(n, device=dev), group=grp, async_op=a),
           ValueError, MSG_CONTIG)
    expect("list_wrong_length",
           lambda grp, a: dist.all_gather([torch.empty(n, device=dev) for _ in range(W + 1)],
                                          torch.ones(n, device=dev), group=grp, async_op=a), None, None)
    if W > 1:
        expect("list_too_short",
               lambda grp, a: dist.all_gather([torch.empty(n, device=dev) for _ in range(W - 1)],
                                              torch.ones(n, device=dev), group=grp, async_op=a), None, None)
    expect("coalesced_cm_size_mismatch",
           lambda grp, a: _cm_bad(grp, dev, W, n, a), ValueError, MSG_SIZE, compare=False)
    if dev.type == "cuda":
        expect("device_mismatch",
               lambda grp, a: dist.all_gather_into_tensor(torch.empty(W * n), torch.ones(n, device=dev),
                                                          group=grp, async_op=a), None, None, compare=True)
    return cases


def _cm_bad(grp, dev, W, n, async_op):
    outs = [torch.empty(W * n, device=dev), torch.empty(W * n + 3, device=dev)]
    ins = [torch.ones(n, device=dev), torch.ones(n, device=dev)]
    with coalescing_manager(grp, async_ops=async_op) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i, group=grp)
    if async_op:
        cm.wait()
    return None
