"""Shared benchmark machinery: environment, timing, FLOPs, correctness checks, result writers.

A benchmark suite builds `Impl`s (named closures over fixed inputs), checks each with
`check_impl` against a float64 reference within the project's bound (`reference_and_bounds`, built
on `fused_attn.testing.bound_from`), times the survivors with `time_ms`, and turns the timings into
rows (`Group`) that `write_results` stores as CSV and markdown.
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

from fused_attn.testing import DEFAULT_FACTOR, DEFAULT_FLOOR, bound_from, max_error
from fused_attn.testing import reference_attention as _testing_reference

#: bf16 dense matmul throughput measured on the H100 (TFLOP/s); the "% of peak" denominator.
H100_BF16_PEAK_TFLOPS = 798.0
#: Backward costs 2.5x the forward, so forward + backward is 3.5x.
FWD_BWD_FACTOR = 3.5
DEFAULT_OUT = os.path.join("benchmarks", "results")
#: The naive references are computed in blocks of query rows of at most this many scores
#: (float64: 128 MiB a score matrix; fwd + bwd peaks at about 6-9 of them), see `naive_attention`.
REF_BLOCK_SCORES = 1 << 24
#: How the checks work, for the notes of the result files (every suite checks bf16 inputs).
CHECK_RULE = (f"max_err: max |result - float64 reference| on the checked slice; bound: {DEFAULT_FACTOR:g} x the same "
              f"error of the naive bf16 torch computation (fp32 softmax) + {DEFAULT_FLOOR[torch.bfloat16]:g} x "
              "max(1, max|reference|) (fused_attn.testing.bound_from); worst: the checked quantity "
              "(out, dq, dk, dv) closest to its bound")


class ImplWrongError(RuntimeError):
    """An implementation produced a wrong (or non-finite) result in the correctness check.

    key, err, bound: the checked quantity, its max abs error and the bound it exceeded.
    """

    def __init__(self, message: str, *, key: Optional[str] = None, err: Optional[float] = None,
                 bound: Optional[float] = None) -> None:
        super().__init__(message)
        self.key, self.err, self.bound = key, err, bound


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


def host_us_launching(fn: Callable[[], object], device: torch.device, calls: int = 40, rounds: int = 3) -> float:
    """Host microseconds per call while the GPU works behind it: `calls` back-to-back calls timed
    up to the return of the last one (before synchronizing), best of `rounds`; few enough calls
    that their launches do not fill the device queue (which would make the host wait)."""
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        synchronize(device)
    return best


def device_ms_per_call(fn: Callable[[], object], device: torch.device, host_us: float, calls: int = 20,
                       rounds: int = 3) -> float:
    """Device milliseconds per call with the host ahead of the GPU: a sleep kernel holds the
    stream while `calls` calls are queued behind it, and CUDA events around the queued calls time
    the GPU alone (the call's kernels, copies and fills and the gaps between them), best of
    `rounds`. host_us: the call's host time (sizes the sleep). No profiler: torch's profiler
    leaves CUPTI attached to the process after a pass (pytorch/pytorch#144455), and in one H200
    run the rows timed after such passes ran up to 2x slower on the host."""
    cycles_per_ms = _sleep_cycles_per_ms()
    best = float("inf")
    for _ in range(rounds):
        fn()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(cycles_per_ms * (2.0 * calls * host_us / 1e3 + 2.0)))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        synchronize(device)
        best = min(best, start.elapsed_time(end) / calls)
    return best


def _sleep_cycles_per_ms() -> float:
    """Cycles of `torch.cuda._sleep` per millisecond on the current device (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2_000_000 / max(start.elapsed_time(end), 1e-3)


def host_us_interleaved(fns: Dict[str, Callable[[], object]], device: torch.device, calls: int = 2000,
                        rounds: int = 5) -> Dict[str, float]:
    """Host microseconds per call of each of `fns`, best of `rounds` interleaved rounds (each round
    times every fn over `calls` back-to-back calls, one synchronize after): a slow spell of a
    shared host then disturbs one round of every row, not every round of one row."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], host_us_per_call(fn, device, calls))
    return best


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


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dtype: torch.dtype,
                    mask: Optional[torch.Tensor] = None, score_fn: Optional[Callable[..., torch.Tensor]] = None,
                    grad_out: Optional[torch.Tensor] = None, params: Optional[Dict[str, torch.Tensor]] = None,
                    block_scores: int = REF_BLOCK_SCORES) -> Dict[str, torch.Tensor]:
    """`fused_attn.testing.reference_attention` in `dtype`, with its autograd gradients.

    q (B, H, Sq, D), k / v (B, Hkv, Skv, D) logical, H % Hkv == 0; mask bool broadcastable to
    (B, H, Sq, Skv), True = attend; score_fn(score, b, h, q_idx, kv_idx) with broadcast index
    tensors. Matmuls in `dtype`, softmax in fp32 (float64 when `dtype` is float64): float64 is the
    exact reference, bf16 the naive same-dtype computation of the project's tolerance rule.
    Returns {"out"} and, given grad_out (B, H, Sq, Dv), also "dq", "dk", "dv"; all in `dtype`.
    params: name -> leaf tensor (requires grad, in `dtype`) that score_fn reads (a trained bias);
    with grad_out, their gradients are returned too, as "d<name>".

    Computed in blocks of query rows of at most `block_scores` scores, so a float64 reference
    holds score matrices of at most 128 MiB (about 1 GiB at its peak) whatever the checked slice;
    dk and dv are summed over the blocks in the softmax dtype and rounded to `dtype` once (one
    block: plain autograd).
    """
    b, h, sq, _ = q.shape
    skv = k.shape[2]
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    qd, kd, vd = (t.detach().to(dtype) for t in (q, k, v))
    full_mask = None if mask is None else torch.broadcast_to(mask.to(q.device), (b, h, sq, skv))
    rows = max(1, min(sq, block_scores // max(1, b * h * skv)))
    outs: List[torch.Tensor] = []
    dqs: List[torch.Tensor] = []
    dk = dv = None
    named = dict(params or {})
    d_params: Dict[str, torch.Tensor] = {}
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        leaves = [t.detach().requires_grad_(grad_out is not None) for t in (qd[:, :, r0:r1], kd, vd)]
        fn = None if score_fn is None else (lambda s, bi, hi, qi, ki, _r0=r0: score_fn(s, bi, hi, qi + _r0, ki))
        out = _testing_reference(*leaves, scale, None if full_mask is None else full_mask[:, :, r0:r1], fn,
                                 dtype=dtype, softmax_dtype=soft)[0]
        outs.append(out.detach())
        if grad_out is not None:
            gq, gk, gv, *gp = torch.autograd.grad(out, leaves + list(named.values()), grad_out[:, :, r0:r1].to(dtype))
            dqs.append(gq)
            for name, g in zip(named, gp):
                d_params[name] = g.to(soft) if name not in d_params else d_params[name].add_(g)
            dk = gk.to(soft) if dk is None else dk.add_(gk)
            dv = gv.to(soft) if dv is None else dv.add_(gv)
        del out, leaves
    result = {"out": torch.cat(outs, dim=2)}
    if grad_out is not None:
        result.update(dq=torch.cat(dqs, dim=2), dk=dk.to(dtype), dv=dv.to(dtype))
        result.update({f"d{name}": g.to(dtype) for name, g in d_params.items()})
    return result


def reference_and_bounds(compute: Callable[[torch.dtype], Dict[str, torch.Tensor]],
                         dtype: torch.dtype) -> Tuple[Dict[str, torch.Tensor], Dict[str, float]]:
    """(expected, bounds) of a correctness check, by the project's rule (`fused_attn.testing`).

    compute(dt): the suite's naive computation (see `naive_attention`) on the checked slice of
    the inputs, in dt. expected = compute(float64); bounds[key] = `bound_from(compute(dtype)[key],
    expected[key], dtype)`: DEFAULT_FACTOR x the max error of the same computation in the inputs'
    dtype, plus the dtype's floor x max(1, max|expected|). The same-dtype results are freed here.
    """
    expected = compute(torch.float64)
    same = compute(dtype)
    bounds = {key: bound_from(same[key], expected[key], dtype) for key in expected}
    del same
    return expected, bounds


def check_tensor(name: str, key: str, got: torch.Tensor, want: torch.Tensor, bound: float) -> float:
    """max |got - want| (`fused_attn.testing.max_error`); raises ImplWrongError naming `name`,
    `key`, the error and the bound when the shapes differ or the error is above `bound` (NaN is)."""
    if tuple(got.shape) != tuple(want.shape):
        raise ImplWrongError(f"{name}: {key} shape {tuple(got.shape)} != expected {tuple(want.shape)}",
                             key=key, err=float("inf"), bound=bound)
    err = max_error(got, want)
    if not err <= bound:
        bad = int((~torch.isfinite(got.detach())).sum())
        extra = f" ({bad} non-finite entries)" if bad else ""
        raise ImplWrongError(f"{name}: {key} max abs error {err:.3g} > bound {bound:.3g} "
                             f"vs the float64 reference{extra}", key=key, err=err, bound=bound)
    return err


def check_impl(impl: Impl, expected: Dict[str, torch.Tensor], bounds: Dict[str, float],
               select: Callable[[str, torch.Tensor], torch.Tensor]) -> Dict[str, float]:
    """Compare `impl.outputs()` (sliced by `select(key, tensor)`) with the float64 `expected`.

    Returns the max abs error per key; raises ImplWrongError (see `check_tensor`) when one is
    above its bound.
    """
    outs = impl.outputs()
    return {key: check_tensor(impl.name, key, select(key, outs[key]), want, bounds[key])
            for key, want in expected.items() if key in outs}


def worst_error(errs: Dict[str, float], bounds: Dict[str, float],
                keys: Optional[Sequence[str]] = None) -> Tuple[Optional[str], Optional[float], Optional[float]]:
    """(key, error, bound) of the checked quantity closest to its bound (largest error / bound)
    among `keys` (default: all of `errs`); (None, None, None) when there is none."""
    cand = [k for k in (keys if keys is not None else errs) if k in errs]
    if not cand:
        return None, None, None
    key = max(cand, key=lambda k: errs[k] / bounds[k] if bounds[k] > 0 else float("inf"))
    return key, errs[key], bounds[key]


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
