"""The benchmarks run end to end in CPU mode (2 processes, tiny sizes): every row's bytes match, every peer the
machine lacks says why, the raw copy-engine schedules say why they did not run, the ratios divide by the peers they
name, and the files they promise are written; the exchange benchmark's point-to-point rows (the batch_isend_irecv
ring and the send/recv pipeline) take sdma's DMA path, with their ratios to gloo and a note of the rows that ran.
Their figures are not checked: speed lives in the benchmarks, not in tests. The raw schedules' peer orders are
checked at several world sizes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_raw_schedules_peer_orders(world):
    if str(ROOT) not in sys.path:  # the checkout's torch_sdma where none is installed (make test sets PYTHONPATH)
        sys.path.append(str(ROOT))
    from torch_sdma.check import RAW_SCHEDULES, peer_order

    for schedule in RAW_SCHEDULES:
        orders = [peer_order(rank, world, schedule) for rank in range(world)]
        for rank, order in enumerate(orders):
            assert sorted(order) == [p for p in range(world) if p != rank], (schedule, rank, order)
        firsts = [order[0] for order in orders]
        if schedule == "same-order":  # every rank but rank 0 copies to rank 0 first: the incast the others avoid
            assert firsts == [1] + [0] * (world - 1)
        else:  # at every step each rank has one writer
            for step in range(world - 1):
                assert sorted(order[step] for order in orders) == list(range(world)), (schedule, step)


def test_bench_cpu_mode_writes_checked_rows(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "bench_allgather.py"), "--mode", "cpu", "--sizes", "4K,64K", "--rounds", "1",
           "--warmup", "1", "--max-iters", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "allgather_cpu_w2.json").read_text())
    assert [r["match"] for r in report["sweep"]] == [True, True]
    peers = report["peers"]
    assert [r["size"] for r in peers] == ["4 KiB", "64 KiB"]
    for r in peers:
        for entry in ("sdma_out", "sdma_in", "sdma-direct_out", "sdma-direct_in", "gloo_out", "gloo_in"):
            assert r[entry]["match"], (r["size"], entry)
            assert r[entry]["busbw_GBps"] > 0
        assert r["best_peer_out"] == "gloo" and r["best_peer_in"] == "gloo"
        assert r["unavailable"] == {name: "needs CUDA tensors"
                                    for name in ("nccl-ce", "symm-mem-ce", "ce-limit", "ce-limit-ipc")}
        for ours in ("sdma", "sdma-direct"):
            for form in ("out", "in"):
                ratio = r[f"gloo_{form}"]["us"] / r[f"{ours}_{form}"]["us"]
                assert r[f"{ours}_over_base_{form}"] == pytest.approx(ratio)
                assert r[f"{ours}_over_best_{form}"] == pytest.approx(ratio)  # gloo is the best peer here
            assert f"{ours}_over_limit_out" not in r and "raw" not in r
    assert "| 64 KiB | in |" in report["peers_markdown"]
    ratios = "| sdma/best | sdma/gloo | sdma/limit | dir/best | dir/gloo | dir/limit |"
    assert ratios in report["peers_markdown"].splitlines()[0]
    why = "no GPUs (CPU tensors have no copy engines)"
    assert report["raw_schedules"]["rows"] == [] and report["raw_schedules"]["unavailable"] == why
    assert f"## Raw copy-engine schedules: n/a, {why}" in proc.stdout
    assert (tmp_path / "allgather_cpu_w2.csv").exists()
    assert not (tmp_path / "allgather_cpu_w2_raw.csv").exists()


def test_exchange_bench_cpu_mode_point_to_point_rows(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "bench_exchange.py"), "--mode", "cpu", "--ops",
           "batch_isend_irecv_ring,send_recv_pipeline", "--sizes", "4K,64K", "--rounds", "1", "--warmup", "1",
           "--max-iters", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "exchange_cpu_w2.json").read_text())
    rows = report["sweep"]
    assert [(r["op"], r["size"]) for r in rows] == [(op, size) for op in ("batch_isend_irecv_ring",
                                                                          "send_recv_pipeline")
                                                    for size in ("4 KiB", "64 KiB")]
    for r in rows:
        for entry in ("sdma", "sdma-dma", "gloo"):
            assert r[entry]["match"], (r["op"], r["size"], entry)
            assert r[entry]["busbw_GBps"] > 0
        # Rank 0's paths: the ring's sends and recvs; the pipeline's first rank only sends.
        want = "recv:dma:direct+send:dma:direct" if r["op"] == "batch_isend_irecv_ring" else "send:dma:direct"
        assert r["paths"] == {"sdma": want, "sdma-dma": want}, r
        assert r["sdma_over_base"] == pytest.approx(r["gloo"]["us"] / r["sdma"]["us"])
        assert r["dma_over_base"] == pytest.approx(r["gloo"]["us"] / r["sdma-dma"]["us"])
    assert report["unavailable"] == {name: "needs CUDA tensors" for name in ("nccl-ce", "symm-mem", "ce-limit")}
    assert report["ran"] == {op: ["sdma", "sdma-dma", "gloo"] for op in ("batch_isend_irecv_ring",
                                                                         "send_recv_pipeline")}
    assert "| sdma/gloo | dma/gloo | best other | dma/best |" in report["markdown"]
    assert "| send_recv_pipeline | 64 KiB |" in report["markdown"]
    assert "- ran send_recv_pipeline (rank r to r+1, r < w-1): sdma, sdma-dma, gloo" in report["markdown"]
    assert (tmp_path / "exchange_cpu_w2.md").exists()
