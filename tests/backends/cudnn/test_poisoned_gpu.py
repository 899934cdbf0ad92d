"""GPU property tests: NaN / Inf in keys and values a query does not attend never reach it.

Padding is often uninitialised memory, and keys outside every query's causal or sliding window
are never meant to be read. Random shapes (seeded), keys and values poisoned with NaN or +-Inf
where the mask hides them, results against the float64 reference computed from the clean inputs
(`fused_attn.testing`'s tolerance rule): outputs, dQ, and dK / dV (exactly 0 where no query
attends).
"""

import math
import random

import pytest
import torch

import fused_attn
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DT = torch.bfloat16
CASES = ["causal", "causal_window", "bottom_right_window", "padding", "padding_causal"]


def _draw(seed: int):
    """(kwargs of the call, bool mask (B, 1, Sq, Skv) of attended pairs, shapes) for one seed."""
    rng = random.Random(seed)
    case = CASES[seed % len(CASES)]
    b, h, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([64, 128])
    sq = rng.randrange(1, 300)
    skv = sq + rng.randrange(1, 260)
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    kw = {}
    if case == "causal":  # top-left: keys j >= Sq are seen by no query
        kw["attn_mask_type"] = "causal"
        mask = (j <= i).expand(b, sq, skv)
    elif case == "causal_window":
        left = rng.randrange(0, 64)
        kw.update(attn_mask_type="causal", window_size=(left, 0))
        mask = ((j <= i) & (j >= i - left)).expand(b, sq, skv)
    elif case == "bottom_right_window":  # keys before the first query's window are seen by none
        left = rng.randrange(0, 64)
        skv = sq + left + rng.randrange(1, 200)
        j = torch.arange(skv).view(1, -1)
        shift = skv - sq
        kw.update(attn_mask_type="causal_bottom_right", window_size=(left, 0))
        mask = ((j <= i + shift) & (j >= i + shift - left)).expand(b, sq, skv)
    else:
        lq = [rng.randrange(1, sq + 1) for _ in range(b)]
        lk = [rng.randrange(1, skv) for _ in range(b)]
        cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                                       device="cuda")
        kw.update(attn_mask_type=case, cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lk))
        rows = torch.stack([(i < n).expand(sq, skv) for n in lq])
        cols = torch.stack([(j < n).expand(sq, skv) for n in lk])
        mask = rows & cols
        if case == "padding_causal":  # the library's padding_causal is top-left per sequence
            mask = mask & (j <= i)
    return case, kw, mask.unsqueeze(1), (b, h, sq, skv, d), rng


@pytest.mark.parametrize("seed", range(20))
def test_unattended_keys_never_reach_outputs_or_gradients(seed):
    case, kw, mask, (b, h, sq, skv, d), rng = _draw(seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=DT, generator=g)
                   for n in (sq, skv, skv, sq))
    mask = mask.to("cuda")
    unseen = ~mask.any(dim=2).squeeze(1)  # (B, Skv): keys no query attends
    assert unseen.any(), "every drawn case hides some keys"
    poison = rng.choice([float("nan"), float("inf"), float("-inf")])
    kp, vp = k.clone(), v.clone()
    kp[unseen] = poison
    vp[unseen] = rng.choice([float("nan"), float("inf")])
    qp = q.clone()
    if case.startswith("padding"):  # query rows past a length: uninitialised too
        qp[~mask.any(dim=3).squeeze(1)] = float("nan")
    leaves = [t.requires_grad_() for t in (qp, kp, vp)]
    out = fused_attn.dot_product_attention(*leaves, backend="cudnn", **kw)
    grads = torch.autograd.grad(out, leaves, do)
    scale = 1 / math.sqrt(d)
    ql, kl, vl, dol = (t.transpose(1, 2) for t in (q, k, v, do))  # the clean inputs
    exact, _ = reference_attention(ql, kl, vl, scale, mask)
    assert torch.isfinite(out).all(), f"{case}: poisoned keys reached the output"
    assert_close(out.transpose(1, 2), exact, tolerance(ql, kl, vl, scale, DT, mask), f"{case} out")
    want, bounds = grad_tolerances(ql, kl, vl, dol, scale, DT, mask)
    for name, got, w, bound in zip(("dq", "dk", "dv"), grads, want, bounds):
        rows = ~mask.any(dim=3).squeeze(1) if name == "dq" else unseen
        assert torch.isfinite(got).all(), f"{case}: poisoned inputs reached {name}"
        assert_close(got.transpose(1, 2), w, bound, f"{case} {name}")
        assert (got[rows] == 0).all(), f"{case}: {name} rows that attend nothing are not 0"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("where", ["key", "value"])
def test_causal_keys_later_queries_see_do_not_reach_earlier_queries(seed, where, request):
    """A non-finite key or value at position j (seen by queries >= j) leaves queries < j exact;
    a value only where the quirk entry `nonfinite_value_in_causal_tile` does not apply (strict)."""
    if where == "value":
        from fused_attn.backends.cudnn import quirks, version

        ver = version.backend_version()
        if quirks.applies("nonfinite_value_in_causal_tile", ver):
            reason = quirks.QUIRKS["nonfinite_value_in_causal_tile"].refusal(ver, "a NaN value at an attended key")
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    rng = random.Random(100 + seed)
    b, h, d, s = 1, rng.choice([1, 2]), 64, rng.randrange(130, 400)
    pos = rng.randrange(1, s)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DT, generator=g) for _ in range(3))
    bad = (k if where == "key" else v).clone()
    bad[:, pos] = float("nan")
    args = (q, bad, v) if where == "key" else (q, k, bad)
    out = fused_attn.dot_product_attention(*args, attn_mask_type="causal", backend="cudnn")
    i = torch.arange(s, device="cuda").view(-1, 1)
    mask = (torch.arange(s, device="cuda").view(1, -1) <= i).view(1, 1, s, s)
    ql, kl, vl = (t.transpose(1, 2) for t in (q, k, v))
    exact, _ = reference_attention(ql, kl, vl, 1 / math.sqrt(d), mask)
    bound = tolerance(ql, kl, vl, 1 / math.sqrt(d), DT, mask)
    assert_close(out.transpose(1, 2)[:, :, :pos], exact[:, :, :pos], bound, f"rows before the poisoned {where}")
