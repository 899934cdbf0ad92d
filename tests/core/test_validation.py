"""One test per validation error of dot_product_attention."""

from __future__ import annotations

import pytest
import torch

import fused_attn
from helpers.attention import cu_seqlens, rand


@pytest.fixture
def qkv(gen):
    return rand(gen, 2, 5, 4, 8), rand(gen, 2, 5, 2, 8), rand(gen, 2, 5, 2, 8)


@pytest.fixture
def packed(gen):
    return rand(gen, 7, 4, 8), rand(gen, 7, 2, 8), rand(gen, 7, 2, 8)


def call(q, k, v, **kw):
    kw.setdefault("backend", "reference")
    return fused_attn.dot_product_attention(q, k, v, **kw)


i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(qkv_format="bsdh"), ValueError, r"qkv_format='bsdh' is not supported; accepted: 'bshd'"),
    (dict(attn_mask_type="arbitrary"), ValueError, r"attn_mask_type='arbitrary' is not supported"),
    (dict(backend="flash"), ValueError, r"backend='flash' is not supported; accepted: 'auto', 'cudnn', 'fa4', 'torch', 'reference'"),
    (dict(window_size=(1, 2, 3)), ValueError, r"window_size must be None or a \(left, right\) pair"),
    (dict(window_size=(1.5, 0)), TypeError, r"window_size left must be an int >= -1.*1.5"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size left must be >= -1.*got -2"),
    (dict(window_size=(0, True)), TypeError, r"window_size right must be an int"),
    (dict(attn_mask_type="causal", window_size=(2, 3)), ValueError, r"causal mask needs the window's right bound"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale must be a positive float or None, finite in float32.*got 0.0"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be a positive float or None, finite in float32.*got nan"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a positive finite float.*'0.1'"),
    (dict(return_lse=1), TypeError, r"return_lse must be a bool, got 1"),
    (dict(deterministic="yes"), TypeError, r"deterministic must be a bool"),
    (dict(cu_seqlens_q=i32([0, 2, 5]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q/cu_seqlens_kv given with qkv_format='bshd' and attn_mask_type='no_mask': use attn_mask_type="
     r"'padding'"),
    (dict(attn_mask_type="padding"), ValueError, r"attn_mask_type='padding' needs both cu_seqlens_q and cu_seqlens_kv"),
    (dict(attn_mask_type="padding", cu_seqlens_q=[0, 2, 5], cu_seqlens_kv=i32([0, 2, 5])), TypeError,
     r"cu_seqlens_q must be a \(B\+1,\) int32 torch.Tensor, got list"),
    (dict(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 2, 5]), cu_seqlens_kv=i32([0, 2, 5])), TypeError,
     r"cu_seqlens_q must have dtype torch.int32, got torch.int64"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([[0, 2, 5]]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q must be 1-D of shape \(B\+1,\)"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([0, 2, 5, 5]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q and cu_seqlens_kv must have the same batch size"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([0, 2, 5, 5]), cu_seqlens_kv=i32([0, 2, 5, 6])), ValueError,
     r"cu_seqlens_q must have shape \(B\+1,\) = \(3,\) for batch size 2"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([1, 2, 5]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q must start at 0, got 1"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([0, 3, 2]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q must be non-decreasing, got 3 then 2 at index 2"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([0, 2, 8]), cu_seqlens_kv=i32([0, 2, 5])), ValueError,
     r"cu_seqlens_q gives a sequence length 6 > the tensors' sequence length 5"),
    (dict(attn_mask_type="padding", cu_seqlens_q=i32([0, 2, 5]), cu_seqlens_kv=i32([0, 2, 5]),
          cu_seqlens_q_padded=i32([0, 2, 5])), ValueError, r"cu_seqlens_q_padded is only accepted with qkv_format='thd'"),
    (dict(max_seqlen_q=3), ValueError, r"max_seqlen_q=3 is smaller than the query's sequence length \(5\)"),
    (dict(max_seqlen_kv=5.0), TypeError, r"max_seqlen_kv must be a Python int or None, got 5.0"),
    (dict(max_seqlen_kv=-1), ValueError, r"max_seqlen_kv must be >= 0, got -1"),
])
def test_dense_argument_errors(qkv, kw, exc, match):
    with pytest.raises(exc, match=match):
        call(*qkv, **kw)


