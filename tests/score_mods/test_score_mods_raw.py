"""Raw cuDNN callbacks, chaining them with traced mods, and as_score_mod normalization."""

import pytest
import torch

import score_mods as sm
from score_mods.raw import ChainMod


def scale_fprop(graph, score, tensors):
    return graph.mul(score, tensors["s"])


def scale_bprop(graph, dscore, tensors):
    return graph.mul(dscore, tensors["s"])


class Rec:
    def __init__(self):
        self.calls = []

    def mul(self, a, b):
        self.calls.append(("mul", a, b))
        return ("mul", a, b)


def test_raw_callback_key_operands_and_lowering():
    mod = sm.raw_callback(scale_fprop, bprop=scale_bprop, tensors={"s": torch.tensor(0.5)},
                          bprop_tensors={"s": torch.tensor(0.5)})
    assert mod.cache_key == sm.raw_callback(scale_fprop, bprop=scale_bprop, tensors={"s": torch.tensor(2.0)},
                                            bprop_tensors={"s": torch.tensor(2.0)}).cache_key
    ops = mod.cudnn_operands()
    assert set(ops) == {"fwd_s", "bwd_s"} and ops["fwd_s"].shape == (1, 1, 1, 1)
    g = Rec()
    assert mod.lower_forward(g, "S", {"fwd_s": "A", "bwd_s": "B"}, {}) == ("mul", "S", "A")
    assert mod.lower_backward(g, "dS", {"fwd_s": "A", "bwd_s": "B"}, {}) == ("mul", "dS", "B")
    assert mod.has_backward and not mod.has_reference
    with pytest.raises(NotImplementedError, match="pass reference="):
        mod.eager(torch.randn(2), 0, 0, 0, 0, 1, 1)


def test_raw_callback_cache_key_rules():
    # lambdas and nested functions are keyed by their code (keys.py); a closure over a tensor is not
    assert sm.raw_callback(lambda g, s, t: s).cache_key != sm.raw_callback(lambda g, s, t: t).cache_key
    scale = torch.ones(1)

    def nested(g, s, t):
        return s

    def over_tensor(g, s, t):
        return g.mul(s, scale)

    assert sm.raw_callback(nested).cache_key[1][0][0] == "function"
    with pytest.raises(TypeError, match="closure variable 'scale' .* holds a Tensor .*pass cache_key="):
        sm.raw_callback(over_tensor)
    assert sm.raw_callback(nested, cache_key="nested-v1").cache_key[1] == "nested-v1"
    with pytest.raises(TypeError, match="cache_key must be hashable"):
        sm.raw_callback(nested, cache_key=["x"])
    with pytest.raises(ValueError, match="CPU tensors must be scalars"):
        sm.raw_callback(scale_fprop, tensors={"s": torch.ones(3)})
    with pytest.raises(TypeError, match="tensors must be a dict"):
        sm.raw_callback(scale_fprop, tensors=[torch.ones(1)])
    mod = sm.raw_callback(scale_fprop, reference=lambda s, b, h, q, k: s * 0.5)
    x = torch.randn(3, 4)
    torch.testing.assert_close(mod.eager(x, 0, 0, 0, 0, 1, 1), x * 0.5)
    with pytest.raises(NotImplementedError, match="has no bprop"):
        mod.lower_backward(Rec(), "dS", {}, {})


def test_compose_with_raw_chains():
    raw = sm.raw_callback(scale_fprop, bprop=scale_bprop, tensors={"s": torch.tensor(0.5)},
                          bprop_tensors={"s": torch.tensor(0.5)}, reference=lambda s, b, h, q, k: s * 0.5)
    mod = sm.compose(sm.softcap(2.0), raw)
    assert isinstance(mod, ChainMod) and set(mod.cudnn_operands()) == {"m0_cap", "m1_fwd_s", "m1_bwd_s"}
    s = torch.randn(2, 3, 4, 5)
    idx = [torch.arange(n).view([-1 if d == k else 1 for d in range(4)]) for k, n in enumerate(s.shape)]
    torch.testing.assert_close(mod.eager(s, *idx, 4, 5), 2.0 * torch.tanh(s / 2.0) * 0.5)
    assert mod.has_backward and mod.has_reference


