"""cuDNN graph construction up to validate() on CPU, plus the backend's host-side helpers."""

import math

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

from fused_attn.backends import cudnn as backend  # noqa: E402
from fused_attn.backends.cudnn import lowering, varlen  # noqa: E402
from fused_attn.backends.cudnn.graphs import (  # noqa: E402
    construct, cudnn_band, dense_strides_like, grad_strides, thd_strides,
)
from fused_attn.cache import GraphKey  # noqa: E402
from score_mods.base import ScoreMod, describe_operands  # noqa: E402

B, H, HKV, SQ, SKV, D, DV = 2, 4, 2, 96, 128, 64, 32


def logical(fmt, b, h, s, d):
    """A random tensor in `fmt` memory layout, returned as its logical (B, H, S, D) view."""
    if fmt == "bshd":
        return torch.randn(b, s, h, d).permute(0, 2, 1, 3)
    if fmt == "sbhd":
        return torch.randn(s, b, h, d).permute(1, 2, 0, 3)
    return torch.randn(b, h, s, d)


def dense_key(direction, fmt, band=None, padding=False, score_mod=None, operands=None, deterministic=False,
              dv=DV, hkv=HKV):
    q, k, v = logical(fmt, B, H, SQ, D), logical(fmt, B, hkv, SKV, D), logical(fmt, B, hkv, SKV, dv)
    o_dims = (B, H, SQ, dv)
    key = GraphKey(
        direction=direction, dtype="bfloat16", q_dims=tuple(q.shape), k_dims=tuple(k.shape), v_dims=tuple(v.shape),
        q_strides=q.stride(), k_strides=k.stride(), v_strides=v.stride(),
        o_strides=dense_strides_like(o_dims, q.stride()), scale=1 / math.sqrt(D), band=band, padding=padding,
        score_mod=None if score_mod is None else score_mod.cache_key,
        operands=describe_operands(operands or {}), deterministic=deterministic,
    )
    return key, (q, k, v)


def sdpa_node(graph):
    return [n for n in graph.nodes if "sdpa" in n.name][0]


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_dense_layouts_dims_and_strides(fmt, direction):
    key, (q, k, v) = dense_key(direction, fmt)
    graph, named = construct(key)
    graph.validate()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert named[name].dim == list(t.shape) and named[name].stride == list(t.stride())
    o = named["o"]
    assert o.dim == [B, H, SQ, DV] and o.stride == list(dense_strides_like((B, H, SQ, DV), q.stride()))
    assert named["stats"].dim == [B, H, SQ, 1]
    if direction == "bwd":
        assert named["dO"].stride == o.stride
        for g, t in (("dQ", q), ("dK", k), ("dV", v)):
            assert named[g].dim == list(t.shape)
            assert named[g].stride == list(t.stride())  # inputs are dense: grads share their strides
        assert {"dQ", "dK", "dV"} <= set(named)
    else:
        assert "dQ" not in named


def test_gqa_and_value_head_dim():
    key, _ = dense_key("fwd", "bshd", hkv=1, dv=128)
    graph, named = construct(key)
    graph.validate()
    assert named["k"].dim == [B, 1, SKV, D] and named["v"].dim == [B, 1, SKV, 128]
    assert named["o"].dim == [B, H, SQ, 128]


@pytest.mark.parametrize("band,alignment", [
    ((None, 0, False), "TOP_LEFT"), ((None, 0, True), "BOTTOM_RIGHT"), ((17, 0, False), "TOP_LEFT"),
    ((9, 3, True), "BOTTOM_RIGHT"), ((None, 5, False), "TOP_LEFT"),
])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_band_parameters(band, alignment, direction):
    key, _ = dense_key(direction, "bshd", band=band)
    graph, _ = construct(key)
    graph.validate()
    params = sdpa_node(graph).params
    assert params["diagonal_alignment"].name == alignment
    assert params.get("diagonal_band_left_bound") == band[0]
    assert params.get("diagonal_band_right_bound") == band[1]


