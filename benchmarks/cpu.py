"""CPU benchmark: fused_attn's auto engine vs torch SDPA vs the reference, and score_mods vs compiled flex.

    python -m fused_attn bench cpu [--quick] [--only TEXT] [--out DIR]

Shapes (BSHD, H 16 / Hkv 4, D 128, causal as in the README's module example): B1 S2048 bf16 and
fp32; without --quick also the README example's B2 S4096 bf16 and fp32. A causal softcap score_mod
(inference: torch's CPU flex has no backward) at B1 S2048 bf16 and fp32 against flex_attention
compiled by hand (with the causal block mask). --only: the configs whose label contains TEXT.
Each impl's output is first checked against float64 on a slice (batch 0, the first kv head's query
heads, the first 128 query rows, every key) with the project's bound (`fused_attn.testing.bound_from`).

Times: median of 3 calls (forward + backward: 2) after one warm-up call, time.perf_counter; the
forward times of fused_attn and its torch peer are then re-measured with their calls interleaved
(what the table shows: the load of a shared machine drifts between sequential measurements);
forward under torch.no_grad(), forward + backward with autograd. Memory: the peak resident set
size during the last timed call above the resident size before it (freed heap returned to the
system first with malloc_trim; the high-water mark reset through /proc/self/clear_refs: Linux
only; torch's CPU allocations are invisible to tracemalloc). The
reference runs once per mode (it takes minutes at S4096); its backward is timed at S2048 only.
"""

from __future__ import annotations

import csv
import ctypes
import gc
import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .common import markdown_table

__all__ = ["run", "peak_rss_mb"]

H, HKV, D = 16, 4, 128


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_mb(fn: Callable[[], object]) -> Optional[float]:
    """Peak resident MB above the starting resident size while `fn()` runs (None: not measurable here).

    Freed heap memory is first handed back to the system (malloc_trim), so the call's allocations
    show as new resident pages instead of reusing earlier calls' pages."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (the peak RSS) to the current RSS
    except OSError:
        return None
    base = _status_kb("VmRSS")
    result = fn()
    peak = _status_kb("VmHWM")
    del result
    if base is None or peak is None:
        return None
    return (peak - base) / 1024.0


def _inputs(b: int, s: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda heads: torch.randn(b, s, heads, D, generator=gen, dtype=torch.float32).to(dtype)
    return mk(H), mk(HKV), mk(HKV), mk(H)


def _check(out: torch.Tensor, q, k, v, score_fn=None, rows: int = 128) -> str:
    """'ok (err <= bound)' or 'WRONG ...' for out's slice against float64."""
    from fused_attn.testing import bound_from, max_error, reference_attention

    group = H // HKV
    sl = lambda t, n, r=None: t[:1, :r, :n].transpose(1, 2).detach()
    qs, ks, vs = sl(q, group, rows), sl(k, 1), sl(v, 1)
    scale = 1 / math.sqrt(D)
    mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()[:rows]  # causal
    exact, _ = reference_attention(qs, ks, vs, scale, mask, score_fn)
    naive, _ = reference_attention(qs, ks, vs, scale, mask, score_fn, dtype=q.dtype, softmax_dtype=torch.float32)
    bound = bound_from(naive, exact, q.dtype)
    err = max_error(out[:1, :rows, :group].transpose(1, 2), exact)
    return f"ok ({err:.1e} <= {bound:.1e})" if err <= bound else f"WRONG ({err:.1e} > {bound:.1e})"


def _impls(mod: Optional[object]) -> Dict[str, Callable]:
    """name -> fn(q, k, v) -> out (BSHD)."""
    import fused_attn

    causal = dict(attn_mask_type="causal")
    if mod is None:
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
        return {"fused_attn auto": lambda q, k, v: fused_attn.dot_product_attention(q, k, v, **causal),
                "torch SDPA": sdpa,
                "fused_attn reference": lambda q, k, v: fused_attn.dot_product_attention(q, k, v, backend="reference",
                                                                                          **causal)}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    cap = mod.scalars()["cap"]
    softcap = lambda s, b, h, i, j: cap * torch.tanh(s / cap)
    masks: Dict[int, object] = {}

    def by_hand(q, k, v):
        s = q.shape[1]
        if s not in masks:
            masks[s] = create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device="cpu")
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=softcap, block_mask=masks[s],
                    enable_gqa=True).transpose(1, 2)

    return {"fused_attn auto": lambda q, k, v: fused_attn.dot_product_attention(q, k, v, score_mod=mod, **causal),
            "compiled flex_attention": by_hand,
            "fused_attn reference": lambda q, k, v: fused_attn.dot_product_attention(q, k, v, score_mod=mod,
                                                                                      backend="reference", **causal)}


