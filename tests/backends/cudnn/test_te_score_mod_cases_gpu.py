"""GPU: the score_mod cases of Transformer Engine's attention tests, run through fused_attn's module
with raw cuDNN callbacks passed the way TE passes them (score_mod, score_mod_bprop,
score_mod_tensors, score_mod_bprop_tensors as per-call keywords), at TE's sizes: B=2, H=4, D=64,
S=64 for the causal callback and S=16 for softcap and the position bias, fp16 and bf16, sbhd and
bshd, a random or an all-ones (scalar loss) gradient: 16 cases. Output and dQ, dK, dV are checked
against the float64 reference with the project's tolerance rule.

The callbacks are the three kinds TE exercises: a mask built in the graph (row >= col, masked
scores replaced by a -1e9 pass-by-value scalar; its bprop zeroes dP there), a softcap whose
backward reuses a tensor its forward callback made (a callable object with
`score_mod_graph_cache_key()`), and a position bias (row - col) with an identity bprop.

Refusals: the causal case has 64 keys (64 mod 128) and a score_mod without a causal mask, which
the backend refuses for training wherever quirk `nan_dq_kv_64_mod_128` applies to the loaded
cuDNN (its padded-key workaround crashes the planner there); the test expects that refusal
exactly there, naming the version (the forward alone still runs), and exact results everywhere
else (where the entry does not apply, all 16 train).
"""

from __future__ import annotations

import pytest
import torch

from helpers.attention import band_mask
from helpers.mods import quirk_applies
from fused_attn.layouts import to_logical
from fused_attn.testing import assert_close, grad_tolerances, reference_attention, tolerance

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BATCH, HEADS, HEAD_DIM = 2, 4, 64
CAP = 0.8


def _types():
    """The cuDNN frontend's data types (imported when a graph is built, never on CPU machines)."""
    import cudnn

    return cudnn.data_type


def _lower_triangle(graph, like):
    """Boolean graph tensor: True where the row (query) index >= the column (key) index."""
    dt = _types()
    rows = graph.gen_index(input=like, axis=2)
    rows.set_data_type(dt.INT32)
    cols = graph.gen_index(input=like, axis=3)
    cols.set_data_type(dt.INT32)
    keep = graph.cmp_ge(input=rows, comparison=cols, compute_data_type=dt.BOOLEAN)
    keep.set_data_type(dt.BOOLEAN)
    return keep


def causal_scores(graph, score, tensors):
    return graph.binary_select(input0=score, input1=tensors["masked"], mask=_lower_triangle(graph, score))


def causal_grads(graph, d_score, tensors):
    return graph.binary_select(input0=d_score, input1=tensors["zero"], mask=_lower_triangle(graph, d_score))


def position_bias_scores(graph, score, tensors):
    dt = _types()
    rows = graph.gen_index(input=score, axis=2)
    rows.set_data_type(dt.INT32)
    cols = graph.gen_index(input=score, axis=3)
    cols.set_data_type(dt.INT32)
    offset = graph.sub(a=rows, b=cols, compute_data_type=dt.FLOAT)
    offset.set_data_type(dt.FLOAT)
    return graph.add(a=score, b=offset, compute_data_type=dt.FLOAT)


def unchanged_grads(graph, d_score, tensors):
    return d_score


class SoftcapCallbacks:
    """cap * tanh(score / cap); the backward callback reads the forward callback's score / cap
    (both run while one backward graph is built), as TE's stateful callbacks do."""

    def __init__(self) -> None:
        self.inner = None

    def score_mod_graph_cache_key(self):
        return ("softcap-callbacks", 1)

    def scores(self, graph, score, tensors):
        dt = _types()
        self.inner = graph.div(a=score, b=tensors["cap"], compute_data_type=dt.FLOAT)
        self.inner.set_data_type(dt.FLOAT)
        squashed = graph.tanh(input=self.inner)
        squashed.set_data_type(dt.FLOAT)
        return graph.mul(a=squashed, b=tensors["cap"], compute_data_type=dt.FLOAT)

    def grads(self, graph, d_score, tensors):
        dt = _types()
        d_squashed = graph.mul(a=d_score, b=tensors["cap"], compute_data_type=dt.FLOAT)
        d_squashed.set_data_type(dt.FLOAT)
        d_inner = graph.tanh_backward(loss=d_squashed, input=self.inner, compute_data_type=dt.FLOAT)
        d_inner.set_data_type(dt.FLOAT)
        return graph.div(a=d_inner, b=tensors["cap"], compute_data_type=dt.FLOAT)