def test_as_score_mod():
    assert sm.as_score_mod(None) is None
    c = sm.causal()
    assert sm.as_score_mod(c) is c

    def flex_softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * sm.tanh(score / 20.0)

    traced = sm.as_score_mod(flex_softcap)
    assert traced.scalars() == {}
    assert traced.cache_key != sm.softcap(20.0).cache_key  # a literal 20.0 is structure, a param is not
    assert traced.cache_key == sm.score_mod(lambda score, b, h, q_idx, kv_idx: 20.0 * sm.tanh(score / 20.0)).cache_key
    s = torch.randn(2, 2, 3, 3)
    idx = [torch.arange(n).view([-1 if d == k else 1 for d in range(4)]) for k, n in enumerate(s.shape)]
    torch.testing.assert_close(traced.eager(s, *idx, 3, 3), 20.0 * torch.tanh(s / 20.0))
    raw = sm.as_score_mod(scale_fprop, bprop=scale_bprop, tensors={"s": torch.tensor(1.0)})
    assert isinstance(raw, sm.RawCallbackMod) and raw.has_backward

    def torch_code(score, b, h, q_idx, kv_idx):
        return torch.tanh(score)

    with pytest.raises(TypeError, match="could not be traced .* score_mods namespace"):
        sm.as_score_mod(torch_code)
    with pytest.raises(TypeError, match="like a raw cuDNN callback"):
        sm.as_score_mod(scale_fprop)
    with pytest.raises(ValueError, match="tensors given with the ScoreMod 'causal'"):
        sm.as_score_mod(c, tensors={"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="bprop given with no score_mod"):
        sm.as_score_mod(None, bprop=scale_bprop)
    with pytest.raises(TypeError, match="score_mod must be a ScoreMod"):
        sm.as_score_mod(3.0)


@pytest.mark.parametrize("reference, exc, match", [
    (lambda s, b, h, q, k: s[..., :1, :2], ValueError, r"broadcastable to the score's shape \(1, 2, 8, 8\), got .* \(1, 2, 1, 2\)"),
    (lambda s, b, h, q, k: s.sum(-1), ValueError, r"got .* of shape \(1, 2, 8\)"),
    (lambda s, b, h, q, k: s.sum(), ValueError, r"with as many dims as the score, .* got .* of shape \(\)"),
    (lambda s, b, h, q, k: torch.tensor(0.5), ValueError, r"with as many dims as the score, .* of shape \(\)"),
    (lambda s, b, h, q, k: (s > 0), ValueError, "must return floating scores"),
    (lambda s, b, h, q, k: 0.5, TypeError, "reference= must return a torch.Tensor, got float"),
])
def test_raw_reference_of_the_wrong_shape_is_named(reference, exc, match):
    import fused_attn

    def fprop(graph, score, tensors):
        return score

    mod = sm.raw_callback(fprop, reference=reference)
    q = k = v = torch.randn(1, 8, 2, 16)
    with pytest.raises(exc, match=match):
        fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="reference")


# ----------------------------------------------------------------------------- Transformer Engine parity


def _scale_reference(score, b, h, q_idx, kv_idx):
    return score * 0.5


def test_score_mod_tensors_are_version_checked_for_backward():
    """As Transformer Engine's test of the same name: an in-place update of a
    score_mod_bprop_tensors tensor between forward and backward raises torch's error."""
    import fused_attn
    from fused_attn.testing import assert_close, grad_tolerances

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=gen, dtype=torch.float64).requires_grad_(True) for _ in range(3))
    do = torch.randn(1, 8, 2, 16, generator=gen, dtype=torch.float64)
    fwd_s, bwd_s = torch.tensor(0.5), torch.tensor(0.5)

    def call():
        mod = sm.raw_callback(scale_fprop, bprop=scale_bprop, tensors={"s": fwd_s}, bprop_tensors={"s": bwd_s},
                              reference=_scale_reference)
        return fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="reference")

    out = call()  # untouched: gradients of the float64 reference
    got = torch.autograd.grad(out, (q, k, v), do)
    logical = [t.detach().transpose(1, 2) for t in (q, k, v)]
    want, bounds = grad_tolerances(*logical, do.transpose(1, 2), 16 ** -0.5, torch.float64,
                                   score_fn=lambda s, b, h, i, j: s * 0.5)
    for name, g, w, bound in zip("qkv", got, want, bounds):
        assert_close(g.transpose(1, 2), w, bound, f"d{name}")
    for tensor in (bwd_s, fwd_s):
        out = call()
        tensor.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(do)


CFG = {"cap": 30.0}


class _Config:
    cap = 30.0


OBJ = _Config()


def fprop_reads_dict(graph, score, tensors):
    return graph.mul(score, CFG["cap"])


def fprop_reads_object(graph, score, tensors):
    return graph.mul(score, OBJ.cap)


SAME_A = lambda graph, score, tensors: score  # noqa: E731
SAME_B = lambda graph, score, tensors: score  # noqa: E731


@pytest.mark.parametrize("fn, name", [(fprop_reads_dict, "CFG"), (fprop_reads_object, "OBJ")])
def test_raw_callback_reading_a_mutable_global_must_give_a_key(fn, name):
    with pytest.raises(ValueError, match=f"reads the module-level name '{name}'.*stale.*pass cache_key="):
        sm.raw_callback(fn)
    with pytest.raises(ValueError, match="pass cache_key="):
        sm.as_score_mod(fn, bprop=scale_bprop)
    assert sm.raw_callback(fn, cache_key=("cap", 30.0)).cache_key[1] == ("cap", 30.0)


def test_te_protocol_keys_a_callback_reading_a_mutable_global():
    class Callback:
        def score_mod_graph_cache_key(self):
            return {"cap": CFG["cap"]}

        def fprop(self, graph, score, tensors):
            return graph.mul(score, CFG["cap"])

    cb = Callback()
    before = sm.raw_callback(cb.fprop).cache_key
    CFG["cap"] = 50.0
    try:
        assert sm.raw_callback(cb.fprop).cache_key != before
    finally:
        CFG["cap"] = 30.0


def test_identical_module_level_lambdas_share_a_key():
    """Documented and harmless: the same code builds the same graph."""
    assert sm.raw_callback(SAME_A).cache_key == sm.raw_callback(SAME_B).cache_key