def _one(label: str, b: int, s: int, dtype: torch.dtype, mod: Optional[object], reps: int, backward: str,
         seed: int) -> List[Dict[str, object]]:
    import fused_attn

    q, k, v, do = _inputs(b, s, dtype, seed)
    cap = None if mod is None else mod.scalars()["cap"]
    score_fn = None if mod is None else (lambda x, *_: cap * torch.tanh(x / cap))
    rows: List[Dict[str, object]] = []
    engine = fused_attn.explain(q, k, v, score_mod=mod, attn_mask_type="causal").backend
    _impls_cached = _impls(mod)
    for name, fn in _impls_cached.items():
        is_ref = name == "fused_attn reference"
        row: Dict[str, object] = {"config": label, "impl": name + (f" ({engine})" if name == "fused_attn auto" else "")}
        with torch.no_grad():
            out = fn(q, k, v)
        row["check"] = _check(out, q, k, v, score_fn)
        del out
        with torch.no_grad():
            row["fwd_s"], row["fwd_peak_mb"] = _time_and_peak(lambda: fn(q, k, v), 1 if is_ref else reps)
        if mod is None and (backward == "all" or (backward == "torch" and not is_ref)):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            step = lambda: torch.autograd.grad(fn(*leaves), leaves, do)
            row["fwd_bwd_s"], row["fwd_bwd_peak_mb"] = _time_and_peak(step, 1 if is_ref else max(2, reps - 1))
        rows.append(row)
        print(row, flush=True)
    _interleaved(rows, [f for n, f in _impls_cached.items() if n != "fused_attn reference"], q, k, v, reps)
    base = rows[1]
    for row in rows:
        for key in ("fwd_s", "fwd_bwd_s", "fwd_peak_mb", "fwd_bwd_peak_mb"):
            if row.get(key) is not None and base.get(key):
                row["x_" + key] = round(row[key] / base[key], 2)
    return rows


def _interleaved(rows: List[Dict[str, object]], fns: List[Callable], q, k, v, reps: int) -> None:
    """Forward times of the torch impls again, their calls interleaved (a, b, a, b, ...): on a shared
    machine the load drifts between two sequential measurements, not between neighbouring calls.
    Sets fwd_s of the first len(fns) rows to the interleaved medians."""
    spent: List[List[float]] = [[] for _ in fns]
    with torch.no_grad():
        for _ in range(reps):
            for i, fn in enumerate(fns):
                t0 = time.perf_counter()
                fn(q, k, v)
                spent[i].append(time.perf_counter() - t0)
    for row, times in zip(rows, spent):
        row["fwd_s"] = round(statistics.median(times), 4)


def _time_and_peak(fn: Callable[[], object], reps: int) -> tuple:
    """(seconds, peak MB): the median of `reps` calls after a warm-up call (none when reps == 1:
    the slow reference), the peak measured during the last one."""
    if reps > 1:
        fn()  # warm-up (compiles, first-touch allocations)
    spent = []

    def timed():
        t0 = time.perf_counter()
        r = fn()
        spent.append(time.perf_counter() - t0)
        return r

    for _ in range(reps - 1):
        timed()
    peak = peak_rss_mb(timed)
    return round(statistics.median(spent), 4), _round(peak)


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)


def configs(quick: bool, only: Optional[str] = None) -> list:
    """(label, B, S, dtype, score_mod or None, which impls time forward + backward: "all", "torch"
    (not the reference) or "none"); `only`: the configs whose label contains it."""
    import score_mods as sm

    grid = [("causal B1 S2048 H16/4 D128 bf16", 1, 2048, torch.bfloat16, None, "all")]
    if not quick:  # the README shape: forward only (one bf16 backward takes minutes on a small CPU)
        grid.append(("README causal B2 S4096 H16/4 D128 bf16", 2, 4096, torch.bfloat16, None, "none"))
    grid.append(("causal softcap B1 S2048 H16/4 D128 bf16 (inference)", 1, 2048, torch.bfloat16, sm.softcap(30.0),
                 "none"))
    grid.append(("causal B1 S2048 H16/4 D128 fp32", 1, 2048, torch.float32, None, "all"))
    if not quick:
        grid.append(("README causal B2 S4096 H16/4 D128 fp32", 2, 4096, torch.float32, None, "none"))
    grid.append(("causal softcap B1 S2048 H16/4 D128 fp32 (inference)", 1, 2048, torch.float32, sm.softcap(30.0),
                 "none"))
    return [c for c in grid if only is None or only in c[0]]


def run(quick: bool, out_dir: str, reps: int = 3, only: Optional[str] = None) -> List[Dict[str, object]]:
    """Run the grid; write `<out_dir>/cpu_<cores>cores.csv` and `.md`; return the rows."""
    rows: List[Dict[str, object]] = []
    for i, (label, b, s, dtype, mod, backward) in enumerate(configs(quick, only)):
        rows += _one(label, b, s, dtype, mod, reps, backward, seed=i)
        write(rows, out_dir)  # after every config: a long run keeps what it measured
    return rows


def header() -> str:
    return (f"cpu: {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"x_*: this row / the torch row (SDPA or compiled flex) of its config")


def write(rows: List[Dict[str, object]], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"cpu_{os.cpu_count()}cores")
    cols: List[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    with open(base + ".csv", "w", newline="") as f:
        f.write("# " + header() + "\n")
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in cols})
    with open(base + ".md", "w") as f:
        f.write(f"# cpu benchmark\n\n{header()}\n\n{__doc__.split(chr(10) + chr(10), 2)[2]}\n"
                + markdown_table(rows) + "\n")
    print(f"wrote {base}.csv and {base}.md")
