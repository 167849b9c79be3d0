"""The benchmarks run end to end in CPU mode (2 processes, tiny sizes): every row's bytes match, every peer the
machine lacks says why, and the files they promise are written; the exchange benchmark's point-to-point rows (the
batch_isend_irecv ring and the send/recv pipeline) take sdma's DMA path. Their figures are not checked: speed lives
in the benchmarks, not in tests."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    assert "| 64 KiB | in |" in report["peers_markdown"]
    assert (tmp_path / "allgather_cpu_w2.csv").exists()


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
    assert report["unavailable"] == {name: "needs CUDA tensors" for name in ("nccl-ce", "symm-mem", "ce-limit")}
    assert "| send_recv_pipeline | 64 KiB |" in report["markdown"]
    assert (tmp_path / "exchange_cpu_w2.md").exists()