def test_window_left_bound_mapping():
    # flash window left L (keys i-L..i) is cuDNN left bound L + 1 (measured on an H100).
    assert cudnn_band(0, 0) == (1, 0)
    assert cudnn_band(16, 0) == (17, 0)
    assert cudnn_band(None, 0) == (None, 0)
    assert cudnn_band(4, None) == (5, None)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_dense_padding(direction):
    key, _ = dense_key(direction, "bshd", padding=True, band=(None, 0, True))
    graph, named = construct(key)
    graph.validate()
    params = sdpa_node(graph).params
    assert params["use_padding_mask"] is True
    assert named["seq_q"].dim == [B, 1, 1, 1] and named["seq_kv"].dim == [B, 1, 1, 1]
    assert named["seq_q"].data_type == cudnn.data_type.INT32


def test_deterministic_backward_flag():
    key, _ = dense_key("bwd", "bshd", deterministic=True)
    graph, _ = construct(key)
    graph.validate()
    assert sdpa_node(graph).params.get("use_deterministic_algorithm") is True
    key2, _ = dense_key("bwd", "bshd")
    graph2, _ = construct(key2)
    assert not sdpa_node(graph2).params.get("use_deterministic_algorithm", False)


class ScaleMod(ScoreMod):
    """score * factor, factor a pass-by-value scalar; optionally reads the lengths."""

    name = "scale_mod"

    def __init__(self, factor=0.5, lengths=False, backward=True):
        self.factor, self._lengths, self._backward = factor, lengths, backward
        self.calls = []

    @property
    def cache_key(self):
        return ("scale_mod", self._lengths)

    @property
    def uses_lengths(self):
        return self._lengths

    @property
    def has_backward(self):
        return self._backward

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return score * self.factor

    def cudnn_operands(self):
        return {"factor": torch.full((1, 1, 1, 1), self.factor)}

    def lower_forward(self, graph, score, operands, memo):
        self.calls.append(("fwd", sorted(operands)))
        return graph.mul(a=score, b=operands["factor"])

    def lower_backward(self, graph, dscore, operands, memo):
        self.calls.append(("bwd", sorted(operands)))
        return graph.mul(a=dscore, b=operands["factor"])


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
@pytest.mark.parametrize("lengths", [False, True])
def test_score_mod_operands_and_callbacks(direction, lengths):
    mod = ScaleMod(lengths=lengths)
    operands = dict(mod.cudnn_operands())
    if lengths:
        operands.update(lowering._length_scalars(SQ, SKV))
    key, _ = dense_key(direction, "bshd", score_mod=mod, operands=operands)
    graph, named = construct(key, mod, operands)
    graph.validate()
    params = sdpa_node(graph).params
    assert callable(params["score_mod"])
    assert ("score_mod_bprop" in params) == (direction == "bwd")
    # The callbacks lower through the mod with the graph inputs made for its operands.
    class FakeGraph:
        def mul(self, a, b):
            return ("mul", a, b)

    out = params["score_mod"](FakeGraph(), "score")
    assert out == ("mul", "score", named["sm:factor"])
    if direction == "bwd":
        assert params["score_mod_bprop"](FakeGraph(), "dscore")[2] is named["sm:factor"]
    names = ["factor", "kv_len", "q_len"] if lengths else ["factor"]
    assert mod.calls[0] == ("fwd", names)
    assert named["sm:factor"].is_pass_by_value
    assert ("sm:q_len" in named) == lengths
    assert "use_padding_mask" not in params and "diagonal_alignment" not in params


def test_score_mod_with_padding_passes_lengths_not_mask():
    mod = ScaleMod(lengths=True)
    operands = dict(mod.cudnn_operands())
    key, _ = dense_key("fwd", "bshd", padding=True, score_mod=mod, operands=operands)
    graph, named = construct(key, mod, operands)
    graph.validate()
    params = sdpa_node(graph).params
    assert params["use_padding_mask"] is False
    assert "seq_q" in named and "sm:q_len" not in named


