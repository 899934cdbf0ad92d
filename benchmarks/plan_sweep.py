#!/usr/bin/env python3
"""Every execution plan cuDNN offers for the library's own graphs, timed (GPU machine).

    python benchmarks/plan_sweep.py [--out DIR] [--only NAME,...]

For each workload (a library call: doc-packed documents, the varlen step's batch, Gemma-2-style
softcap layers, a post-scale bias, a plain dense call) the call runs once through
`fused_attn`, which records the graphs it executes and their bound tensors. Each graph then
builds every plan of its ranked list (`build_plans(ALL)`), and each plan that builds runs on
the same bound tensors: median GPU ms over timed repetitions (CUDA events), and its outputs
against those of the plan the library runs (max |diff| / max |output|). Prints a table per
graph and writes plan_sweep.md / plan_sweep.csv under --out. It changes nothing in the
library: it answers whether the heuristic's first plan (the library's choice) is the fastest.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fused_attn  # noqa: E402
from fused_attn.backends.cudnn import runtime  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
OUTPUT_SLOTS = ("o", "stats", "dQ", "dK", "dV", "dBias")  # "o" and "stats" are inputs of a backward


def _record(call: Callable[[], None]) -> List[tuple]:
    """[(compiled graph, bound tensors)] of every execute `call` makes."""
    seen: List[tuple] = []
    real = runtime.execute

    def spy(compiled, bind, device_index):
        seen.append((compiled, dict(bind)))
        return real(compiled, bind, device_index)

    runtime.execute = spy
    try:
        call()
        torch.cuda.synchronize()
    finally:
        runtime.execute = real
    return seen


def _time(fn: Callable[[], None], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sweep_graph(compiled, bind: Dict[str, torch.Tensor]) -> List[dict]:
    """One row per plan of `compiled`'s graph: name, ms, workspace, max rel diff of outputs."""
    import cudnn

    g = compiled.graph
    handle = runtime.handle_for(torch.cuda.current_device())
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    tensors = [bind[s] for s in compiled.slots]
    backward = "dQ" in compiled.slots
    outs = [s for s in compiled.slots if s in OUTPUT_SLOTS and not (backward and s in ("o", "stats"))]

    def run_default():
        runtime.execute(compiled, bind, torch.cuda.current_device())

    base_ms = _time(run_default)
    base = {s: bind[s].detach().clone() for s in outs}
    try:
        g.build_plans(cudnn.build_plan_policy.ALL)
    except Exception as exc:  # noqa: BLE001 - report, keep going
        return [dict(plan="(build_plans ALL failed)", ms=None, note=f"{type(exc).__name__}: {str(exc)[:200]}")]
    rows = [dict(plan="library's plan", ms=base_ms, workspace=compiled.workspace_size, diff=0.0, note="")]
    for i in range(g.get_execution_plan_count()):
        try:
            name = g.get_plan_name_at_index(i)
        except Exception:  # noqa: BLE001
            name = f"plan {i}"
        try:
            ws_size = int(g.get_workspace_size_plan_at_index(i))
            ws = torch.empty(max(ws_size, 1), dtype=torch.uint8, device=DEV)

            def run(i=i, ws=ws):
                g.execute_plan_at_index(tensors, ws, index=i, handle=handle, tensor_uids=compiled.uids)

            for s in outs:
                bind[s].fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            diff = 0.0
            for s in outs:
                ref = base[s].float()
                got = bind[s].float()
                finite = torch.isfinite(ref)
                scale = ref[finite].abs().max().clamp_min(1e-6) if finite.any() else torch.tensor(1.0)
                d = (got[finite] - ref[finite]).abs().max() / scale if finite.any() else torch.tensor(0.0)
                if not torch.isfinite(got[finite]).all():
                    d = torch.tensor(float("inf"))
                diff = max(diff, float(d))
            ms = _time(run)
            rows.append(dict(plan=f"{i}: {name}", ms=ms, workspace=ws_size, diff=diff, note=""))
        except Exception as exc:  # noqa: BLE001 - a plan that does not build or run is reported
            rows.append(dict(plan=f"{i}: {name}", ms=None, workspace=None, diff=None,
                             note=f"{type(exc).__name__}: {str(exc)[:160]}"))
    for s in outs:  # leave the library's results in place
        bind[s].copy_(base[s])
    return rows


