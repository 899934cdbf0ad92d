"""The 4-GPU scripts on 4 CPU processes (gloo, tiny sizes): benchmarks/bench_cp.py with every
strategy and benchmarks/train_cp.py (FSDP2 + context parallelism), so their GPU runs cannot fail
for a reason a CPU run shows. Each is launched as on the GPUs, with torchrun."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _spawn import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # 4 processes under torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
           os.path.join(ROOT, "benchmarks", script), *args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500, env=env)


def _rows(path: str) -> list:
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_bench_cp_four_ranks_every_strategy(tmp_path):
    comms = ["ring", "ring_serial", "ring_hp", "all_gather", "all_to_all"]
    proc = _torchrun("bench_cp.py", "--cpu-smoke", "--comms", ",".join(comms), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(str(tmp_path / "cp_cpux4.csv"))
    assert [(r["S"], r["impl"]) for r in rows] == [(s, i) for s in ("64", "128")
                                                   for i in ["single"] + comms + ["comm_only"]]
    for r in rows:
        assert r["ms"] and r["wall_ms"], r
        assert not r["note"] or "overlap hides" in r["note"], r
        if r["impl"] != "comm_only":  # output and dq of the last query rows against float64
            assert 0 < float(r["max_err"]) <= float(r["bound"]), r
            assert 0 < float(r["dq_err"]) <= float(r["dq_bound"]), r
            assert r["gpus"] == ("1" if r["impl"] == "single" else "4"), r


@pytest.mark.parametrize("comm", ["ring", "all_to_all"])
def test_train_cp_four_ranks(tmp_path, comm):
    """A few FSDP2 steps with context parallelism: step 0's loss equals the unsharded loss of the
    same batch and weights (float32 compute on CPU, bf16 parameters: 1e-4 relative), losses finite."""
    proc = _torchrun("train_cp.py", "--device", "cpu", "--model", "tiny", "--seq", "64", "--steps", "3", "--skip",
                     "1", "--attn", "fused", "--cp-comm", comm, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(str(tmp_path / "train_cp_cpux4.csv"))
    assert [(r["step"], r["attn"]) for r in rows] == [(str(i), "fused") for i in range(3)]
    first, unsharded = float(rows[0]["loss"]), float(rows[0]["unsharded_loss"])
    assert abs(first - unsharded) <= 1e-4 * unsharded, (first, unsharded)
    assert all(0 < float(r["loss"]) < 10 and float(r["step_ms"]) > 0 for r in rows), rows
    summary = open(tmp_path / "train_cp_cpux4.md").read()
    assert "| fused |" in summary and "FAILED" not in summary, summary


def test_train_cp_refuses_sdpa_on_cpu(tmp_path):
    """The SDPA variant needs CUDA (torch's context parallelism): on CPU it is reported as failed
    (exit 1, the reason in the summary), after the fused variant's rows are written."""
    proc = _torchrun("train_cp.py", "--device", "cpu", "--model", "tiny", "--seq", "64", "--steps", "2", "--skip",
                     "0", "--attn", "fused,sdpa", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = open(tmp_path / "train_cp_cpux4.md").read()
    assert "sdpa FAILED: NotImplementedError: torch's context parallelism dispatches CUDA SDPA kernels only" in summary
    assert len(_rows(str(tmp_path / "train_cp_cpux4.csv"))) == 2
