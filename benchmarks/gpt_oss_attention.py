"""gpt-oss-style attention on the GPU at hand: B4 S4096 H64/8 D64 bf16, a sliding window of 128
keys (causal), learnable sinks; forward + backward through `fused_attn.dot_product_attention`.

Checks one head's output and gradients (sinks included) against the float64 reference first, then
reports GPU time per step (CUDA events around back-to-back steps) and wall time per step
(perf_counter around synchronised steps), with the cuDNN version in the header.

    python benchmarks/gpt_oss_attention.py [--out DIR]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch

import fused_attn
from fused_attn.testing import bound_from

B, S, H, HKV, D, WINDOW = 4, 4096, 64, 8, 64, 128


def _call(q, k, v, sinks, backend="auto"):
    return fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", window_size=(WINDOW - 1, 0),
                                            softmax_type="learnable", sinks=sinks, backend=backend)


def check(dev) -> str:
    """One batch entry, 8 query heads / 1 kv head: cuDNN vs float64, out and every gradient."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 1024, n, D, generator=g, dtype=torch.float64) for n in (8, 1, 1)]
    sink0 = torch.randn(8, generator=g, dtype=torch.float64)
    do = torch.randn(1, 1024, 8, D, generator=g, dtype=torch.float64).to(dev)

    def run(dtype, backend):
        leaves = [t.to(dev, dtype).requires_grad_() for t in base]
        sinks = sink0.to(dev, torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        out = _call(*leaves, sinks, backend)
        return [out] + list(torch.autograd.grad(out, leaves + [sinks], do.to(dtype)))

    exact, same, got = run(torch.float64, "reference"), run(torch.bfloat16, "reference"), run(torch.bfloat16, "cudnn")
    worst = 0.0
    for name, e, s, x in zip(("out", "dq", "dk", "dv", "dsinks"), exact, same, got):
        err, bound = float((x.double() - e).abs().max()), bound_from(s.double(), e, torch.bfloat16)
        if not err <= bound:
            raise AssertionError(f"{name}: off by {err:.3g} > bound {bound:.3g}")
        worst = max(worst, err / bound)
    return f"checked against float64 (worst error {worst:.2f} of its bound)"


def time_steps(dev, steps: int = 20):
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(B, S, HKV, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(H, device=dev, generator=g).requires_grad_()
    do = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16, generator=g)

    def step():
        out = _call(q, k, v, sinks)
        torch.autograd.grad(out, (q, k, v, sinks), do)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / steps
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    return gpu_ms, statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for gpt_oss_attention_<gpu>_cudnn<ver>.md / .csv")
    args = ap.parse_args()
    dev = torch.device("cuda")
    import cudnn

    header = (f"gpu {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {cudnn.backend_version_string()}, "
              f"cudnn_frontend {cudnn.__version__}")
    note = check(dev)
    gpu_ms, wall_ms = time_steps(dev)
    plan = fused_attn.explain(torch.empty(B, S, H, D, device=dev, dtype=torch.bfloat16),
                              torch.empty(B, S, HKV, D, device=dev, dtype=torch.bfloat16),
                              torch.empty(B, S, HKV, D, device=dev, dtype=torch.bfloat16),
                              attn_mask_type="causal", window_size=(WINDOW - 1, 0), softmax_type="learnable",
                              sinks=torch.zeros(H, device=dev))
    rows = [("fused_attn fwd+bwd", f"{gpu_ms:.3f}", f"{wall_ms:.3f}", plan.backend, "+".join(plan.quirks) or "-")]
    lines = [f"# gpt-oss-style attention (B{B} S{S} H{H}/{HKV} D{D} bf16, window {WINDOW}, learnable sinks)", "",
             header, "", note, "", "| what | GPU ms / step | wall ms / step | engine | quirks |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"{torch.cuda.get_device_name().split()[-1].lower()}_cudnn{cudnn.backend_version_string()}"
        with open(os.path.join(args.out, f"gpt_oss_attention_{tag}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, f"gpt_oss_attention_{tag}.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["what", "gpu_ms", "wall_ms", "engine", "quirks"])
            w.writerows(rows)


if __name__ == "__main__":
    main()