def _case(name: str):
    """(sequence length, call keywords, reference mask, reference score function, input scale for q/k)."""
    if name == "causal":
        kw = dict(score_mod=causal_scores, score_mod_bprop=causal_grads,
                  score_mod_tensors={"masked": torch.full((1, 1, 1, 1), -1e9)},
                  score_mod_bprop_tensors={"zero": torch.zeros((1, 1, 1, 1))})
        return 64, kw, band_mask(64, 64, -1, 0), None, 0.1
    if name == "softcap":
        cb, cap = SoftcapCallbacks(), torch.full((1, 1, 1, 1), CAP)
        kw = dict(score_mod=cb.scores, score_mod_bprop=cb.grads, score_mod_tensors={"cap": cap},
                  score_mod_bprop_tensors={"cap": cap})
        return 16, kw, None, lambda s, b, h, qi, ki: CAP * torch.tanh(s / CAP), 1.0
    assert name == "position_bias"
    kw = dict(score_mod=position_bias_scores, score_mod_bprop=unchanged_grads)
    return 16, kw, None, lambda s, b, h, qi, ki: s + (qi - ki).to(s.dtype), 0.1


def _inputs(qkv_format: str, seq: int, qk_scale: float, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (seq, BATCH, HEADS, HEAD_DIM) if qkv_format == "sbhd" else (BATCH, seq, HEADS, HEAD_DIM)

    def draw(scale):
        return (scale * torch.randn(shape, device="cuda", generator=g)).to(dtype).requires_grad_(True)

    return draw(qk_scale), draw(qk_scale), draw(0.1)


CASES = [("causal", False), ("causal", True), ("softcap", False), ("position_bias", False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("case, scalar_loss", CASES, ids=["causal", "causal-scalar-loss", "softcap", "position-bias"])
def test_te_score_mod_case(dtype, qkv_format, case, scalar_loss):
    import fused_attn

    seq, kw, mask, score_fn, qk_scale = _case(case)
    q, k, v = _inputs(qkv_format, seq, qk_scale, dtype, seed=11 + len(CASES) * scalar_loss)
    attn = fused_attn.DotProductAttention(HEADS, HEAD_DIM, qkv_format=qkv_format, attn_mask_type="no_mask",
                                          backend="cudnn")
    ql, kl, vl = (to_logical(t.detach(), qkv_format) for t in (q, k, v))
    scale = HEAD_DIM ** -0.5
    mask = None if mask is None else mask.cuda()

    def check_forward(out):
        exact, _ = reference_attention(ql, kl, vl, scale, mask, score_fn)
        bound = tolerance(ql, kl, vl, scale, dtype, mask, score_fn)
        assert_close(to_logical(out.detach(), qkv_format), exact, bound, f"{case} out")

    if case == "causal" and seq % 128 == 64 and quirk_applies("nan_dq_kv_64_mod_128"):
        from fused_attn.backends.cudnn import quirks, version

        with pytest.raises(NotImplementedError, match="nan_dq_kv_64_mod_128") as refused:
            attn(q, k, v, qkv_format=qkv_format, attn_mask_type="no_mask", **kw)
        loaded = f"cuDNN {quirks.version_string(version.backend_version())}"
        assert loaded in str(refused.value), f"the refusal should name the loaded {loaded}: {refused.value}"
        with torch.no_grad():  # the fault is in the backward: inference runs
            check_forward(attn(q, k, v, qkv_format=qkv_format, attn_mask_type="no_mask", **kw))
        return

    out = attn(q, k, v, qkv_format=qkv_format, attn_mask_type="no_mask", **kw)
    check_forward(out)
    g = torch.Generator(device="cuda").manual_seed(23)
    d_out = torch.ones_like(out) if scalar_loss else torch.randn(out.shape, device="cuda", generator=g).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    want, bounds = grad_tolerances(ql, kl, vl, to_logical(d_out, qkv_format), scale, dtype, mask, score_fn)
    for name, gr, w, b in zip(("dq", "dk", "dv"), got, want, bounds):
        assert torch.isfinite(gr).all(), f"{case} {name}: non-finite values"
        assert_close(to_logical(gr, qkv_format), w, b, f"{case} {name}")
