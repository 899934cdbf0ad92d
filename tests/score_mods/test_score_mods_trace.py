"""Tracing, eager semantics, derived gradients, cache keys and decoration-time errors of score_mods."""

import math

import pytest
import torch

import score_mods as sm
from fused_attn.testing import agreement_bound, assert_close
from score_mods.autodiff import GRAD, grad_dag
from score_mods.eager import evaluate, index_env

B, H, SQ, SKV = 2, 4, 5, 7
IDX = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
       torch.arange(SQ).view(1, 1, SQ, 1), torch.arange(SKV).view(1, 1, 1, SKV))
LENS = (torch.full((B, 1, 1, 1), SQ), torch.full((B, 1, 1, 1), SKV))


def _eager(mod, score):
    return mod.eager(score, *IDX, *LENS)


def _score(*shape):
    return torch.randn(*(shape or (B, H, SQ, SKV)), dtype=torch.float64) * 3


def _mask_ref(score, allowed):
    return score.masked_fill(~allowed, -math.inf)


def test_library_eager_matches_hand_written_torch():
    s = _score()
    b, h, i, j = IDX
    torch.testing.assert_close(_eager(sm.causal(), s), _mask_ref(s, j <= i))
    torch.testing.assert_close(_eager(sm.causal_bottom_right(), s), _mask_ref(s, j <= i + SKV - SQ))
    d = j - i
    torch.testing.assert_close(_eager(sm.sliding_window(2, 1), s), _mask_ref(s, (d >= -2) & (d <= 1)))
    torch.testing.assert_close(_eager(sm.sliding_window(-1, 0, True), s), _mask_ref(s, d - (SKV - SQ) <= 0))
    torch.testing.assert_close(_eager(sm.sliding_window(1, -1, True), s), _mask_ref(s, d - (SKV - SQ) >= -1))
    torch.testing.assert_close(_eager(sm.sliding_window(-1, -1), s), s)
    torch.testing.assert_close(_eager(sm.softcap(1.5), s), 1.5 * torch.tanh(s / 1.5))
    bias = torch.randn(B, 1, SQ, SKV, dtype=torch.float64)
    torch.testing.assert_close(_eager(sm.post_scale_bias(bias), s), s + bias)
    slopes = sm.alibi_slopes(H).double()
    torch.testing.assert_close(_eager(sm.alibi(slopes), s), s + slopes.view(1, H, 1, 1) * (j - i))
    ids = torch.randint(0, 3, (B, SKV)).sort(dim=1).values
    sq = _score(B, H, SKV, SKV)
    jj = torch.arange(SKV)
    allowed = ids[:, None, :, None] == ids[:, None, None, :]
    got = sm.document_mask(ids).eager(sq, IDX[0], IDX[1], jj.view(1, 1, -1, 1), jj.view(1, 1, 1, -1), None, None)
    torch.testing.assert_close(got, _mask_ref(sq, allowed))
    ql, kl = torch.tensor([3, 5]).view(B, 1, 1, 1), torch.tensor([7, 2]).view(B, 1, 1, 1)
    torch.testing.assert_close(sm.padding_mask().eager(s, *IDX, ql, kl), _mask_ref(s, (i < ql) & (j < kl)))


def test_alibi_slopes_standard_values():
    torch.testing.assert_close(sm.alibi_slopes(8), torch.tensor([2.0 ** -(k + 1) for k in range(8)]))
    s6 = sm.alibi_slopes(6)
    assert s6.shape == (6,)
    torch.testing.assert_close(s6[:4], torch.tensor([2.0 ** (-2 * (k + 1)) for k in range(4)]))
    torch.testing.assert_close(s6[4:], torch.tensor([2.0 ** -1, 2.0 ** -3]))


