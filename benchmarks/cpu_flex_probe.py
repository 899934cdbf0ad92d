#!/usr/bin/env python3
"""Probe of torch's compiled flex_attention on CPU: plain torch against float64 math (fused_attn: its bound only).

    python benchmarks/cpu_flex_probe.py [--out DIR]      (about 5 minutes on 2 cores: one compile per row)

What it backs: `fused_attn.backends.torch_flex.padded_head_dim`. torch 2.13's CPU flex kernel
(inductor's C++ template) computes q @ k^T with a micro-GEMM of 16-key tiles; for the tail tile
(fewer than 16 keys) it takes a shortcut when head_dim is a multiple of the vector width and below
24 that stores a full 16-key row even when the tail is one vector wide (8 keys with AVX2's 8 floats,
Skv % 16 == 8): it writes past the score tile (into the running row maxima) and reads keys past the
end, so the output is off by O(1) and varies from run to run. The rows: head dims 8 / 16 / 24 / 32
at Skv % 16 == 8 and == 0, softcap(3) and no score_mod, and the workaround (q and k zero-padded to
head dim 24, explicit scale). A row is `wrong` when its error exceeds the project's bound.

Writes DIR/cpu_flex_probe_<cores>cores.md (default DIR benchmarks/results).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.nn.attention.flex_attention import flex_attention

from fused_attn.testing import bound_from, max_error

ROWS = [  # (head dim, Sq, Skv, score_mod, pad q and k to 24)
    (16, 8, 8, "softcap", False), (16, 8, 24, "softcap", False), (16, 8, 24, None, False), (8, 8, 40, "softcap", False),
    (16, 8, 136, "softcap", False), (16, 8, 32, "softcap", False), (24, 8, 24, "softcap", False),
    (32, 8, 24, "softcap", False), (16, 8, 8, "softcap", True), (16, 8, 24, "softcap", True),
    (8, 8, 40, "softcap", True),
]


def _softcap(s, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(s / 3.0)


def _math(q, k, v, scale, mod):
    s = q @ k.transpose(-1, -2) * scale
    return (s if mod is None else 3.0 * torch.tanh(s / 3.0)).softmax(-1) @ v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    lines = [f"# cpu flex probe\n\ntorch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{os.cpu_count()} cores. B1 H2, float32, scale 1/sqrt(D); error: max |out - float64 math|.\n",
             "| head dim | Sq | Skv | Skv % 16 | score_mod | q, k padded to 24 | error | bound | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d, sq, skv, mod, pad in ROWS:
        gen = torch.Generator().manual_seed(d * 1000 + skv)
        q, k, v = (torch.randn(1, 2, n, d, generator=gen) for n in (sq, skv, skv))
        scale = 1 / math.sqrt(d)
        qk = [torch.nn.functional.pad(t, (0, 24 - d)) if pad else t for t in (q, k)]
        out = flex(*qk, v, score_mod=_softcap if mod else None, scale=scale)
        exact = _math(q.double(), k.double(), v.double(), scale, mod)
        bound = bound_from(_math(q, k, v, scale, mod), exact, torch.float32)
        err = max_error(out, exact)
        lines.append(f"| {d} | {sq} | {skv} | {skv % 16} | {mod or '-'} | {'yes' if pad else 'no'} | {err:.2e} | "
                     f"{bound:.1e} | {'ok' if err <= bound else 'WRONG'} |")
        print(lines[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"cpu_flex_probe_{os.cpu_count()}cores.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