def thd_key(direction, bb=4, sq=256, skv=256, h=H, hkv=HKV, d=D, dv=DV):
    dims = ((bb, h, sq, d), (bb, hkv, skv, d), (bb, hkv, skv, dv))
    return GraphKey(
        direction=direction, dtype="float16", q_dims=dims[0], k_dims=dims[1], v_dims=dims[2],
        q_strides=thd_strides(dims[0]), k_strides=thd_strides(dims[1]), v_strides=thd_strides(dims[2]),
        o_strides=thd_strides((bb, h, sq, dv)), scale=0.125, ragged=True,
    )


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_thd_ragged_offsets(direction):
    key = thd_key(direction)
    graph, named = construct(key)
    graph.validate()
    assert named["q"].stride == [256 * H * D, D, H * D, 1]
    assert named["v"].stride == [256 * HKV * DV, DV, HKV * DV, 1]
    expect = {"q": f"roff_q_{H * D}", "k": f"roff_kv_{HKV * D}", "v": f"roff_kv_{HKV * DV}", "o": f"roff_q_{H * DV}"}
    if direction == "bwd":
        expect.update({"dO": expect["o"], "dQ": expect["q"], "dK": expect["k"], "dV": expect["v"]})
    for name, off in expect.items():
        assert named[name].ragged_offset.name == off, name
        assert named[off].dim == [5, 1, 1, 1]
    # Stats: one token-major row per query token (heads innermost) at offsets token * H
    assert named["stats"].ragged_offset.name == f"roff_q_{H}" and named[f"roff_q_{H}"].dim == [5, 1, 1, 1]
    assert named["stats"].dim == [4, H, 256, 1] and named["stats"].stride == [H * 256, 1, H, 1]
    assert sdpa_node(graph).params["use_padding_mask"] is True


def test_token_capacity_sizes_the_ragged_backward():
    import dataclasses

    key = dataclasses.replace(thd_key("bwd"), token_capacity=(512, 256))
    graph, _ = construct(key)
    graph.validate()
    params = sdpa_node(graph).params
    assert (params["max_total_seq_len_q"], params["max_total_seq_len_kv"]) == (512, 256)
    assert key != thd_key("bwd") and "token capacity 512 / 256" in key.describe()
    plain = sdpa_node(construct(thd_key("bwd"))[0]).params
    assert plain.get("max_total_seq_len_q") is None


def test_dense_stats_stay_packed():
    for direction in ("fwd", "bwd"):
        key, _ = dense_key(direction, "bshd")
        _, named = construct(key)
        assert named["stats"].ragged_offset is None and named["stats"].stride == [H * SQ, SQ, 1, 1]


def test_grad_strides_follow_input_memory_order():
    key, (q, k, v) = dense_key("bwd", "sbhd")
    assert grad_strides(key) == (q.stride(), k.stride(), v.stride())
    base = torch.randn(B, SQ, H, 2 * D)[..., :D].permute(0, 2, 1, 3)  # non-dense view
    assert dense_strides_like(base.shape, base.stride()) == torch.empty(B, SQ, H, D).permute(0, 2, 1, 3).stride()


# ----------------------------------------------------------------------------- varlen helpers