def test_compose_applies_left_to_right_and_fuses():
    s = _score()
    mod = sm.compose(sm.softcap(2.0), sm.causal())
    b, h, i, j = IDX
    torch.testing.assert_close(_eager(mod, s), _mask_ref(2.0 * torch.tanh(s / 2.0), j <= i))
    assert isinstance(mod, sm.TracedMod) and mod.scalars() == {"m0_cap": 2.0}
    assert mod.bind(m0_cap=5.0).cache_key == mod.cache_key
    both = sm.compose(sm.softcap(2.0), sm.softcap(3.0))
    assert both.scalars() == {"m0_cap": 2.0, "m1_cap": 3.0}
    torch.testing.assert_close(_eager(both, s), 3.0 * torch.tanh(2.0 * torch.tanh(s / 2.0) / 3.0))
    assert sm.compose(sm.causal(), sm.softcap()).cache_key != sm.compose(sm.softcap(), sm.causal()).cache_key


def test_float_params_are_runtime_scalars():
    a, b = sm.softcap(30.0), sm.softcap(50.0)
    assert a.cache_key == b.cache_key and b.scalars() == {"cap": 50.0}
    assert b.cudnn_operands()["cap"].item() == 50.0
    assert sm.softcap(30.0).bind(cap=50).scalars() == {"cap": 50.0}
    assert sm.sliding_window(2, 1).cache_key == sm.sliding_window(9, 4).cache_key
    assert sm.sliding_window(2, 1).cache_key != sm.sliding_window(2, -1).cache_key
    assert sm.sliding_window(2, 1).cache_key != sm.sliding_window(2, 1, bottom_right=True).cache_key


def test_cache_keys_structural():
    @sm.score_mod
    def cap_a(score, b, h, q_idx, kv_idx, cap=30.0):
        return cap * sm.tanh(score / cap)

    @sm.score_mod
    def other_name(score, b, h, q_idx, kv_idx, cap=7.0):
        return cap * sm.tanh(score / cap)

    @sm.score_mod
    def const_2(score, b, h, q_idx, kv_idx):
        return score * 2.0

    @sm.score_mod
    def const_3(score, b, h, q_idx, kv_idx):
        return score * 3.0

    assert cap_a.cache_key == other_name.cache_key == sm.softcap().cache_key  # names are not part of the key
    assert const_2.cache_key != const_3.cache_key
    assert sm.causal().cache_key != sm.causal_bottom_right().cache_key
    k1 = sm.post_scale_bias(torch.randn(1, 1, 3, 3)).cache_key
    assert k1 == sm.post_scale_bias(torch.randn(2, 4, 3, 3)).cache_key
    assert k1 != sm.post_scale_bias(torch.randn(1, 1, 3, 3, dtype=torch.float16)).cache_key
    hash(k1)
    assert "0x" not in repr(k1) and "def " not in repr(k1)


def test_user_function_and_derived_gradient_vs_autograd():
    @sm.score_mod
    def fancy(score, b, h, q_idx, kv_idx, a=0.7, bias=sm.TensorParam()):
        x = sm.sigmoid(score * a) + sm.exp(-sm.abs(score)) / (1.5 + sm.sqrt(score * score + 1.0))
        y = sm.maximum(x, score - 0.2) - sm.minimum(sm.log(score * score + 2.0), 3.0 - score) + bias[h, q_idx, kv_idx]
        keep = sm.logical_or(kv_idx - q_idx <= 1, sm.logical_not(b == 0)) & (h != 2)
        return sm.where(keep, y, -sm.tanh(score))

    bias = torch.randn(H, SQ, SKV, dtype=torch.float64)
    mod = fancy(bias=bias, a=1.3)
    s = _score().requires_grad_(True)
    out = _eager(mod, s)
    ds = torch.randn_like(out)
    (gref,) = torch.autograd.grad(out, s, ds)
    env = index_env(s.detach(), *IDX, *LENS)
    env["grad"] = ds
    got = evaluate(grad_dag(mod.root), env, {**mod.scalars(), **mod.tensors()})
    assert_close(got, gref, agreement_bound(gref), "derived gradient")
    assert grad_dag(sm.post_scale_bias(torch.randn(1, 1, 2, 2)).root) == GRAD


