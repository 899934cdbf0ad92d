"""Property tests on the GPU (cuDNN backend): NaN / +-Inf in padding never reaches a real token.

The cases of test_padding_poison.py (dense padded batches, served as packed thd by
`backends/cudnn/padded.py`, and thd with gaps) in bf16 / fp16 with cuDNN head dims: outputs and
gradients of q, k, v finite with poisoned query / key / value / grad_out padding, equal to the clean
run (within the tolerance rule: cuDNN's dQ accumulation order may vary), and the clean run against
the float64 reference.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance
from helpers.padding_cases import allowed, cases, logical_inputs, poisoned, run
from helpers.mods import quirk_applies

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(dtypes=(torch.bfloat16, torch.float16), head_dims=(64, 128)))
def test_poisoned_padding_never_reaches_real_tokens_cudnn(case):
    clean = logical_inputs(case)
    if case.fmt != "thd" and case.s == 1 and quirk_applies("sq1_skv1_backward"):
        with pytest.raises(NotImplementedError, match="sq1_skv1_backward"):  # a dense Sq = Skv = 1 training call
            run(case, clean, "cuda", "cudnn")
        return
    got = run(case, clean, "cuda", "cudnn")
    mask = allowed(case)
    q, k, v, g = clean
    scale = 1 / math.sqrt(case.head_dim)
    want, _ = reference_attention(q, k, v, scale, mask)
    out_bound = tolerance(q, k, v, scale, case.dtype, mask)
    assert_close(got[0], want, out_bound, "clean out")
    exact, bounds = grad_tolerances(q, k, v, g, scale, case.dtype, mask)
    for name, a, e, bd in zip("qkv", got[1:], exact, bounds):
        assert_close(a, e, bd, f"clean d{name}")
    bad = run(case, poisoned(case, clean), "cuda", "cudnn")
    torch.cuda.synchronize()
    for name, a, b, bd in zip(("out", "dq", "dk", "dv"), bad, got, [out_bound] + list(bounds)):
        assert torch.isfinite(a).all(), f"{name}: non-finite values with poisoned padding ({case})"
        assert_close(a, b, 2 * bd, f"{name} poisoned vs clean ({case})")