def test_buckets():
    assert [varlen.bucket_batch(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [varlen.bucket_seqlen(n) for n in (0, 1, 63, 64, 65, 128, 129, 1792, 4096)] == [128, 128, 128, 128, 128, 128, 256, 2048, 4096]


def make_thd(lens_q, lens_kv, padded_gap=0):
    """(layout, Varlen, tokens) of a packed batch; kv lengths from their own cu_seqlens."""
    from fused_attn.plan import Varlen

    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_kv = torch.tensor([0] + list(torch.tensor(lens_kv).cumsum(0)), dtype=torch.int32)
    pad_q = None
    if padded_gap:
        pad_q = torch.tensor([i * padded_gap + int(c) for i, c in enumerate(cu_q)], dtype=torch.int32)
    tq = int(pad_q[-1]) if pad_q is not None else int(cu_q[-1])
    layout = varlen.ThdLayout(len(lens_q), varlen.bucket_batch(len(lens_q)), (H * D, 7), (HKV * D, HKV * DV),
                              torch.device("cpu"))
    vl = Varlen(cu_q, cu_kv, pad_q, None, max(lens_q), max(lens_kv))
    return layout, vl, (tq, int(cu_kv[-1]))


def test_prepare_pads_batch_with_empty_sequences():
    layout, vl, tokens = make_thd([3, 0, 70], [5, 1, 2])
    thd = varlen.prepare(layout, vl, tokens, (70, 5))
    assert (layout.batch, layout.batch_bucket) == (3, 4)
    assert thd.seq_q.view(-1).tolist() == [3, 0, 70, 0] and thd.seq_kv.view(-1).tolist() == [5, 1, 2, 0]
    assert thd.tok_q.tolist() == [0, 3, 3, 73, 73]
    assert thd.offsets[("kv", HKV * D)].view(-1).tolist() == [x * HKV * D for x in [0, 5, 6, 8, 8]]
    assert thd.offsets[("q", 7)].shape == (5, 1, 1, 1) and thd.offsets[("q", 7)].dtype == torch.int32
    assert varlen.prepare(layout, vl, tokens, (70, 5)) is thd  # memoized per tensor identity and version


def test_prepare_checks_values():
    layout, vl, tokens = make_thd([3, 4], [3, 4])
    with pytest.raises(RuntimeError, match="invalid cu_seqlens"):
        varlen.prepare(layout, vl, (tokens[0] + 1, tokens[1]), (4, 4))  # token count mismatch
    with pytest.raises(RuntimeError, match="invalid cu_seqlens"):
        varlen.prepare(layout, vl, tokens, (3, 4))  # a length above max_seqlen


def _cu(*values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("case", ["valid", "start", "decreasing", "end_q", "end_kv", "q_limit", "kv_limit",
                                  "shared_kv_limit", "pad_too_small", "pad_end"])
def test_prepare_value_check_each_condition(case):
    """Every condition of the one-assertion value check, each violated alone (CPU raises at once)."""
    from fused_attn.plan import Varlen

    cu_q, cu_kv, pad_q, limits = _cu(0, 3, 7), _cu(0, 2, 6), None, (4, 4)
    tokens = (7, 6)
    if case == "start":
        cu_q = _cu(1, 3, 7)
    elif case == "decreasing":
        cu_kv = _cu(0, 5, 4, 6)
    elif case == "end_q":
        tokens = (8, 6)
    elif case == "end_kv":
        tokens = (7, 5)
    elif case == "q_limit":
        limits = (3, 4)
    elif case == "kv_limit":
        limits = (4, 3)
    elif case == "shared_kv_limit":
        cu_kv, tokens, limits = cu_q, (7, 7), (4, 3)
    elif case in ("pad_too_small", "pad_end"):
        pad_q, tokens = _cu(0, 4, 9), (9, 6)
        if case == "pad_too_small":
            pad_q = _cu(0, 2, 9)
        else:
            tokens = (10, 6)
    if case == "decreasing":
        cu_q = _cu(0, 1, 2, 7)
    batch = cu_q.numel() - 1
    layout = varlen.ThdLayout(batch, varlen.bucket_batch(batch), (H * D,), (HKV * D,), torch.device("cpu"))
    vl = Varlen(cu_q, cu_kv, pad_q, None, limits[0], limits[1])
    if case == "valid":
        varlen.prepare(layout, vl, tokens, limits)
    else:
        with pytest.raises(RuntimeError, match="invalid cu_seqlens"):
            varlen.prepare(layout, vl, tokens, limits)


@pytest.mark.parametrize("case", ["valid", "start", "start_negative", "decreasing", "end", "end_past_tokens", "limit", "tokens_differ", "bucketed"])
def test_prepare_value_check_of_one_shared_row(case):
    """The scalar-bounds form for one cu_seqlens serving queries and keys: each condition alone."""
    from fused_attn.plan import Varlen

    cu, tokens, limit = _cu(0, 3, 7, 7), (7, 7), 4
    if case == "start":
        cu = _cu(1, 3, 7, 7)
    elif case == "start_negative":
        cu = _cu(-1, 3, 7, 7)
    elif case == "end_past_tokens":
        tokens = (6, 6)
    elif case == "decreasing":
        cu = _cu(0, 5, 4, 7)
    elif case == "end":
        tokens = (8, 8)
    elif case == "limit":
        limit = 3
    elif case == "tokens_differ":
        tokens = (7, 6)
    elif case == "bucketed":  # 5 sequences in a bucket of 8: the end sits past the real batch
        cu = _cu(0, 1, 2, 3, 4, 7)
    batch = cu.numel() - 1
    layout = varlen.ThdLayout(batch, varlen.bucket_batch(batch), (H * D,), (H * D,), torch.device("cpu"))
    vl = Varlen(cu, cu, None, None, limit, limit)
    if case in ("valid", "bucketed"):
        thd = varlen.prepare(layout, vl, tokens, (limit, limit))
        assert thd.seq_kv is thd.seq_q and int(thd.seq_q.sum()) == 7
    else:
        with pytest.raises(RuntimeError, match="invalid cu_seqlens"):
            varlen.prepare(layout, vl, tokens, (limit, limit))


def test_prepare_uses_padded_offsets():
    layout, vl, tokens = make_thd([3, 4], [3, 4], padded_gap=2)
    thd = varlen.prepare(layout, vl, tokens, (4, 4))
    assert thd.tok_q.tolist() == [0, 5, 11]  # token offsets from cu_seqlens_q_padded
    assert thd.seq_q.view(-1).tolist() == [3, 4]


def test_rows_of_sequences_without_keys():
    layout, vl, tokens = make_thd([2, 3, 1], [1, 0, 4])
    thd = varlen.prepare(layout, vl, tokens, (3, 4))
    assert varlen.token_rows_of_empty_kv(thd, tokens[0]).tolist() == [False, False, True, True, True, False]


def test_offset_range_check():
    with pytest.raises(NotImplementedError, match="int32 ragged offsets"):
        varlen.check_offset_range("query", 2**24, 64, 128)
    varlen.check_offset_range("query", 1024, 16, 128)


def static_problem(fmt="bshd", dtype=torch.bfloat16, d=64, dv=64, device="cpu", lens=None, **spec_kw):
    """The StaticProblem a call would plan (metadata only; CPU tensors stand in for CUDA ones)."""
    from fused_attn.plan import NO_VARLEN, Varlen, _static_problem
    from fused_attn.spec import resolve_spec

    spec, mod = resolve_spec(qkv_format=fmt, **spec_kw)
    if fmt == "thd":
        lq, lk = lens
        cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=device)
        q = torch.randn(int(cq[-1]), 2, d, dtype=dtype, device=device)
        k = torch.randn(int(ck[-1]), 2, d, dtype=dtype, device=device)
        v = torch.randn(int(ck[-1]), 2, dv, dtype=dtype, device=device)
        return _static_problem(spec, mod, q, k, v, Varlen(cq, ck, None, None, max(lq), max(lk)), None)
    q = torch.randn(1, 16, 2, d, dtype=dtype, device=device)
    k = torch.randn(1, 16, 2, d, dtype=dtype, device=device)
    v = torch.randn(1, 16, 2, dv, dtype=dtype, device=device)
    return _static_problem(spec, mod, q, k, v, NO_VARLEN, None)


def test_bottom_right_thd_shares_one_seq_bucket():
    p = static_problem("thd", lens=([200, 3], [10, 20]), attn_mask_type="causal_bottom_right")
    assert backend.saved_shape(p, 203) == (203, 2, 1)  # one Stats row per query token
    p2 = static_problem("thd", lens=([200, 3], [10, 20]))
    assert (p2.seqlen_q, p2.seqlen_kv) == (256, 128) and backend.saved_shape(p2, 203) == (203, 2, 1)


# ----------------------------------------------------------------------------- refusals


def test_refusal_reasons_on_cpu():
    assert "needs CUDA tensors" in backend.refusal(static_problem())
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="backend='cudnn' cannot run this problem: the cuDNN backend needs CUDA"):
        import fused_attn

        fused_attn.dot_product_attention(q, q, q, backend="cudnn")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw,match", [
    (dict(dtype=torch.float32), "float16 or bfloat16"),
    (dict(d=60), "multiple of 8"),
    (dict(dv=264), "value head dim"),
])
def test_refusal_reasons_on_cuda(kw, match):
    assert match in backend.refusal(static_problem(device="cuda", **kw))