def test_to_flex_matches_eager():
    mod = sm.compose(sm.alibi(sm.alibi_slopes(H)), sm.softcap(4.0), sm.causal_bottom_right())
    flex = mod.to_flex(q_len=SQ, kv_len=SKV)
    s = torch.randn(B, H, SQ, SKV)
    full = mod.eager(s, *IDX, SQ, SKV)
    for b in range(B):
        for h in range(H):
            for i in range(SQ):
                for j in range(SKV):
                    t = torch.tensor
                    v = flex(s[b, h, i, j], t(b), t(h), t(i), t(j))
                    assert v.shape == () and torch.equal(v, full[b, h, i, j])
    with pytest.raises(ValueError, match="to_flex\\(q_len=Sq, kv_len=Skv\\)"):
        sm.causal_bottom_right().to_flex()


def test_check_validates_tensor_params():
    kw = dict(device=torch.device("cpu"), batch=B, heads=H, seqlen_q=SQ, seqlen_kv=SKV)
    sm.post_scale_bias(torch.randn(1, H, SQ, SKV)).check(**kw)
    with pytest.raises(ValueError, match="'bias' has shape \\(1, 3, 5, 7\\), expected"):
        sm.post_scale_bias(torch.randn(1, 3, SQ, SKV)).check(**kw)
    with pytest.raises(ValueError, match="'slopes' has shape \\(2,\\)"):
        sm.alibi(torch.randn(2)).check(**kw)
    with pytest.raises(ValueError, match="'doc_ids' has shape \\(7,\\)"):
        sm.document_mask(torch.arange(SKV)).check(**kw)  # Sq != Skv
    with pytest.raises(ValueError, match="'bias' is on cpu, the inputs on meta"):
        sm.post_scale_bias(torch.randn(1, H, SQ, SKV)).check(**{**kw, "device": torch.device("meta")})

    @sm.score_mod
    def needs_bias(score, b, h, q_idx, kv_idx, bias=sm.TensorParam()):
        return score + bias[b, h, q_idx, kv_idx]

    with pytest.raises(ValueError, match="'bias' is indexed by .* must have 4 dims"):
        needs_bias(bias=torch.randn(SQ, SKV)).check(**kw)
    with pytest.raises(ValueError, match="'bias' is not bound"):
        needs_bias.check(**kw)
    with pytest.raises(TypeError, match="'bias' must have a floating dtype"):
        needs_bias(bias=torch.ones(1, 1, SQ, SKV, dtype=torch.int32))
    with pytest.raises(TypeError, match="has no parameter 'cap'"):
        needs_bias(cap=1.0)
    with pytest.raises(TypeError, match="must be a float"):
        sm.softcap().bind(cap="3")


def test_library_argument_errors():
    with pytest.raises(ValueError, match="cap must be a finite float > 0"):
        sm.softcap(0.0)
    with pytest.raises(ValueError, match="left must be >= -1"):
        sm.sliding_window(-2, 0)
    with pytest.raises(TypeError, match="right must be an int"):
        sm.sliding_window(1, 2.5)
    with pytest.raises(ValueError, match="bias must have 4 dims"):
        sm.post_scale_bias(torch.randn(3, 3))
    with pytest.raises(TypeError, match="doc_ids must be int32 or int64"):
        sm.document_mask(torch.randn(4))
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        sm.alibi_slopes(0)
    with pytest.raises(ValueError, match="at least one"):
        sm.compose()
    with pytest.raises(TypeError, match="argument 1 is int"):
        sm.compose(sm.causal(), 3)