def test_wrong_rank(gen):
    q, k, v = rand(gen, 2, 5, 4), rand(gen, 2, 5, 2, 8), rand(gen, 2, 5, 2, 8)
    with pytest.raises(ValueError, match=r"query must be a 4-D \(B, S, H, D\) tensor for qkv_format='bshd', "
                                         r"got shape \(2, 5, 4\)"):
        call(q, k, v)


def test_not_a_tensor(qkv):
    with pytest.raises(TypeError, match="key must be a torch.Tensor, got list"):
        call(qkv[0], [1.0], qkv[2])


def test_non_floating(qkv):
    with pytest.raises(TypeError, match=r"value must have a floating dtype \(float16, bfloat16, float32, float64\), "
                                        r"got torch.int64"):
        call(qkv[0], qkv[1], torch.ones(2, 5, 2, 8, dtype=torch.int64))


def test_dtype_mismatch(qkv):
    with pytest.raises(TypeError, match="query, key and value must share one dtype, got torch.float32, torch.float64"):
        call(qkv[0], qkv[1].double(), qkv[2])


def test_device_mismatch(qkv):
    with pytest.raises(ValueError, match="query, key and value must be on one device, got cpu, meta, cpu"):
        call(qkv[0], qkv[1].to("meta"), qkv[2])


def test_batch_mismatch(gen, qkv):
    with pytest.raises(ValueError, match="query, key and value must have one batch size, got 2, 3, 2"):
        call(qkv[0], rand(gen, 3, 5, 2, 8), qkv[2])


def test_key_value_seqlen_mismatch(gen, qkv):
    with pytest.raises(ValueError, match="key and value must have one sequence length .*got 5 and 6"):
        call(qkv[0], qkv[1], rand(gen, 2, 6, 2, 8))


def test_key_value_heads_mismatch(gen, qkv):
    with pytest.raises(ValueError, match="key and value must have the same number of heads, got 2 and 1"):
        call(qkv[0], qkv[1], rand(gen, 2, 5, 1, 8))


def test_heads_not_divisible(gen, qkv):
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        call(qkv[0], rand(gen, 2, 5, 3, 8), rand(gen, 2, 5, 3, 8))


def test_head_dim_mismatch(gen, qkv):
    with pytest.raises(ValueError, match="query and key must have the same head dim, got 8 and 16"):
        call(qkv[0], rand(gen, 2, 5, 2, 16), qkv[2])


@pytest.mark.parametrize("kw,exc,match", [
    (dict(), ValueError, r"qkv_format='thd' needs both cu_seqlens_q and cu_seqlens_kv, got cu_seqlens_q=None"),
    (dict(cu_seqlens_q=i32([0, 3, 6]), cu_seqlens_kv=i32([0, 3, 7])), ValueError,
     r"cu_seqlens_q\[-1\] must equal the query token count 7, got 6"),
    (dict(cu_seqlens_q=i32([0, 3, 7]), cu_seqlens_kv=i32([0, 3, 8])), ValueError,
     r"cu_seqlens_kv\[-1\] must equal the key/value token count 7, got 8"),
    (dict(cu_seqlens_q=i32([0, 3, 7]), cu_seqlens_kv=i32([0, 3, 7]), max_seqlen_q=3), ValueError,
     r"max_seqlen_q=3 is smaller than a sequence length \(4\)"),
    (dict(cu_seqlens_q=i32([0, 3, 6]), cu_seqlens_kv=i32([0, 3, 7]), cu_seqlens_q_padded=i32([0, 4, 6])), ValueError,
     r"cu_seqlens_q_padded\[-1\] must equal the query token count 7, got 6"),
    (dict(cu_seqlens_q=i32([0, 3, 6]), cu_seqlens_kv=i32([0, 3, 7]), cu_seqlens_q_padded=i32([0, 2, 7])), ValueError,
     r"cu_seqlens_q_padded leaves 2 tokens for sequence 0 of length 3"),
    (dict(cu_seqlens_q=i32([0, 3, 6]), cu_seqlens_kv=i32([0, 3, 7]), cu_seqlens_q_padded=i32([0, 4, 7, 7])),
     ValueError, r"cu_seqlens_q_padded must have the shape of cu_seqlens_q \(3,\), got \(4,\)"),
    (dict(cu_seqlens_q=i32([0, 3, 7]), cu_seqlens_kv=i32([0, 3, 7]).to("meta")), ValueError,
     r"cu_seqlens_kv must be on the query's device cpu, got meta"),
])
def test_thd_errors(packed, kw, exc, match):
    with pytest.raises(exc, match=match):
        call(*packed, qkv_format="thd", **kw)


