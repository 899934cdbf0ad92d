"""Where the host time of one eager call goes, piece by piece (GPU machine).

    python benchmarks/host_breakdown.py [--out DIR]

Times (perf_counter over many back-to-back calls, one synchronize after) the public call, the
module call, the plan lookup, the runner's forward, the runtime's execute with a prepared
binding, the lowered graph's raw-pointer execute alone, the allocations, and fwd+bwd; then a
cProfile of the functional forward and of the module's fwd+bwd (top entries by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch


def us(fn, n=3000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    import ctypes

    import fused_attn
    from fused_attn.backends.cudnn import runtime
    from fused_attn.plan import NO_VARLEN, get_plan
    from fused_attn.spec import resolve_spec

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    lines = []
    q, k, v = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    spec, mod = resolve_spec(backend="cudnn")
    plan = get_plan(spec, mod, q, k, v, NO_VARLEN)
    runner = plan.runner
    module = fused_attn.DotProductAttention(1, 64, backend="cudnn")
    rows = {
        "functional fwd": lambda: fused_attn.dot_product_attention(q, k, v, backend="cudnn"),
        "module fwd": lambda: module(q, k, v),
        "resolve_spec (memo hit)": lambda: resolve_spec(backend="cudnn"),
        "get_plan (hit)": lambda: get_plan(spec, mod, q, k, v, NO_VARLEN),
        "runner.forward": lambda: runner.forward(q, k, v, NO_VARLEN, None, None),
        "torch.empty out": lambda: torch.empty((1, 128, 1, 64), dtype=torch.bfloat16, device="cuda"),
        "graphs.get (cache hit)": lambda: runner.graphs.get("fwd"),
    }
    compiled = runner.graphs.get("fwd")
    out = torch.empty_like(q)
    stats = torch.empty((1, 1, 128, 1), device="cuda")
    bind = {"q": q, "k": k, "v": v, "o": out, "stats": stats, "attn_scale": runner.scale}
    rows["runtime.execute (prepared bind)"] = lambda: runtime.execute(compiled, bind, 0)
    if compiled.fast is not None:
        lowered, order, index = compiled.fast
        handle = runtime.handle_for(0)
        ws = runtime.workspace_for(0, runtime.current_stream(0), compiled.workspace_size)
        arr = (ctypes.c_int64 * len(order))(*[bind[s].data_ptr() for s in order])
        addr, slots, wsp, hp = ctypes.addressof(arr), len(order), ws.data_ptr(), handle.backend_handle
        rows["lowered._execute_with_raw_ptrs alone"] = lambda: lowered._execute_with_raw_ptrs(addr, slots, wsp, hp,
                                                                                              index)
        rows["ctypes pointer array (5 data_ptr)"] = lambda: (ctypes.c_int64 * len(order))(
            *[bind[s].data_ptr() for s in order])
    else:
        lines.append("no raw-pointer fast path on this graph")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    rows["functional fwd+bwd"] = lambda: fused_attn.dot_product_attention(qg, kg, vg, backend="cudnn").backward(do)
    rows["module fwd+bwd"] = lambda: module(qg, kg, vg).backward(do)
    rows["functional fwd (grad inputs, no bwd)"] = lambda: fused_attn.dot_product_attention(qg, kg, vg, backend="cudnn")
    for name, fn in rows.items():
        calls = 1000 if "bwd" in name else 3000
        lines.append(f"{name:45s} {us(fn, calls):8.2f} us")
    for name in ("functional fwd", "module fwd+bwd", "functional fwd+bwd"):
        pr = cProfile.Profile()
        fn = rows[name]
        pr.enable()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        lines.append(f"\n=== cProfile: {name} (300 calls)\n" + s.getvalue())
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "host_breakdown.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
