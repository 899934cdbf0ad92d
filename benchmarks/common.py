"""Shared benchmark machinery: environment, timing, FLOPs, correctness checks, result writers.

A benchmark suite builds `Impl`s (named closures over fixed inputs), checks each with
`check_impl` against a float64 reference within the project's bound (`reference_and_bounds`, built
on `fused_attn.testing.bound_from`), times the survivors with `time_ms`, and turns the timings into
rows (`Group`) that `write_results` stores as CSV and markdown.

The suites import all of it from here. This module holds the environment, FLOPs, rows and
writers; the timing lives in `timing`, the correctness checks in `checks`.
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .checks import (CHECK_RULE, REF_BLOCK_SCORES, Impl, ImplWrongError, check_impl, check_tensor,  # noqa: F401
                     naive_attention, reference_and_bounds, worst_error)
from .timing import (device_ms_per_call, host_us_launching, host_us_per_call, host_us_rounds,  # noqa: F401
                     synchronize, time_ms)

#: bf16 dense matmul throughput measured on the H100 (TFLOP/s); the "% of peak" denominator.
H100_BF16_PEAK_TFLOPS = 798.0
#: Backward costs 2.5x the forward, so forward + backward is 3.5x.
FWD_BWD_FACTOR = 3.5
DEFAULT_OUT = os.path.join("benchmarks", "results")


# ----------------------------------------------------------------------------- environment
def environment(device: torch.device) -> Dict[str, str]:
    """Versions and device name, for the table headers: gpu, torch, cuda, cudnn, cudnn_frontend."""
    env = {"gpu": "cpu", "torch": torch.__version__, "cuda": str(torch.version.cuda),
           "cudnn": "n/a", "cudnn_frontend": "n/a"}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cudnn"] = str(torch.backends.cudnn.version())
    try:
        import cudnn

        env["cudnn_frontend"] = str(getattr(cudnn, "__version__", "?"))
        if device.type == "cuda":
            env["cudnn"] = cudnn.backend_version_string()
    except Exception:  # no frontend or no libcudnn (CPU machine): keep what torch said
        pass
    return env


def gpu_slug(env: Dict[str, str]) -> str:
    """Short file-name tag for the device: 'NVIDIA H100 80GB HBM3' -> 'h100', CPU -> 'cpu'."""
    name = env["gpu"]
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", name.replace("NVIDIA", ""))
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def env_line(env: Dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in env.items())


# ----------------------------------------------------------------------------- FLOPs
def attn_flops(batch: int, heads: int, seq_q: int, seq_kv: int, head_dim: int, *, causal: bool,
               mode: str) -> float:
    """FLOPs of dense attention: forward 4*B*H*Sq*Skv*D (half for causal); fwd_bwd 3.5x."""
    flops = 4.0 * batch * heads * seq_q * seq_kv * head_dim
    if causal:
        flops /= 2
    return flops * (FWD_BWD_FACTOR if mode == "fwd_bwd" else 1.0)


def varlen_flops(lengths: Sequence[int], heads: int, head_dim: int, *, causal: bool, mode: str) -> float:
    """FLOPs over real tokens: sum_i 4*H*D*s_i^2 (never B*max_S^2), half for causal; fwd_bwd 3.5x."""
    flops = sum(4.0 * heads * head_dim * int(s) * int(s) for s in lengths)
    if causal:
        flops /= 2
    return flops * (FWD_BWD_FACTOR if mode == "fwd_bwd" else 1.0)


# ----------------------------------------------------------------------------- rows and writers
@dataclass
class Group:
    """Timings of several impls on one config and mode, turned into rows with peer ratios."""

    suite: str
    config: str
    mode: str
    flops: Optional[float]
    rows: List[Dict[str, object]] = field(default_factory=list)

    def add(self, impl: str, ms: Optional[float], max_err: Optional[float], note: str = "", *,
            bound: Optional[float] = None, worst: Optional[str] = None,
            split: Optional[Dict[str, Optional[float]]] = None) -> None:
        """One row; max_err: absolute error vs the float64 reference, bound: its bound, worst:
        the checked quantity they belong to; split: {"gpu_ms": device time per call, "host_us":
        host time per call} placed after ms, when the suite measures them."""
        row: Dict[str, object] = {"suite": self.suite, "config": self.config, "mode": self.mode,
                                  "impl": impl, "ms": ms}
        if split is not None:
            row.update(split)
        row["tflops"] = row["pct_peak"] = None
        if ms is not None and self.flops:
            tflops = self.flops / (ms * 1e-3) / 1e12
            row["tflops"], row["pct_peak"] = tflops, 100.0 * tflops / H100_BF16_PEAK_TFLOPS
        row["max_err"], row["bound"], row["worst"] = max_err, bound, worst
        row["note"] = note
        self.rows.append(row)

    def finish(self) -> List[Dict[str, object]]:
        """Add `x_vs_<peer>` = peer ms / this ms (above 1: this impl is faster) to every row."""
        for row in self.rows:
            for peer in self.rows:
                key = "x_vs_" + str(peer["impl"])
                ok = row["ms"] is not None and peer["ms"] is not None
                row[key] = (peer["ms"] / row["ms"]) if ok else None
        return self.rows


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == 0 or abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return str(value)


def _columns(rows: Sequence[Dict[str, object]]) -> List[str]:
    cols: List[str] = []
    for row in rows:
        for key in row:
            if key not in cols:
                cols.append(key)
    return cols


def markdown_table(rows: Sequence[Dict[str, object]]) -> str:
    """One markdown table per run of consecutive rows with the same columns; all-empty columns dropped."""
    blocks: List[List[Dict[str, object]]] = []
    for row in rows:
        if blocks and list(blocks[-1][-1]) == list(row):
            blocks[-1].append(row)
        else:
            blocks.append([row])
    tables = []
    for block in blocks:
        cols = [c for c in _columns(block) if c != "suite" and any(r.get(c) not in (None, "") for r in block)]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in block]
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def write_results(suite: str, rows: Sequence[Dict[str, object]], env: Dict[str, str], out_dir: str,
                  notes: Sequence[str] = ()) -> Tuple[str, str]:
    """Write `<out_dir>/<suite>_<gpu>.csv` and `.md` (versions on top); return both paths."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"{suite}_{gpu_slug(env)}")
    cols = _columns(rows)
    with open(base + ".csv", "w", newline="") as f:
        f.write("# " + env_line(env) + "\n")
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: ("" if row.get(c) is None else row.get(c)) for c in cols})
    with open(base + ".md", "w") as f:
        f.write(f"# {suite} benchmark\n\n{env_line(env)}\n\n")
        split = any("gpu_ms" in row and "host_us" in row for row in rows)  # run_config(split_times=True)
        f.write(f"ms: median per call (back-to-back calls: the slower of host and GPU sets it); "
                + ("gpu_ms: device time per call with the host ahead (calls queued behind a sleep kernel, CUDA "
                   "events; kernels, copies, fills and the gaps between them); host_us: host time per call while "
                   "the GPU works behind; " if split else "")
                + f"tflops over real work; pct_peak: % of {H100_BF16_PEAK_TFLOPS:g} TFLOP/s "
                "(H100 bf16 matmul, measured); x_vs_P: P's ms / this ms (above 1 = faster than P); "
                f"{CHECK_RULE}.\n\n")
        for note in notes:
            f.write(f"- {note}\n")
        f.write("\n" + markdown_table(rows) + "\n")
    return base + ".csv", base + ".md"


def print_table(title: str, rows: Sequence[Dict[str, object]], env: Dict[str, str]) -> None:
    print(f"\n== {title} ({env_line(env)})")
    print(markdown_table(rows), flush=True)
