"""Packed score_mod calls served as one zero-padded dense batch (`backends/cudnn/packed_dense`).

CPU: the layout moves (tokens to padded rows and back, gaps between sequences), the per-sequence
bias (lengths, band, bottom-right shift) and the empty-row handling, with the reference backend's
dense runner standing in for cuDNN's: in float64 the result must equal the packed reference (both
exact; the bound only allows for summation order); the same for dense padded batches, which reach
it through their packed form. On cuDNN: test_varlen_gpu.py, test_varlen_api_gpu.py.
"""

import pytest
import torch

import score_mods as sm
from fused_attn.backends import reference
from fused_attn.backends.cudnn.packed_dense import PackedAsDenseRunner
from fused_attn.plan import Varlen, _static_problem
from fused_attn.spec import resolve_spec
from fused_attn.testing import agreement_bound, assert_close
from helpers.attention import cu_seqlens

CASES = [
    dict(mask="no_mask", lens_q=[5, 1, 37, 64, 3, 0, 8], lens_kv=[9, 3, 37, 20, 1, 4, 0]),
    dict(mask="causal_bottom_right", lens_q=[5, 1, 37, 64, 3, 0, 8], lens_kv=[9, 3, 37, 20, 1, 4, 0]),
    dict(mask="causal_bottom_right", window=(4, 0), lens_q=[5, 37, 30], lens_kv=[9, 20, 30], gap=2),
    dict(mask="no_mask", window=(3, 3), lens_q=[5, 37, 30], lens_kv=[9, 20, 30]),
    dict(mask="causal", lens_q=[9, 20, 30], lens_kv=[5, 37, 30], alibi=True),  # top-left, q > kv in one sequence
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_padded_dense_batch_equals_the_packed_reference(case, gen):
    h, hkv, d, gap = 4, 2, 16, case.get("gap", 0)
    lq, lk = case["lens_q"], case["lens_kv"]
    pq, pk = cu_seqlens(lq, gap), cu_seqlens(lk, gap)
    varlen = Varlen(cu_seqlens(lq), cu_seqlens(lk), pq if gap else None, pk if gap else None, max(lq), max(lk))
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
    q, k, v = rand(int(pq[-1]), h, d), rand(int(pk[-1]), hkv, d), rand(int(pk[-1]), hkv, d)
    mod = sm.alibi(sm.alibi_slopes(h).double()) if case.get("alibi") else sm.softcap(5.0)
    spec, mod = resolve_spec(qkv_format="thd", attn_mask_type=case["mask"], window_size=case.get("window"),
                             score_mod=mod, return_lse=True)
    problem = _static_problem(spec, mod, q, k, v, varlen, None, True)
    runner = PackedAsDenseRunner(problem, 91900, make_dense=reference.make_runner)
    ref = reference.make_runner(problem)
    out, lse, saved, state = runner.forward(q, k, v, varlen, mod, None)
    want_out, want_lse, ref_saved, ref_state = ref.forward(q, k, v, varlen, mod, None)
    assert_close(out, want_out, agreement_bound(want_out), "out")
    assert_close(lse, want_lse, agreement_bound(want_lse, torch.float32), "lse")  # the reference's lse is fp32
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    want = ref.backward(ref_state, ref_saved, do)
    for how, grads in (("state", runner.backward(state, saved, do)),
                       ("call", runner.backward_call(q, k, v, out, saved[4], varlen, mod, None, do)),
                       ("lse", runner.backward_with_lse(q, k, v, out, lse, varlen, mod, None, do))):
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert_close(g, w, agreement_bound(w), f"{how} {name}")
    if gap:  # nothing written between sequences
        between = torch.ones(q.shape[0], dtype=torch.bool)
        for start, n in zip(pq.tolist(), lq):
            between[start:start + n] = False
        assert between.any() and (out[between] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, (6, 6)])
def test_dense_padded_batch_through_its_packed_form_equals_the_reference(window, gen):
    """attn_mask_type="padding" (no causal mask, a two-sided window or none) with a score_mod:
    PaddedAsThdRunner -> the packed form -> the padded dense batch with the lengths in its bias,
    against the reference's padded call."""
    from fused_attn.backends.cudnn.padded import PaddedAsThdRunner

    b, s, h, hkv, d = 3, 40, 4, 2, 16
    lens_q, lens_kv = [5, 40, 17], [9, 33, 17]
    varlen = Varlen(cu_seqlens(lens_q), cu_seqlens(lens_kv))
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
    q, k, v = rand(b, s, h, d), rand(b, s, hkv, d), rand(b, s, hkv, d)
    spec, mod = resolve_spec(attn_mask_type="padding", window_size=window, score_mod=sm.softcap(5.0),
                             return_lse=True)
    problem = _static_problem(spec, mod, q, k, v, varlen, None, True)
    runner = PaddedAsThdRunner(problem, 91900, make_packed=lambda packed: PackedAsDenseRunner(
        packed, 91900, make_dense=reference.make_runner))
    ref = reference.make_runner(problem)
    out, lse, saved, state = runner.forward(q, k, v, varlen, mod, None)
    want_out, want_lse, ref_saved, ref_state = ref.forward(q, k, v, varlen, mod, None)
    real_q = torch.arange(s).view(1, s) < torch.tensor(lens_q).view(b, 1)  # (B, S) rows inside a sequence
    assert_close(out[real_q], want_out[real_q], agreement_bound(want_out[real_q]), "out")
    assert (out[~real_q] == 0).all()
    real_lse = want_lse.transpose(1, 2)[real_q]
    assert_close(lse.transpose(1, 2)[real_q], real_lse, agreement_bound(real_lse, torch.float32), "lse")
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64).masked_fill(~real_q.view(b, s, 1, 1), 0.0)
    want = ref.backward(ref_state, ref_saved, do)
    real_kv = torch.arange(s).view(1, s) < torch.tensor(lens_kv).view(b, 1)
    for how, grads in (("state", runner.backward(state, saved, do)),
                       ("lse", runner.backward_with_lse(q, k, v, out, lse, varlen, mod, None, do))):
        for name, g, w, real in zip(("dq", "dk", "dv"), grads, want, (real_q, real_kv, real_kv)):
            assert_close(g[real], w[real], agreement_bound(w[real]), f"{how} {name}")