def test_thd_max_seqlen_derived(packed):
    from fused_attn.plan import Varlen
    from fused_attn.length_checks import derive_max_seqlens

    assert derive_max_seqlens(Varlen(i32([0, 3, 7]), i32([0, 0, 7]))) == (4, 7)
    assert fused_attn.explain(*packed, qkv_format="thd", cu_seqlens_q=i32([0, 3, 7]),
                              cu_seqlens_kv=i32([0, 0, 7])).problem.endswith("float32 on cpu")


def test_score_mod_tensors_without_score_mod(qkv):
    pytest.importorskip("score_mods")
    with pytest.raises(ValueError, match="tensors given with no score_mod"):
        call(*qkv, score_mod_tensors={"x": torch.ones(1)})


def test_cu_seqlens_lengths_message(qkv):
    # dense padding accepts lengths <= S
    out = call(*qkv, attn_mask_type="padding", cu_seqlens_q=cu_seqlens([5, 0]), cu_seqlens_kv=cu_seqlens([2, 5]))
    assert torch.all(out[1] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("case", ["valid", "start", "decreasing", "q_limit", "kv_limit", "end", "pad_small"])
def test_device_value_check_each_condition(case):
    """The CUDA path's one-assertion cu_seqlens check, run on CPU tensors (where the assertion
    raises at once): each condition violated alone."""
    from fused_attn import length_checks

    cu_q, cu_kv = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 2, 6], dtype=torch.int32)
    names, extra, tokens, limits = ["cu_seqlens_q", "cu_seqlens_kv"], [], (7, 6), (4, 4)
    if case == "start":
        cu_q = torch.tensor([1, 3, 7], dtype=torch.int32)
    elif case == "decreasing":
        cu_kv = torch.tensor([0, 5, 6], dtype=torch.int32)
        cu_kv[1] = 7
    elif case == "q_limit":
        limits = (3, 4)
    elif case == "kv_limit":
        limits = (4, 3)
    elif case == "end":
        tokens = (7, 7)
    elif case == "pad_small":
        names, extra, tokens = names + ["cu_seqlens_q_padded"], [torch.tensor([0, 2, 9], dtype=torch.int32)], (9, 6)
    tensors = [cu_q, cu_kv] + extra
    if case == "valid":
        length_checks._check_values_on_device(names, tensors, tokens, limits)
        length_checks._check_values_on_device(names, tensors, None, limits)  # dense: no token counts
    else:
        with pytest.raises(RuntimeError, match="invalid cu_seqlens"):
            length_checks._check_values_on_device(names, tensors, tokens, limits)


def test_within_by_runs_equals_the_copied_bounds_form():
    """The capture-time form (bounds as kernel scalars, one clamp per run of equal bounds) says
    what the copied-bounds form says, over random values and bounds with repeated runs."""
    import random

    from fused_attn.length_checks import within, within_by_runs

    rng = random.Random(3)
    for _ in range(300):
        runs = [(rng.randrange(-3, 4), rng.randrange(0, 8), rng.randrange(1, 6)) for _ in range(rng.randrange(1, 5))]
        lo, hi = [], []
        for a, width, n in runs:
            lo += [a] * n
            hi += [a + width] * n
        values = torch.tensor([rng.randrange(-5, 14) for _ in lo], dtype=torch.int32)
        assert bool(within_by_runs(values, lo, hi)) == bool(within(values, lo, hi))
        assert bool(within_by_runs(values, lo, hi)) == all(a <= int(v) <= b for v, a, b in zip(values, lo, hi))
