"""Where the host time of one varlen training step goes (GPU machine).

    python benchmarks/varlen_step_profile.py [--out DIR]

The step of `benchmarks.steps` (N8 random lengths, multiples of 64 up to 2048, H16 D64
bf16, fwd + bwd, max_seqlen given). Prints: wall and host ms per step for fused_attn, torch's
varlen_attn and the empty-Function floor; host us of the step's pieces (the public forward
with and without autograd, the packed-batch preparation on fresh cu_seqlens, the forward and
backward graph executes with prepared bindings, a bare autograd backward); a cProfile of the
steps by own time; the torch profiler's host-side op table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`


def per_call_us(fn, args_list, repeat=3):
    """Median over `repeat` passes of host us per call of fn(*a) for a in args_list."""
    for a in args_list[:20]:
        fn(*a)
    torch.cuda.synchronize()
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for a in args_list:
            fn(*a)
        best.append((time.perf_counter() - t0) / len(args_list) * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[len(best) // 2]


def isolated_us(fn, n):
    """Median host us of fn() called on an idle GPU (a synchronize before each call): the
    launch cost alone, with no back-pressure from queued GPU work."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def behind_gpu_work_us(fn, n):
    """Median host us of fn() called while ~20 ms of GPU work is queued: a call that waits for
    the GPU anywhere shows up here as milliseconds."""
    fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        torch.cuda._sleep(40_000_000)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def dense_pieces():
    """Sync-isolated host us of the 1x128x1x64 bf16 dense call's pieces and its peers."""
    import torch.nn.functional as F

    import fused_attn
    from benchmarks.host_floors import EmptyAutogradFunction
    from fused_attn.plan import NO_VARLEN, get_plan
    from fused_attn.spec import resolve_spec

    q, k, v, do = (torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    spec, mod = resolve_spec(backend="cudnn")
    runner = get_plan(spec, mod, qg, kg, vg, NO_VARLEN).runner
    out, lse, saved, state = runner.forward(q, k, v, NO_VARLEN, mod, None)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    bwd_bind = dict(state[0], o=out, dO=do, stats=saved[4], dQ=grads[0], dK=grads[1], dV=grads[2])
    fwd_bind = dict(state[0], o=out, stats=saved[4])
    qt, kt, vt = (x.transpose(1, 2) for x in (qg, kg, vg))
    module = fused_attn.DotProductAttention(1, 64, backend="cudnn")
    pieces = {
        "dense graphs.run fwd (prepared bind)": lambda: runner.graphs.run("fwd", fwd_bind),
        "dense graphs.run bwd (prepared bind)": lambda: runner.graphs.run("bwd", bwd_bind),
        "dense runner.backward": lambda: runner.backward(state, saved, do),
        "dense functional fwd+bwd": lambda: fused_attn.dot_product_attention(qg, kg, vg, backend="cudnn").backward(do),
        "dense module fwd+bwd": lambda: module(qg, kg, vg).backward(do),
        "dense empty Function fwd+bwd": lambda: EmptyAutogradFunction.apply(qg, kg, vg).backward(do),
    }
    import score_mods

    cap = score_mods.softcap(30.0)
    for label, kw in (("softcap", {}), ("softcap + causal", {"attn_mask_type": "causal"})):
        pieces[f"dense {label} fwd (public call)"] = (
            lambda kw=kw: fused_attn.dot_product_attention(q, k, v, score_mod=cap, backend="cudnn", **kw))
        s_spec, s_mod = resolve_spec(backend="cudnn", score_mod=cap, **kw)
        s_runner = get_plan(s_spec, s_mod, q, k, v, NO_VARLEN).runner
        s_out, _, s_saved, s_state = s_runner.forward(q, k, v, NO_VARLEN, s_mod, None)
        s_bind = dict(s_state[0], o=s_out, stats=s_saved[4])
        compiled = s_runner.graphs.get("fwd")
        print(f"{label}: {len(compiled.slots)} graph slots {sorted(compiled.slots)}")
        pieces[f"dense {label} graphs.run fwd (prepared bind)"] = (
            lambda r=s_runner, b=s_bind: r.graphs.run("fwd", b))
        pieces[f"dense {label} runner.forward"] = (
            lambda r=s_runner, m=s_mod: r.forward(q, k, v, NO_VARLEN, m, None))
    rows = {name: isolated_us(fn, 500) for name, fn in pieces.items()}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dot = do.transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        rows["dense torch SDPA cuDNN fwd+bwd"] = isolated_us(
            lambda: F.scaled_dot_product_attention(qt, kt, vt).backward(dot), 500)
    return rows


def main() -> None:
    import fused_attn
    from fused_attn.backends.cudnn import varlen as VL
    from benchmarks.host_floors import EmptyAutogradFunction
    from benchmarks.steps import _batches, _step_fn
    from fused_attn.plan import Varlen, get_plan
    from torch.nn.attention.varlen import varlen_attn as torch_varlen

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    dev = torch.device("cuda")
    n, max_len, h, d = 8, 2048, 16, 64
    batches = _batches(args.steps, n, max_len, dev, seed=17)
    gen = torch.Generator(device=dev).manual_seed(5)
    bufs = [torch.randn(n * max_len, h, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    qb, kb, vb = (t.requires_grad_() for t in bufs[:3])
    lines = []

    impls = {
        "fused_attn": lambda q, k, v, cq, ck, mq, mk: fused_attn.varlen_attn(q, k, v, cq, ck, mq, mk),
        "torch_varlen": lambda q, k, v, cq, ck, mq, mk: torch_varlen(q, k, v, cq, ck, mq, mk),
        "floor (empty Function)": lambda q, k, v, *_: EmptyAutogradFunction.apply(q, k, v),
    }
    steps = {}
    for name, fn in impls.items():
        step = steps[name] = _step_fn(fn, qb, kb, vb, bufs[3])
        for b in batches[:30]:
            step(b)
        torch.cuda.synchronize()
        for _ in range(2):
            t0 = time.perf_counter()
            for b in batches:
                step(b)
            host = (time.perf_counter() - t0) / len(batches) * 1e3
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / len(batches) * 1e3
        lines.append(f"{name:28s} wall {wall:7.3f} ms/step  host {host:7.3f} ms/step")

    # pieces, on the same batches
    b0 = batches[0]
    lens, cu = b0
    t = sum(lens)
    q, k, v, do = (x[:t].detach() for x in bufs)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    mx = max(lens)
    rows = {}
    from fused_attn.autograd import PlanAttention, attention
    from fused_attn.functional import run_spec
    from fused_attn.varlen import _resolve
    spec, mod = _resolve((-1, -1, True, None, False), None)
    varlen = Varlen(cu, cu, None, None, mx, mx)
    plan = get_plan(spec, mod, qg, kg, vg, varlen)
    runner = plan.runner
    out, lse, saved, state = runner.forward(q, k, v, varlen, mod, None)
    fwd_bind = dict(state[0], o=out, stats=saved[4])
    grads = [torch.empty_like(x) for x in (q, k, v)]
    bwd_bind = dict(state[0], o=out, dO=do, stats=saved[4], dQ=grads[0], dK=grads[1], dV=grads[2])
    pieces = {
        "varlen_attn fwd, no grad (memoized prep)": lambda: fused_attn.varlen_attn(q, k, v, cu, cu, mx, mx),
        "varlen_attn fwd, grad inputs (memoized prep)": lambda: fused_attn.varlen_attn(qg, kg, vg, cu, cu, mx, mx),
        "torch varlen_attn fwd, grad inputs": lambda: torch_varlen(qg, kg, vg, cu, cu, mx, mx),
        "get_plan (hit)": lambda: get_plan(spec, mod, qg, kg, vg, varlen),
        "run_spec (grad inputs)": lambda: run_spec(spec, mod, qg, kg, vg, varlen),
        "attention(runner, ...) (grad inputs)": lambda: attention(runner, qg, kg, vg, varlen, mod, None),
        "PlanAttention.apply (grad inputs)": lambda: PlanAttention.apply((runner, varlen, mod, None), qg, kg, vg),
        "empty Function fwd only (grad inputs)": lambda: EmptyAutogradFunction.apply(qg, kg, vg),
        "VL._prepare (one kernel + assertion)": lambda: VL._prepare(runner.layout, cu, cu, None, None, (t, t),
                                                                   (mx, mx)),
        "VL torch-op preparation (unmemoized)": lambda: VL.prepare_unchecked(runner.layout, cu, cu, None, None, (t, t),
                                                                            (mx, mx), one_kernel=False),
        "graphs.run fwd (prepared bind)": lambda: runner.graphs.run("fwd", fwd_bind),
        "graphs.run bwd (prepared bind)": lambda: runner.graphs.run("bwd", bwd_bind),
        "runner.forward (memoized prep)": lambda: runner.forward(q, k, v, varlen, mod, None),
        "runner.backward": lambda: runner.backward(state, saved, do),
        "torch.empty x3": lambda: [torch.empty_like(x) for x in (q, k, v)],
        "torch.sub of two int32 (9,) views": lambda: torch.sub(cu[1:], cu[:-1]),
        "step, fixed batch (prep memoized)": lambda: steps["fused_attn"](b0),
        "step, torch varlen, fixed batch": lambda: steps["torch_varlen"](b0),
        "step, floor, fixed batch": lambda: steps["floor (empty Function)"](b0),
    }
    for name, fn in pieces.items():
        rows[name] = isolated_us(fn, 300)
    for name in ("step, fixed batch (prep memoized)", "step, floor, fixed batch"):
        rows[name + ", behind queued GPU work"] = behind_gpu_work_us(pieces[name], 30)
    rows.update(dense_pieces())
    for name, val in rows.items():
        lines.append(f"{name:50s} {val:8.2f} us")

    step = steps["fused_attn"]
    pr = cProfile.Profile()
    pr.enable()
    for b in batches[:200]:
        step(b)
    torch.cuda.synchronize()
    pr.disable()
    for order in ("tottime", "cumtime"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(order).print_stats(35)
        lines.append(f"\n=== cProfile of 200 fused_attn steps, by {order}\n" + s.getvalue())

    from torch.profiler import ProfilerActivity, profile
    for name in ("fused_attn", "torch_varlen"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in batches[:20]:
                steps[name](b)
            torch.cuda.synchronize()
        counts = {}
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                counts[evt.name[:150]] = counts.get(evt.name[:150], 0) + 1
        lines.append(f"\n=== device activity of 20 {name} steps (name: count)")
        lines += [f"{c:5d}  {n}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])]
        runtime_calls = {}
        for evt in prof.events():
            if evt.name.startswith(("cuda", "cu")) and evt.device_type != torch.autograd.DeviceType.CUDA:
                runtime_calls[evt.name] = runtime_calls.get(evt.name, 0) + 1
        lines.append(f"--- runtime / driver calls of 20 {name} steps: " + ", ".join(
            f"{n} {c}" for n, c in sorted(runtime_calls.items(), key=lambda kv: -kv[1])))
    for name in ("fused_attn", "torch_varlen"):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in batches[:50]:
                steps[name](b)
            torch.cuda.synchronize()
        lines.append(f"\n=== torch profiler, 50 {name} steps, by self CPU time\n"
                     + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "varlen_step_profile.txt"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
