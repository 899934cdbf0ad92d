"""Child process of the persistent-cache GPU test (tests/backends/cudnn/test_plan_gpu.py): a fresh process that runs stored configurations.

argv: directory, mode ("store" or "load"). Runs each configuration forward and backward on cuDNN,
checks the results against the float64 reference (fused_attn.testing) and prints one JSON line:
{"builds": n, "loads": n, "first_call_ms": {config: ms}, "store": StoreInfo fields}.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance

DT = torch.bfloat16
CAUSAL = torch.ones(256, 256, dtype=torch.bool).tril()


def _softcap(s, b, h, q, k):
    return 20.0 * torch.tanh(s / 20.0)


CONFIGS = {
    "causal": (dict(attn_mask_type="causal"), CAUSAL, None),
    "softcap": (dict(score_mod=sm.softcap(20.0)), None, _softcap),
    "causal_thd": (dict(attn_mask_type="padding_causal", qkv_format="thd"), None, None),
}


def run(name: str) -> float:
    kw, mask, score_fn = CONFIGS[name]
    g = torch.Generator(device="cuda").manual_seed(sorted(CONFIGS).index(name))
    thd = kw.get("qkv_format") == "thd"
    shape = (256, 2, 64) if thd else (1, 256, 2, 64)
    q, k, v, do = (torch.randn(*shape, device="cuda", dtype=DT, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    extra = {}
    if thd:
        cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
        extra = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=156, max_seqlen_kv=156)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fused_attn.dot_product_attention(q, k, v, backend="cudnn", **kw, **extra)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    pieces = [(0, 100), (100, 256)] if thd else [(0, 256)]
    for a, b in pieces:
        def logical(t):
            return (t[a:b].unsqueeze(0) if thd else t).detach().transpose(1, 2).double().cpu()

        ql, kl, vl, dol = (logical(t) for t in (q, k, v, do))
        m = torch.ones(b - a, b - a, dtype=torch.bool).tril() if thd else mask
        exact, _ = reference_attention(ql, kl, vl, 0.125, m, score_fn)
        assert_close(logical(out), exact, tolerance(ql, kl, vl, 0.125, DT, m, score_fn), f"{name} out")
        want, bounds = grad_tolerances(ql, kl, vl, dol, 0.125, DT, m, score_fn)
        for what, got, e, bound in zip(("dq", "dk", "dv"), grads, want, bounds):
            assert_close(logical(got), e, bound, f"{name} {what}")
    return ms


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    fused_attn.graph_cache.set_persistent_dir(directory)
    first = {name: run(name) for name in CONFIGS}
    info = fused_attn.graph_cache.cache_info()
    print(json.dumps({"mode": mode, "builds": info.builds, "loads": info.loads, "first_call_ms": first,
                      "store": fused_attn.graph_cache.persistent_info()._asdict()}))


if __name__ == "__main__":
    main()
