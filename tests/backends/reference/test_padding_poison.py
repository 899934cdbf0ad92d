"""Property tests (reference backend, CPU): NaN / +-Inf in padding never reaches a real token.

Dense padded batches (bshd / sbhd / bhsd with "padding" / "padding_causal" and cu_seqlens) and thd
with gaps: query, key and value rows past a length and grad_out rows past a query length are
poisoned; the outputs and the gradients of q, k and v must be finite everywhere, equal those of
the clean run exactly (padded rows' contents do not enter the computation), and the clean run
must match the float64 reference (`fused_attn.testing`'s tolerance rule).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance
from helpers.padding_cases import allowed, cases, logical_inputs, poisoned, run

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow  # many hypothesis examples; test_issue_reproducer keeps the property in the quick set
@SETTINGS
@given(case=cases(dtypes=(torch.float32, torch.float64, torch.bfloat16), head_dims=(8, 16)))
def test_poisoned_padding_never_reaches_real_tokens(case):
    clean = logical_inputs(case)
    got = run(case, clean, "cpu", "reference")
    mask = allowed(case)
    q, k, v, g = clean
    scale = 1 / math.sqrt(case.head_dim)
    want, _ = reference_attention(q, k, v, scale, mask)
    assert_close(got[0], want, tolerance(q, k, v, scale, case.dtype, mask), "clean out")
    exact, bounds = grad_tolerances(q, k, v, g, scale, case.dtype, mask)
    for name, a, e, bd in zip("qkv", got[1:], exact, bounds):
        assert_close(a, e, bd, f"clean d{name}")
    bad = run(case, poisoned(case, clean), "cpu", "reference")
    for name, a, b in zip(("out", "dq", "dk", "dv"), bad, got):
        assert torch.isfinite(a).all(), f"{name}: non-finite values with poisoned padding ({case})"
        assert torch.equal(a, b), f"{name}: differs from the clean run by {(a - b).abs().max():.3e} ({case})"


def test_issue_reproducer():
    """cu=[0,2,6], bshd B=2 S=4 H=1 D=8, NaN in the padded rows of q, then of k, then of grad_out."""
    from helpers.padding_cases import Case

    for poison_side in range(3):
        case = Case("bshd", "padding", 4, (2, 4), (2, 4), 1, 1, 8, torch.float32, math.nan, poison_side)
        clean = logical_inputs(case)
        q, k, v, g = (t.clone() for t in clean)
        (q, k, g)[poison_side][0, :, 2:] = math.nan
        bad = run(case, (q, k, v, g), "cpu", "reference")
        for a, b in zip(bad, run(case, clean, "cpu", "reference")):
            assert torch.isfinite(a).all() and torch.equal(a, b)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(dtypes=(torch.float32,), head_dims=(8,)))
def test_padded_as_thd_plumbing_keeps_padding_out(case):
    """cuDNN's padded path (`backends/cudnn/padded.py`: a dense padded batch run as packed thd with
    gaps) over the reference's packed runner, on CPU: its views, offsets and grad_out packing let
    no poisoned padding through (the GPU test runs it over cuDNN's ragged graphs)."""
    from hypothesis import assume

    from helpers.padding_cases import _cu, _to_format
    from fused_attn.backends import reference
    from fused_attn.backends.cudnn.padded import PaddedAsThdRunner
    from fused_attn.layouts import to_logical
    from fused_attn.plan import Varlen, _static_problem
    from fused_attn.spec import resolve_spec

    assume(case.fmt != "thd")

    def go(tensors):
        q, k, v, g = (_to_format(t, case.fmt).float() for t in tensors)
        spec, mod = resolve_spec(qkv_format=case.fmt, attn_mask_type=case.mask, backend="reference")
        varlen = Varlen(_cu(case.lens_q, "cpu"), _cu(case.lens_kv, "cpu"))
        runner = PaddedAsThdRunner(_static_problem(spec, mod, q, k, v, varlen, None, True), 0,
                                   make_packed=reference.make_runner)
        out, _lse, saved, state = runner.forward(q, k, v, varlen, mod, None)
        return [to_logical(t, case.fmt) for t in (out,) + tuple(runner.backward(state, saved, g)[:3])]

    clean = logical_inputs(case)
    for name, a, b in zip(("out", "dq", "dk", "dv"), go(poisoned(case, clean)), go(clean)):
        assert torch.isfinite(a).all(), f"{name}: non-finite values with poisoned padding ({case})"
        assert torch.equal(a, b), f"{name}: differs from the clean run ({case})"