def test_saved_shape_dense():
    assert backend.saved_shape(static_problem(), 1) == (1, 2, 16, 1)


# ----------------------------------------------------------------------------- autograd


class _FakeRunner:
    """A runner stand-in: forward saves the lse; backward uses only what it saved."""

    def __init__(self):
        self.backward_calls = []

    @staticmethod
    def _math(q, k, v, scale=0.3):
        s = (q @ k.transpose(-1, -2)) * scale
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    def grad_inputs(self, mod, sinks):
        return ()

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None):
        out, lse = self._math(q.detach(), k.detach(), v.detach())
        return out, lse, (q, k, v, lse.unsqueeze(-1).clone()), "state"

    def backward(self, state, saved, grad_out):
        q, k, v, stats = saved
        self.backward_calls.append((state, stats.shape, grad_out.stride()))
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            o, _ = self._math(q, k, v)
            return torch.autograd.grad(o, (q, k, v), grad_out)


def test_autograd_function_gradients_and_saved():
    from fused_attn.autograd import attention
    from fused_attn.plan import NO_VARLEN

    fake = _FakeRunner()
    q, k, v = (torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = attention(fake, q, k, v, NO_VARLEN, None, None)
    assert not lse.requires_grad
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    expected = torch.autograd.grad(_FakeRunner._math(q, k, v)[0], (q, k, v), g)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
    assert fake.backward_calls == [("state", (2, 3, 5, 1), g.stride())]


def test_autograd_no_grad_skips_function():
    from fused_attn.autograd import attention
    from fused_attn.plan import NO_VARLEN

    q, k, v = (torch.randn(1, 1, 4, 8) for _ in range(3))
    out, lse = attention(_FakeRunner(), q, k, v, NO_VARLEN, None, None)
    assert out.grad_fn is None and out.shape == (1, 1, 4, 8)


def test_one_kernel_preparation_layout_and_cpu_rows():
    """CPU rows take the torch-op preparation (the Triton kernel serves CUDA rows: GPU test);
    the kernel's one output buffer holds, in write order, the parts each case binds."""
    from fused_attn.backends.cudnn import thd_kernel

    layout = varlen.ThdLayout(3, 4, (H * D,), (HKV * D,), torch.device("cpu"))
    cu = _cu(0, 1, 3, 7)
    assert thd_kernel.prepare(layout, cu, cu, (7, 7), (4, 4)) is None
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    shared = thd_kernel._Recipe(layout, False, pow2)
    assert shared.names == ("seq_q", "tok_q", ("q", H * D), ("kv", HKV * D), "ok")
    assert shared.sizes == (4, 5, 5, 5, 1) and shared.size == 20 and shared.meta["BLOCK"] == 16
    same = varlen.ThdLayout(8, 8, (7, H * D), (7, H * D), torch.device("cpu"))
    two_rows = thd_kernel._Recipe(same, True, pow2)
    assert two_rows.names == ("seq_q", "seq_kv", ("q", 7), ("q", H * D), ("kv", 7), ("kv", H * D), "ok")
    assert two_rows.meta == dict(BLOCK=16, KV_ROW=True, EXT=False, NQ=2, NKV=2)
    one_row = thd_kernel._Recipe(same, False, pow2)  # one row, equal multipliers: kv offsets alias q's
    assert one_row.names == ("seq_q", ("q", 7), ("q", H * D), "ok") and one_row.meta["NKV"] == 0
    # where each bound tensor sits among the parts: (seq_q, seq_kv, tok_q, offsets, ok); None = not written
    assert shared.picks == (0, None, 1, ((("q", H * D), 2), (("kv", HKV * D), 3)), 4)
    assert one_row.picks == (0, None, None, ((("q", 7), 1), (("q", H * D), 2), (("kv", 7), 1), (("kv", H * D), 2)), 3)
    assert two_rows.picks[:3] == (0, 1, None) and two_rows.meta_for(True) == dict(two_rows.meta, CHECK=True)
    # a thd runner's query side: q / o offsets and the Stats rows (heads); one row's key offsets
    # that the query side already writes are not written twice
    runner_like = varlen.ThdLayout(8, 8, (H, H * DV, H * D), (H * D,), torch.device("cpu"))
    three = thd_kernel._Recipe(runner_like, False, pow2)
    assert three.names == ("seq_q", ("q", H), ("q", H * DV), ("q", H * D), "ok")
    assert three.meta["NQ"] == 3 and three.meta["NKV"] == 0 and three.mults == (H, H * DV, H * D, 0, 0)
    assert dict(three.picks[3])[("kv", H * D)] == 3
