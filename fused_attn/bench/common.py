"""Shared benchmark machinery: environment, timing, FLOPs, correctness checks, result writers.

A benchmark suite builds `Impl`s (named closures over fixed inputs), checks each against an
fp32 torch reference with `check_impl`, times the survivors with `time_ms`, and turns the
timings into rows (`timing_rows`) that `write_results` stores as CSV and markdown.
"""

from __future__ import annotations

import csv
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

#: bf16 dense matmul throughput measured on the H100 (TFLOP/s); the "% of peak" denominator.
H100_BF16_PEAK_TFLOPS = 798.0
#: Backward costs 2.5x the forward, so forward + backward is 3.5x.
FWD_BWD_FACTOR = 3.5
DEFAULT_OUT = os.path.join("benchmarks", "results")


class ImplWrongError(RuntimeError):
    """An implementation produced a wrong (or non-finite) result in the correctness check."""


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


# ----------------------------------------------------------------------------- timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _event_loop_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median of per-call CUDA-event timings after `warmup_ms` of warm-up calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 3, 1e-3)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(5, min(1000, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0,
            rep_ms: float = 100.0) -> float:
    """Median milliseconds per call of `fn` (which must not synchronize).

    CUDA: `triton.testing.do_bench` when importable, else a CUDA-event loop. CPU (smoke runs
    only): wall-clock median of a few calls.
    """
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_loop_ms(fn, warmup_ms, rep_ms)
    try:
        return float(do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="median"))
    except TypeError:  # an old triton without return_mode
        return _event_loop_ms(fn, warmup_ms, rep_ms)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 2000) -> float:
    """Host microseconds per call: `calls` back-to-back calls, one synchronize after the loop."""
    for _ in range(20):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e6


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


# ----------------------------------------------------------------------------- correctness
@dataclass
class Impl:
    """One implementation on fixed inputs.

    fwd(): the timed forward call. fwd_bwd(): the timed forward + backward call (None: forward
    only). outputs(): dict with "out" (and "dq", "dk", "dv" when fwd_bwd exists) in the suite's
    canonical layout, for the correctness check. required: a failure to *run* is an error
    (our own code) rather than a skipped peer.
    """

    name: str
    fwd: Callable[[], object]
    fwd_bwd: Optional[Callable[[], object]]
    outputs: Callable[[], Dict[str, torch.Tensor]]
    required: bool = False
    note: str = ""


def rel_max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| in fp32; inf if `got` has a NaN/inf or the shapes differ."""
    if got.shape != want.shape:
        return float("inf")
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def tolerances(ref32: Dict[str, torch.Tensor], ref_low: Dict[str, torch.Tensor],
               factor: float = 3.0, floor: float = 1e-2) -> Dict[str, float]:
    """Per output: factor * (same-dtype torch reference error vs fp32) + floor."""
    return {k: factor * rel_max_err(ref_low[k], ref32[k]) + floor for k in ref32}


def check_impl(impl: Impl, ref32: Dict[str, torch.Tensor], tol: Dict[str, float],
               select: Callable[[str, torch.Tensor], torch.Tensor]) -> Dict[str, float]:
    """Compare `impl.outputs()` (sliced by `select(key, tensor)`) to the fp32 reference.

    Returns the relative max error per key; raises ImplWrongError naming the impl, the output,
    the error and the tolerance when one is too large.
    """
    outs = impl.outputs()
    errs = {}
    for key, want in ref32.items():
        if key not in outs:
            continue
        errs[key] = rel_max_err(select(key, outs[key]), want)
        if not errs[key] <= tol[key]:
            raise ImplWrongError(f"{impl.name}: {key} rel max error {errs[key]:.3g} > tolerance {tol[key]:.3g}")
    return errs


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                        score_fn: Optional[Callable[..., torch.Tensor]] = None,
                        mask: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """softmax(score_fn(scale * q k^T) masked) v computed in `dtype` (softmax in fp32).

    q (B, H, Sq, D), k / v (B, Hkv, Skv, D) with H % Hkv == 0; mask broadcastable to
    (B, H, Sq, Skv), True = keep; score_fn(score, b, h, q_idx, kv_idx) with broadcast index
    tensors. Rows with no kept key give 0. Returns (B, H, Sq, D) in `dtype`.
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if score_fn is not None:
        dev = q.device
        b = torch.arange(q.shape[0], device=dev).view(-1, 1, 1, 1)
        h = torch.arange(q.shape[1], device=dev).view(1, -1, 1, 1)
        qi = torch.arange(q.shape[2], device=dev).view(1, 1, -1, 1)
        ki = torch.arange(k.shape[2], device=dev).view(1, 1, 1, -1)
        s = score_fn(s.float(), b, h, qi, ki).to(dtype)
    s = s.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p.to(dtype) @ v


# ----------------------------------------------------------------------------- rows and writers
@dataclass
class Group:
    """Timings of several impls on one config and mode, turned into rows with peer ratios."""

    suite: str
    config: str
    mode: str
    flops: Optional[float]
    rows: List[Dict[str, object]] = field(default_factory=list)

    def add(self, impl: str, ms: Optional[float], max_err: Optional[float], note: str = "") -> None:
        row: Dict[str, object] = {"suite": self.suite, "config": self.config, "mode": self.mode,
                                  "impl": impl, "ms": ms, "tflops": None, "pct_peak": None}
        if ms is not None and self.flops:
            tflops = self.flops / (ms * 1e-3) / 1e12
            row["tflops"], row["pct_peak"] = tflops, 100.0 * tflops / H100_BF16_PEAK_TFLOPS
        row["max_err"] = max_err
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
        f.write(f"ms: median per call; tflops over real work; pct_peak: % of {H100_BF16_PEAK_TFLOPS:g} TFLOP/s "
                "(H100 bf16 matmul, measured); x_vs_P: P's ms / this ms (above 1 = faster than P); "
                "max_err: max|err| / max|ref| vs an fp32 torch reference.\n\n")
        for note in notes:
            f.write(f"- {note}\n")
        f.write("\n" + markdown_table(rows) + "\n")
    return base + ".csv", base + ".md"


def print_table(title: str, rows: Sequence[Dict[str, object]], env: Dict[str, str]) -> None:
    print(f"\n== {title} ({env_line(env)})")
    print(markdown_table(rows), flush=True)
