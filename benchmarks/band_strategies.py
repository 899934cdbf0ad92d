"""The measurements behind `fused_attn.backends.cudnn.band_chunks`' cost model (GPU machine).

    python benchmarks/band_strategies.py [--out DIR]

A banded score_mod call (softcap(50) with a causal mask or a 1024-token window, bf16, D64, GQA
16/4) run each way `band_chunks.strategy` can choose, forced one after another: the plain call
(None), query rectangles with the plain backward ("forward"), rectangles both ways ("both"),
query rectangles with the packed-window backward ("ragged", windows only), then the model's own
choice. For each, forward only and training (forward + backward):

* wall_ms: back-to-back calls, one synchronize after (what a loop of these calls sees);
* gpu_ms: the same calls enqueued behind a long sleep kernel, CUDA events around them (the
  kernels alone, no host gaps);
* enqueue_ms: host time per call while the GPU is busy (behind the sleep).

A probe: it times, it does not check results (the GPU tests compare every strategy with the
float64 reference: tests/backends/cudnn/test_cudnn_gpu.py::test_banded_score_mod_in_rectangles_matches_float64).
Writes band_strategies_<gpu>.md / .csv.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`

SHAPES = (("B1 H1 S1024", (1, 1024, 1, 1)), ("B4 H16/4 S2048", (4, 2048, 16, 4)), ("B2 H16/4 S4096", (2, 4096, 16, 4)),
          ("B1 H16/4 S8192", (1, 8192, 16, 4)))
BANDS = (("causal", dict(attn_mask_type="causal")), ("window 1024", dict(window_size=(1023, 0))))
HEAD_DIM = 64


def _inputs(b, s, h, hkv):
    q = torch.randn(b, s, h, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, s, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, s, hkv, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn_like(q)


def _call(q, k, v, do, mask_kw, train):
    import fused_attn
    import score_mods

    cap = score_mods.softcap(50.0)

    def run():
        if train:
            out = fused_attn.dot_product_attention(q, k, v, score_mod=cap, **mask_kw)
            torch.autograd.backward(out, do)
        else:
            with torch.no_grad():
                fused_attn.dot_product_attention(q, k, v, score_mod=cap, **mask_kw)
    return run


def _gpu_and_enqueue_ms(fn, n=8):
    """(GPU ms per call with no host gaps, host ms per call enqueued behind busy kernels)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(300_000_000)  # ~0.15 s: longer than enqueueing the n calls
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    enqueue = (time.perf_counter() - t0) / n * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, enqueue


def main() -> None:
    from fused_attn.backends.cudnn import band_chunks
    from fused_attn.backends.cudnn.band_ragged import area_fraction, geometry
    from benchmarks.common import environment, host_us_per_call, print_table, write_results
    from fused_attn.spec import resolve_spec

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    torch.manual_seed(0)
    model = band_chunks.strategy
    rows = []
    try:
        for label, (b, s, h, hkv) in SHAPES:
            q, k, v, do = _inputs(b, s, h, hkv)
            for band_label, mask_kw in BANDS:
                band = resolve_spec(score_mod=None, **mask_kw)[0].band
                pieces = band_chunks.plan_pieces(band, s, s)
                window = None if band.left is None else geometry(b, s, band.left)
                for train in (False, True):
                    ragged = area_fraction(window) if train and window is not None else None
                    chosen = model(pieces, b * h * s * s, HEAD_DIM, train, b * h * s * HEAD_DIM, ragged)
                    ways = (None, "forward", "both") if train else (None, "forward")
                    ways += ("ragged",) if ragged is not None else ()
                    for way in ways + ("model",):
                        band_chunks.strategy = model if way == "model" else (lambda *a, _w=way: _w)
                        band_chunks.clear_memos()
                        fn = _call(q, k, v, do, mask_kw, train)
                        wall = host_us_per_call(fn, torch.device("cuda"), 50) / 1e3
                        gpu, enqueue = _gpu_and_enqueue_ms(fn)
                        name = f"model's choice ({chosen or 'plain'})" if way == "model" else (way or "plain")
                        rows.append({"config": f"{label} D{HEAD_DIM} softcap(50) + {band_label}",
                                     "mode": "train" if train else "fwd", "way": name,
                                     "rectangles": f"{len(pieces.forward)} + {len(pieces.backward)}",
                                     "wall_ms": wall, "gpu_ms": gpu, "enqueue_ms": enqueue})
                        print(rows[-1], flush=True)
            del q, k, v, do
    finally:
        band_chunks.strategy = model
        band_chunks.clear_memos()
    env = environment(torch.device("cuda"))
    notes = ["way: plain; forward = query rectangles + the plain backward from their stitched output and lse; "
             "both = query rectangles forward, key rectangles backward; ragged = query rectangles forward, the "
             "packed-window backward (band_ragged: two packed graphs over the band); model's choice = "
             "band_chunks.strategy",
             "wall_ms: back-to-back calls, one sync after; gpu_ms: the calls queued behind a sleep kernel, events "
             "around them (no host gaps); enqueue_ms: host time per call while the GPU is busy",
             "rectangles: forward + backward pieces of the band"]
    print_table("band strategies", rows, env)
    write_results("band_strategies", rows, env, args.out, notes)


if __name__ == "__main__":
    main()