def test_decoration_time_errors():
    with pytest.raises(TypeError, match="cannot branch on a symbolic value"):
        @sm.score_mod
        def branchy(score, b, h, q_idx, kv_idx):
            return score if score > 0 else -score

    with pytest.raises(TypeError, match="math.\\* functions"):
        @sm.score_mod
        def mathy(score, b, h, q_idx, kv_idx):
            return math.tanh(score)

    with pytest.raises(TypeError, match="torch.tanh was called on a symbolic"):
        @sm.score_mod
        def torchy(score, b, h, q_idx, kv_idx):
            return torch.tanh(score)

    with pytest.raises(TypeError, match="parameters must be floats, ints or tensor parameters"):
        @sm.score_mod
        def strparam(score, b, h, q_idx, kv_idx, mode="x"):
            return score

    with pytest.raises(TypeError, match="'cap' has no default"):
        @sm.score_mod
        def nodefault(score, b, h, q_idx, kv_idx, cap):
            return score

    with pytest.raises(TypeError, match="must take \\(score, b, h, q_idx, kv_idx"):
        @sm.score_mod
        def short(score, b, h):
            return score

    with pytest.raises(TypeError, match="\\*args / \\*\\*kwargs"):
        @sm.score_mod
        def star(score, b, h, q_idx, kv_idx, **kw):
            return score

    @sm.score_mod
    def transposed(score, b, h, q_idx, kv_idx, bias=sm.TensorParam()):  # a gather at computed indices
        return score + bias[kv_idx, q_idx]

    t = torch.randn(SKV, SQ, dtype=torch.float64)
    s = _score()
    torch.testing.assert_close(_eager(transposed(bias=t), s), s + t.T)

    with pytest.raises(TypeError, match="index 0 of tensor parameter 'bias' is the float value score; indices must be integers"):
        @sm.score_mod
        def badindex(score, b, h, q_idx, kv_idx, bias=sm.TensorParam()):
            return score + bias[score]

    with pytest.raises(TypeError, match="must be indexed before use"):
        @sm.score_mod
        def unindexed(score, b, h, q_idx, kv_idx, bias=sm.TensorParam()):
            return score + bias

    with pytest.raises(TypeError, match="returned a boolean condition"):
        @sm.score_mod
        def boolean(score, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    with pytest.raises(TypeError, match="returned the constant"):
        @sm.score_mod
        def constant(score, b, h, q_idx, kv_idx):
            return 1.0

    with pytest.raises(TypeError, match="returned str"):
        @sm.score_mod
        def stringy(score, b, h, q_idx, kv_idx):
            return "score"

    with pytest.raises(TypeError, match="three-argument pow"):
        @sm.score_mod
        def power(score, b, h, q_idx, kv_idx):
            return pow(score, 2, 3)

    with pytest.raises(TypeError, match=r"where\(\) needs a condition"):
        @sm.score_mod
        def wherefloat(score, b, h, q_idx, kv_idx):
            return sm.where(score, score, 0.0)

    with pytest.raises(RuntimeError, match="only be called inside a function traced"):
        sm.q_len()
    with pytest.raises(TypeError, match="binds parameters by keyword"):
        sm.softcap()(torch.zeros(1), 0, 0, 0, 0)
    with pytest.raises(ValueError, match="TensorParam kind must be one of"):
        sm.TensorParam("string")


@pytest.mark.parametrize("batched", [False, True])
def test_document_mask_runs_equal_the_equality_form_for_packed_documents(batched):
    """contiguous=True (per-query run bounds, the form cuDNN trains) is the equality mask when each
    document is one run, forward and backward on the reference backend in float64; an id that
    comes back later starts a new document there (documented), so the forms differ then."""
    import fused_attn

    g = torch.Generator().manual_seed(3)
    ids = torch.sort(torch.randint(0, 5, (2, 48), generator=g), dim=1).values
    ids = ids if batched else ids[0]
    q, k, v, do = (torch.randn(2, 3, 48, 16, generator=g, dtype=torch.float64) for _ in range(4))

    def run(mod):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", score_mod=mod, backend="reference")
        return [out] + list(torch.autograd.grad(out, leaves, do))

    for a, b in zip(run(sm.document_mask(ids)), run(sm.document_mask(ids, contiguous=True))):
        assert_close(a, b, agreement_bound(b), "contiguous document mask")
    back = torch.tensor([0, 0, 1, 1, 0, 0] * 8)
    eq, runs = sm.document_mask(back), sm.document_mask(back, contiguous=True)
    s = torch.zeros(1, 1, 48, 48)
    i = torch.arange(48)
    m_eq = eq.eager(s, 0, 0, i.view(-1, 1), i.view(1, -1), 48, 48) == 0
    m_runs = runs.eager(s, 0, 0, i.view(-1, 1), i.view(1, -1), 48, 48) == 0
    assert m_runs[0, 0, 0, 1] and not m_runs[0, 0, 0, 4] and m_eq[0, 0, 0, 4]
    assert not runs.irregular_mask and eq.irregular_mask
    with pytest.raises(TypeError, match="contiguous must be a bool"):
        sm.document_mask(back, contiguous=1)