def _packed(total, h, d, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [torch.randn(total, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_() for _ in range(3)]


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


def workload_doc16():
    from benchmarks.varlen import _doc_bounds

    b, s, h, d = 2, 8192, 16, 64
    bounds = _doc_bounds(b, s, 16, seed=11)
    longest = int((bounds[:, 1:] - bounds[:, :-1]).max())
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_() for _ in range(3))
    cu = bounds.to(DEV)

    def call():
        out = fused_attn.doc_packed_attn(q, k, v, cu, is_causal=True, max_doc_len=longest)
        out.backward(torch.randn_like(out))
    return f"doc_packed B2 S8192 16 docs causal H16 D64 (longest {longest})", call


def _varlen(causal):
    gen = torch.Generator().manual_seed(17)
    lens = (torch.randint(1, 2048 // 64 + 1, (8,), generator=gen) * 64).tolist()
    q, k, v = _packed(sum(lens), 16, 64, 2)
    cu = _cu(lens)

    def call():
        out = fused_attn.varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0) if causal else (-1, -1))
        out.backward(torch.randn_like(out))
    return f"varlen N8 max {max(lens)} H16 D64" + (" causal" if causal else ""), call


def workload_varlen():
    return _varlen(False)


def workload_varlen_causal():
    return _varlen(True)


def _dense(b, s, h, hkv, d, **kw):
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(b, s, h, d, device=DEV, dtype=BF16, generator=g).requires_grad_()
    k, v = (torch.randn(b, s, hkv, d, device=DEV, dtype=BF16, generator=g).requires_grad_() for _ in range(2))

    def call():
        out = fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend="cudnn", **kw)
        out.backward(torch.randn_like(out))
    return call


def workload_gemma_global():
    from score_mods import softcap

    return "Gemma-2 global: softcap(50) + causal B4 S2048 H16/4 D64", _dense(
        4, 2048, 16, 4, 64, score_mod=softcap(50.0), attn_mask_type="causal")


def workload_gemma_local():
    from score_mods import softcap

    return "Gemma-2 local: softcap(50) + window 1023 B4 S2048 H16/4 D64", _dense(
        4, 2048, 16, 4, 64, score_mod=softcap(50.0), attn_mask_type="causal", window_size=(1023, 0))


def workload_bias():
    from score_mods import post_scale_bias

    g = torch.Generator(device=DEV).manual_seed(4)
    bias = torch.randn(1, 16, 4096, 4096, device=DEV, dtype=torch.float32, generator=g)
    return "post_scale_bias fp32 (1,H,S,S) B2 S4096 H16 D128", _dense(2, 4096, 16, 16, 128,
                                                                       score_mod=post_scale_bias(bias))


def workload_dense():
    return "dense B16 S1024 H16 D128", _dense(16, 1024, 16, 16, 128)


WORKLOADS = {"doc16": workload_doc16, "varlen": workload_varlen, "varlen_causal": workload_varlen_causal,
             "gemma_global": workload_gemma_global, "gemma_local": workload_gemma_local, "bias": workload_bias,
             "dense": workload_dense}


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(WORKLOADS)
    os.makedirs(args.out, exist_ok=True)
    lines = [f"# cuDNN plan sweep\n\ngpu {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"cudnn {torch.backends.cudnn.version()}\n"]
    csv_rows = []
    for name in names:
        try:
            title, call = WORKLOADS[name]()
            call()  # build every graph (not swept: the first call)
            recorded = _record(call)
        except Exception as exc:  # noqa: BLE001
            lines.append(f"\n## {name}\n\nfailed: {type(exc).__name__}: {exc}\n")
            print(lines[-1], flush=True)
            continue
        for n, (compiled, bind) in enumerate(recorded):
            rows = sweep_graph(compiled, bind)
            direction = "bwd" if "dQ" in compiled.slots else "fwd"
            head = f"\n## {title}: graph {n} ({direction})\n\n| plan | ms | workspace | max rel diff | note |\n|---|---|---|---|---|"
            body = [f"| {r['plan']} | {_fmt(r.get('ms'), '.4f')} | {r.get('workspace')} | {_fmt(r.get('diff'), '.2e')} "
                    f"| {r.get('note', '')} |" for r in rows]
            lines.append("\n".join([head] + body))
            print(lines[-1], flush=True)
            csv_rows += [dict(workload=title, graph=n, direction=direction, **r) for r in rows]
            with open(os.path.join(args.out, "plan_sweep.md"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(args.out, "plan_sweep.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=["workload", "graph", "direction", "plan", "ms", "workspace", "diff",
                                                  "note"])
                w.writeheader()
                w.writerows(csv_rows)


if __name__ == "__main__":
    main()
