"""GPU property test for cuDNN 9.19's backward fault: dQ goes NaN / wrong when the key length is
64 mod 128 and a row's log-sum-exp falls below about -88.7 (fp32 exp underflow). Random shapes
(seeded) whose key lengths are drawn around multiples of 128 and 64 mod 128, rows poisoned with a
strong negative bias (-200 .. -120) and, for fp16, ALiBi with steep slopes; every result is either
exact against float64 (`fused_attn.testing`'s rule, gradients included) or refused on
`backend="cudnn"` with the documented reason — never NaN, never a silent wrong gradient.
"""

import math
import random

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _draw(seed: int):
    rng = random.Random(1000 + seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    b, h, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([64, 128])
    skv = 128 * rng.randrange(1, 5) + rng.choice([0, 64, 64, rng.randrange(1, 128)])
    sq = rng.choice([skv, rng.randrange(16, 400)])
    form = rng.choice(["bias", "bias+softcap", "alibi"])
    causal = rng.random() < 0.3 and sq <= skv
    return rng, dtype, (b, h, sq, skv, d), form, causal


@pytest.mark.parametrize("seed", range(16))
def test_strongly_negative_rows_keep_exact_gradients(seed):
    rng, dtype, (b, h, sq, skv, d), form, causal = _draw(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g) for n in (sq, skv, skv, sq))
    kw = dict(attn_mask_type="causal_bottom_right" if causal else "no_mask")
    if form == "alibi":  # score + slopes[h] * (kv_idx - q_idx), steep slopes
        slopes = torch.tensor([rng.uniform(0.5, 4.0) for _ in range(h)], device="cuda")
        mod = sm.alibi(slopes)
        s64 = slopes.double()
        fn = lambda s, bi, hi, qi, ki: s + s64[hi] * (ki - qi)
    else:
        bias = torch.zeros(1, h, sq, skv, device="cuda", dtype=dtype)
        rows = torch.tensor(rng.sample(range(sq), max(1, sq // 2)), device="cuda")
        bias[:, :, rows] = rng.uniform(-200.0, -120.0)
        b64 = bias.double()
        mod = sm.post_scale_bias(bias)
        fn = lambda s, bi, hi, qi, ki: s + b64[0, hi, qi, ki]
        if form == "bias+softcap":
            mod = sm.compose(sm.softcap(30.0), sm.post_scale_bias(bias))
            fn = lambda s, bi, hi, qi, ki: 30.0 * torch.tanh(s / 30.0) + b64[0, hi, qi, ki]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = fused_attn.dot_product_attention(*leaves, score_mod=mod, backend="cudnn", **kw)
        grads = torch.autograd.grad(out, leaves, do)
    except NotImplementedError as exc:  # a documented refusal, with the reason
        assert "64 mod 128" in str(exc) or "cuDNN" in str(exc), str(exc)
        return
    assert all(torch.isfinite(t).all() for t in [out, *grads]), f"{form} {dtype} skv={skv}: non-finite result"
    scale = 1 / math.sqrt(d)
    ql, kl, vl, dol = (t.transpose(1, 2) for t in (q, k, v, do))
    mask = None
    if causal:
        i = torch.arange(sq, device="cuda").view(-1, 1)
        mask = (torch.arange(skv, device="cuda").view(1, -1) <= i + (skv - sq)).view(1, 1, sq, skv)
    exact, _ = reference_attention(ql, kl, vl, scale, mask, fn)
    assert_close(out.transpose(1, 2), exact, tolerance(ql, kl, vl, scale, dtype, mask, fn), f"{form} out")
    want, bounds = grad_tolerances(ql, kl, vl, dol, scale, dtype, mask, fn)
    for name, got, w, bound in zip(("dq", "dk", "dv"), grads, want, bounds):
        assert_close(got.transpose(1, 2), w, bound, f"{form} {dtype} skv={skv} {name}")
