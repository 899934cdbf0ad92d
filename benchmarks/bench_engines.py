"""Engines and peers over problem families on the GPU at hand: fused_attn (auto / cudnn / fa4),
flash-attn-4 called directly, torch SDPA (cuDNN and flash backends) and torch varlen_attn.

Every implementation is first checked against the float64 reference on a reduced slice of the
same configuration (B=1, S/4: the float64 scores of the full size do not fit), with the
project's bound (`fused_attn.testing.bound_from`); a wrong one is reported and not timed. Then,
forward and forward + backward, three numbers per implementation:
    gpu_ms   device time per call, the host kept ahead (`device_ms_per_call`)
    wall_ms  wall time per step over back-to-back steps, one synchronize at the end, the median of
             rounds in which the implementations take turns (`wall_rounds`)
    host_us  host time per call while the GPU works behind it (`host_us_launching`)

    python -m fused_attn bench engines [--write-table] [--quick] [--out DIR]
    python benchmarks/bench_engines.py --out OUT_DIR [--write-table] [--quick]

--write-table stores each fused_attn engine's cost per call, its wall time per step (the GPU
time, or the launch where that is slower, plus the gaps a host path leaves between an engine's
kernels), as `fused_attn/speed/<arch>.csv`, the table backend="auto" chooses from (rows of the
families measured replace older ones).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fused_attn  # noqa: E402
from fused_attn import engine_speed, engines, testing  # noqa: E402
from benchmarks.engine_families import DT, FAMILIES, Family, make_inputs, ours_kwargs  # noqa: E402
from benchmarks.timing import device_ms_per_call, host_us_launching, host_us_rounds  # noqa: E402


def implementations(fam: Family) -> Dict[str, Callable]:
    """name -> fn(q, k, v, sinks, extra) returning the output (bshd / thd)."""
    impls: Dict[str, Callable] = {}
    for backend in ("auto", "cudnn", "fa4"):
        def ours(q, k, v, sinks, extra, backend=backend):
            return fused_attn.dot_product_attention(q, k, v, backend=backend, **ours_kwargs(fam, extra, sinks))
        impls[f"fused_attn {backend}"] = ours
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception:
        flash_attn_func = None
    if flash_attn_func is not None:
        def fa4(q, k, v, sinks, extra):
            kw = dict(causal=fam.causal, softcap=fam.softcap or 0.0, learnable_sink=sinks)
            if fam.window is not None:
                kw["window_size"] = (fam.window, 0)
            if fam.varlen:
                got = flash_attn_varlen_func(q, k, v, cu_seqlens_q=extra["cu"], cu_seqlens_k=extra["cu"],
                                             max_seqlen_q=extra["max_len"], max_seqlen_k=extra["max_len"], **kw)
            else:
                got = flash_attn_func(q, k, v, **kw)
            return got[0] if isinstance(got, tuple) else got
        impls["flash-attn-4"] = fa4
    if not fam.varlen and fam.softcap is None and not fam.sinks and fam.window is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for label, kind in (("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(q, k, v, sinks, extra, kind=kind):
                with sdpa_kernel([kind]):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=fam.causal,
                        enable_gqa=fam.h != fam.hkv)
                return o.transpose(1, 2)
            impls[label] = sdpa
    if fam.varlen and fam.softcap is None and not fam.sinks:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            varlen_attn = None
        if varlen_attn is not None:
            def tvarlen(q, k, v, sinks, extra):
                m = extra["max_len"]
                try:
                    return varlen_attn(q, k, v, extra["cu"], extra["cu"], m, m, is_causal=fam.causal)
                except TypeError:
                    return varlen_attn(q, k, v, extra["cu"], extra["cu"], m, m,
                                       window_size=(-1, 0) if fam.causal else (-1, -1))
            impls["torch varlen_attn"] = tvarlen
    return impls


def check(fam: Family, impls: Dict[str, Callable]) -> Dict[str, str]:
    """name -> "ok (err/bound)" or the reason it is wrong / cannot run, on B=1, S/4."""
    b, s = 1, max(fam.s // 4, 256)
    q, k, v, dout, sinks, extra = make_inputs(fam, b, s, seed=11)
    kw = ours_kwargs(fam, extra, sinks)

    def ref(dtype):
        cast = [t.to(dtype) for t in (q, k, v)]
        return fused_attn.dot_product_attention(*cast, backend="reference", **{
            **kw, "sinks": None if sinks is None else sinks.to(torch.float64 if dtype == torch.float64 else torch.float32)})

    exact = ref(torch.float64)
    bound = testing.bound_from(ref(DT), exact, DT)
    status = {}
    for name, fn in impls.items():
        try:
            got = fn(q, k, v, sinks, extra)
            err = testing.max_error(got, exact)
            status[name] = f"ok ({err:.2e} <= {bound:.2e})" if err <= bound else f"WRONG ({err:.2e} > {bound:.2e})"
        except Exception as exc:  # a peer that cannot run this configuration: say why
            status[name] = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
    return status


#: wall time: rounds in which every implementation takes its turn, steps per turn (`wall_rounds`)
WALL_ROUNDS, WALL_STEPS = 5, 20


def prepare(fn: Callable, args, dout, grad: bool) -> Tuple[Callable[[], None], Dict[str, float]]:
    """(step, costs): one step (forward, or forward + backward) of `fn` on `args`; costs holds
    its first call (kernel compile / graph build, reported apart), host time per call while the
    GPU works behind it and device time per call, each measured after three warm steps."""
    q, k, v, sinks, extra = args
    dev = torch.device("cuda")
    if grad:
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

        def step():
            out = fn(*leaves, sinks, extra)
            torch.autograd.backward(out, dout)
            for t in leaves:
                t.grad = None
    else:
        def step():
            with torch.no_grad():
                fn(q, k, v, sinks, extra)
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host = host_us_launching(step, dev, calls=10)
    gpu = device_ms_per_call(step, dev, host, calls=10)
    return step, dict(gpu_ms=gpu, host_us=host, first_ms=first_ms)


def wall_rounds(steps: Dict[Tuple[str, bool], Callable[[], None]], rounds: int = WALL_ROUNDS,
                n: int = WALL_STEPS) -> Dict[Tuple[str, bool], Tuple[float, float]]:
    """Wall time per step, ms, over `n` back-to-back steps and one synchronize, in `rounds` rounds in
    which every step takes its turn (`host_us_rounds`, the steps already warm: a slow stretch of
    the host, a clock change or a collection pass lands on all alike): key -> (median over rounds,
    (max - min) / median)."""
    got = host_us_rounds(steps, torch.device("cuda"), calls=n, rounds=rounds, warmup=0)
    medians = {key: sorted(times)[len(times) // 2] for key, times in got.items()}
    return {key: (m / 1e3, (max(got[key]) - min(got[key])) / m) for key, m in medians.items()}


def family_key(fam: Family, q, k, v, sinks, extra, grad: bool):
    """(family, seq) as backend="auto" looks them up."""
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    ex = fused_attn.explain(*leaves, backend="auto", **ours_kwargs(fam, extra, sinks))
    engine = ex.backend if ex.backward_backend in ("", ex.backend) else engine_speed.pair_name(ex.backend,
                                                                                              ex.backward_backend)
    return ex.family, (extra["max_len"] if fam.varlen else fam.s), engine, ex.reason


PEERS = ("flash-attn-4", "sdpa cudnn", "sdpa flash", "torch varlen_attn")


def write_markdown(rows: List[dict], path: str, header: str) -> None:
    """Per family: fused_attn auto against the best peer of the same run, GPU time and wall time
    per step, forward and forward + backward (ratio = peer / ours: above 1, ours is faster)."""
    lines = [f"# Engines and peers: {header}", "",
             "Times in ms per call (GPU: device time; wall: per step, back-to-back steps, the median of "
             f"{WALL_ROUNDS} rounds in which the implementations take turns). Ratio = best peer / "
             "fused_attn auto (above 1: ours faster). Every implementation was checked against the float64 "
             "reference first (B=1, S/4 of the same configuration).", "",
             "| family | auto engine | fwd gpu auto / best peer | ratio | fwd wall auto / best peer | ratio | "
             "fwd+bwd gpu auto / best peer | ratio | fwd+bwd wall auto / best peer | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_family: Dict[str, List[dict]] = {}
    for r in rows:
        by_family.setdefault(r["family_name"], []).append(r)
    for name, group in by_family.items():
        auto = next((r for r in group if r["impl"] == "fused_attn auto" and r.get("fwd_gpu_ms")), None)
        peers = [r for r in group if r["impl"] in PEERS and r.get("fwd_gpu_ms")]
        if auto is None or not peers:
            continue
        cells = [name, str(auto.get("auto_engine", ""))]
        for key in ("fwd_gpu_ms", "fwd_wall_ms", "fwd_bwd_gpu_ms", "fwd_bwd_wall_ms"):
            best = min(peers, key=lambda r: float(r[key]))
            ours, theirs = float(auto[key]), float(best[key])
            cells += [f"{ours:.3f} / {theirs:.3f} ({best['impl']})", f"{theirs / ours:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def call_cost(row: dict, what: str) -> float:
    """What one call costs a step: its wall time per step over back-to-back steps, which holds
    its GPU time, its launch where that is slower, and the gaps left between an engine's kernels
    while its host path prepares the next one (FA4's backward launches three); rows without a
    wall time (older runs): max(GPU time, host time)."""
    wall = row.get(f"{what}_wall_ms")
    if wall not in (None, ""):
        return float(wall)
    return max(float(row[f"{what}_gpu_ms"]), float(row[f"{what}_host_us"]) / 1e3)


def table_from_csv(path: str, arch: str) -> str:
    """Rewrite the engine table from an engines.csv of an earlier run (no GPU needed)."""
    with open(path, newline="") as fh:
        rows = [dict(r) for r in csv.DictReader(fh)]
    return write_table([r for r in rows if r.get("fwd_gpu_ms")], arch)


def write_table(rows: List[dict], arch: str) -> str:
    """Store the forced-engine rows ("fused_attn cudnn" / "fused_attn fa4") as the table `auto`
    ranks by (`fused_attn.engine_speed`): per family, length and engine, the cost per call
    (`call_cost`) and the GPU time, forward and forward + backward; and where `auto` split a
    training call, its row as the pair's ("fa4+cudnn": `engine_speed.split` reads its fwd+bwd).
    Rows of families this run did not measure are kept, and so are pair rows it did not re-measure
    (a pair measured slower than one engine is not run again by auto, so not re-measured).
    Returns the table's path."""
    path = engine_speed.table_path(arch)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    old = []
    if os.path.exists(path):
        with open(path, newline="") as fh:
            old = list(csv.DictReader(fh))
    new = {}
    for r in rows:
        pair = r["impl"] == "fused_attn auto" and "+" in str(r.get("auto_engine", ""))
        forced = r["impl"] in ("fused_attn cudnn", "fused_attn fa4")
        if (forced or pair) and r.get("fwd_gpu_ms") and r.get("fwd_bwd_gpu_ms"):
            engine = r["auto_engine"] if pair else r["impl"].split()[1]
            new[(r["family"], str(r["seq"]), engine)] = dict(family=r["family"], seq=r["seq"], engine=engine,
                                                             fwd_ms=f"{call_cost(r, 'fwd'):.4f}",
                                                             fwd_bwd_ms=f"{call_cost(r, 'fwd_bwd'):.4f}",
                                                             fwd_gpu_ms=f"{float(r['fwd_gpu_ms']):.4f}",
                                                             fwd_bwd_gpu_ms=f"{float(r['fwd_bwd_gpu_ms']):.4f}")
    measured = {(f, s) for f, s, _ in new}
    kept = [r for r in old if (r["family"], r["seq"]) not in measured
            or ("+" in r["engine"] and (r["family"], r["seq"], r["engine"]) not in new)]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["family", "seq", "engine", "fwd_ms", "fwd_bwd_ms", "fwd_gpu_ms",
                                           "fwd_bwd_gpu_ms"], restval="")
        w.writeheader()
        for r in kept + list(new.values()):
            w.writerow(r)
    engine_speed.clear()
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for engines.csv and engines.md")
    ap.add_argument("--write-table", action="store_true", help="store fused_attn/speed/<arch>.csv")
    ap.add_argument("--quick", action="store_true", help="the first three families only")
    ap.add_argument("--only", default="", help="comma-separated substrings of family names")
    ap.add_argument("--table-from", default="", metavar="ENGINES_CSV",
                    help="rewrite fused_attn/speed/<--arch>.csv from an earlier run's engines.csv and exit")
    ap.add_argument("--arch", default="sm90", help="the architecture of --table-from's run")
    args = ap.parse_args(argv)
    if args.table_from:
        print("wrote", table_from_csv(args.table_from, args.arch))
        return 0
    if not torch.cuda.is_available():
        print("bench engines needs a CUDA GPU; nothing was run")
        return 2
    os.makedirs(args.out, exist_ok=True)
    arch = engine_speed.arch_of(torch.device("cuda"))
    fams = FAMILIES[:3] if args.quick else FAMILIES
    if args.only:
        fams = [f for f in fams if any(p in f.name for p in args.only.split(","))]
    print(f"# {torch.cuda.get_device_name()} {arch}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"fa4 available: {engines.available('fa4')}")
    rows: List[dict] = []
    for fam in fams:
        impls = implementations(fam)
        status = check(fam, impls)
        q, k, v, dout, sinks, extra = make_inputs(fam, fam.b, fam.s)
        fkey, seq, auto_engine, auto_reason = family_key(fam, q, k, v, sinks, extra, grad=True)
        print(f"\n## {fam.name}  [{fkey} seq {seq}; auto -> {auto_engine}]")
        print(f"{'impl':<20} {'check':<34} {'fwd gpu':>8} {'fwd wall':>9} {'fwd host us':>11} "
              f"{'f+b gpu':>8} {'f+b wall':>9} {'f+b host us':>11} {'1st f+b ms':>10} {'spread%':>7}")
        family_rows: Dict[str, dict] = {}
        steps: Dict[Tuple[str, bool], Callable[[], None]] = {}  # every step of the family, timed in turns
        for name, fn in impls.items():
            row = family_rows[name] = dict(family_name=fam.name, family=fkey, seq=seq, impl=name, check=status[name],
                                           auto_engine=auto_engine)
            if not status[name].startswith("ok"):
                continue
            try:
                for grad, prefix in ((False, "fwd"), (True, "fwd_bwd")):
                    steps[(name, grad)], costs = prepare(fn, (q, k, v, sinks, extra), dout, grad)
                    row.update({f"{prefix}_{a}": b for a, b in costs.items()})
            except Exception as exc:  # timed neither way: its steps and costs go
                row["check"] = f"failed timing: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                for grad in (False, True):
                    steps.pop((name, grad), None)
                row = family_rows[name] = {k: val for k, val in row.items() if not k.startswith("fwd_")}
        for (name, grad), (wall, spread) in wall_rounds(steps).items():
            prefix = "fwd_bwd" if grad else "fwd"
            family_rows[name][f"{prefix}_wall_ms"] = wall
            family_rows[name][f"{prefix}_wall_spread"] = spread
        steps.clear()
        for name, row in family_rows.items():
            rows.append(row)
            if "fwd_bwd_wall_ms" in row:
                print(f"{name:<20} {row['check'][:34]:<34} {row['fwd_gpu_ms']:8.3f} {row['fwd_wall_ms']:9.3f} "
                      f"{row['fwd_host_us']:11.1f} {row['fwd_bwd_gpu_ms']:8.3f} {row['fwd_bwd_wall_ms']:9.3f} "
                      f"{row['fwd_bwd_host_us']:11.1f} {row['fwd_bwd_first_ms']:10.1f} "
                      f"{100 * max(row['fwd_wall_spread'], row['fwd_bwd_wall_spread']):7.1f}")
            else:
                print(f"{name:<20} {row['check'][:120]}")
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("family_name", "impl", "check"), k))
    with open(os.path.join(args.out, "engines.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    header = (f"{torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, "
              f"cuDNN {torch.backends.cudnn.version()}, bf16")
    write_markdown(rows, os.path.join(args.out, "engines.md"), header)
    if args.write_table:
        print("\nwrote", write_table(rows, arch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
