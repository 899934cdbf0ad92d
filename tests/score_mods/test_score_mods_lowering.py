"""cuDNN lowering of score_mods, checked on CPU with a recording fake graph and a torch interpreter.

The fake graph records every op (name, inputs, data types); the interpreter evaluates the
recorded ops with torch, so the forward lowering is compared with `eager` and the derived
backward with torch.autograd of `eager`, without a GPU.
"""

import math

import pytest
import torch

import score_mods as sm
from fused_attn import testing
from score_mods import lower_cudnn

cudnn = pytest.importorskip("cudnn")


class FakeTensor:
    def __init__(self, op, inputs=(), attrs=None, name=""):
        self.op, self.inputs, self.attrs, self.name = op, list(inputs), dict(attrs or {}), name
        self.data_type = None

    def set_data_type(self, dt):
        self.data_type = dt
        return self


class FakeGraph:
    def __init__(self):
        self.ops = []

    def __getattr__(self, op):
        def record(*inputs, compute_data_type=None, **attrs):
            assert compute_data_type == cudnn.data_type.FLOAT, f"{op}: compute type not FLOAT"
            t = FakeTensor(op, inputs, attrs)
            t.compute = compute_data_type
            self.ops.append(t)
            return t

        return record


_BIN = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "min": torch.minimum,
    "max": torch.maximum, "cmp_lt": torch.lt, "cmp_le": torch.le, "cmp_gt": torch.gt, "cmp_ge": torch.ge,
    "cmp_eq": torch.eq, "cmp_neq": torch.ne, "pow": torch.pow,
    "mod": torch.fmod,  # cuDNN's MOD is C fmod (sign of the dividend); the lowering uses floor recipes instead
}
_UN = {
    "neg": torch.neg, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "abs": torch.abs,
    "sqrt": torch.sqrt, "sigmoid": torch.sigmoid, "reciprocal": torch.reciprocal, "floor": torch.floor,
    "ceil": torch.ceil, "erf": torch.erf,
}


def interpret(t, leaves, cache=None):
    """torch value of a recorded fake tensor (leaves: FakeTensor -> torch tensor)."""
    cache = {} if cache is None else cache
    if id(t) in cache:
        return cache[id(t)]
    if t.op == "leaf":
        v = leaves[t.name]
    else:
        x = [interpret(i, leaves, cache) for i in t.inputs]
        if t.op == "gen_index":
            axis, shape = t.attrs["axis"], x[0].shape
            v = torch.arange(shape[axis], dtype=torch.float32).view([-1 if d == axis else 1 for d in range(4)]).expand(shape)
        elif t.op in _BIN:
            v = _BIN[t.op](x[0].float() if not x[0].is_floating_point() else x[0], x[1])
        elif t.op in _UN:
            v = _UN[t.op](x[0])
        elif t.op == "binary_select":
            v = torch.where(x[2], x[0], x[1])
        elif t.op == "tanh_backward":
            v = x[0] * (1 - torch.tanh(x[1]) ** 2)
        elif t.op == "sigmoid_backward":
            s = torch.sigmoid(x[1])
            v = x[0] * s * (1 - s)
        else:
            raise AssertionError(f"unexpected op {t.op}")
        if t.op.startswith("cmp_"):
            assert t.data_type == cudnn.data_type.BOOLEAN, f"{t.op} output type {t.data_type}"
            assert v.dtype == torch.bool
        else:
            assert t.data_type == cudnn.data_type.FLOAT, f"{t.op} output type {t.data_type}"
            v = v.float()
    cache[id(t)] = v
    return v


B, H, SQ, SKV = 2, 3, 5, 7


def _mods():
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(1, H, SQ, SKV, generator=g)
    ids_b = torch.sort(torch.randint(0, 3, (B, SKV), generator=g), dim=1).values
    return {
        "causal": (sm.causal(), SQ, SKV),
        "causal_bottom_right": (sm.causal_bottom_right(), SQ, SKV),
        "window": (sm.sliding_window(2, 1), SQ, SKV),
        "window_br_left": (sm.sliding_window(2, -1, bottom_right=True), SQ, SKV),
        "softcap": (sm.softcap(1.0), SQ, SKV),
        "bias": (sm.post_scale_bias(bias), SQ, SKV),
        "alibi": (sm.alibi(sm.alibi_slopes(H)), SQ, SKV),
        "doc1": (sm.document_mask(torch.tensor([0, 0, 1, 1, 1, 2, 2])), SKV, SKV),
        "doc2": (sm.document_mask(ids_b), SKV, SKV),
        "padding": (sm.padding_mask(), SQ, SKV),
        "compose": (sm.compose(sm.softcap(2.0), sm.alibi(sm.alibi_slopes(H)), sm.causal_bottom_right()), SQ, SKV),
        "user": (_user_mod, SQ, SKV),
    }


@sm.score_mod
def _user_mod(score, b, h, q_idx, kv_idx, a=0.5):
    x = sm.sigmoid(score) * a + sm.exp(-sm.abs(score)) - 1.0 / (2.0 + sm.sqrt(score * score + 1.0))
    y = sm.maximum(x, score - 0.1) + sm.minimum(sm.log(score * score + 1.0), 3.0 - score)
    keep = ~((kv_idx - q_idx > 2) | (b == 1) & (h >= 2))
    return sm.where(keep, y, 2.0 * score)


def _grid(sq, skv):
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(sq).view(1, 1, sq, 1), torch.arange(skv).view(1, 1, 1, skv))


def _lower(mod, sq, skv, b=B, h=H, scaled=False):
    """Record the lowering; scaled: the backend's entry point (`lower_scaled_*`: the callback
    receives score x mod.score_scale())."""
    g = FakeGraph()
    score, ds = FakeTensor("leaf", name="score"), FakeTensor("leaf", name="dS")
    ops = dict(mod.cudnn_operands((b, h, sq, skv), device="cpu"))
    ops.update(mod.length_operands(sq, skv))
    ops["q_len"] = torch.full((1, 1, 1, 1), float(sq))
    ops["kv_len"] = torch.full((1, 1, 1, 1), float(skv))
    fake_ops = {k: FakeTensor("leaf", name=k) for k in ops}
    memo = {}
    out = (mod.lower_scaled_forward if scaled else mod.lower_forward)(g, score, fake_ops, memo)
    n_fwd = len(g.ops)
    dout = (mod.lower_scaled_backward if scaled else mod.lower_backward)(g, ds, fake_ops, memo)
    return g, out, dout, ops, n_fwd


def _derived(t, memo):
    if id(t) not in memo:
        memo[id(t)] = t.op != "leaf" or t.name in ("score", "dS")
        if t.op not in ("leaf", "gen_index"):
            memo[id(t)] = any(_derived(i, memo) for i in t.inputs)
    return memo[id(t)]


@pytest.mark.parametrize("key", list(_mods()))
def test_lowering_matches_eager_and_autograd(key):
    mod, sq, skv = _mods()[key]
    check_lowering(mod, B, H, sq, skv)


def check_lowering(mod, B, H, sq, skv, scale=2.0, scaled=False):
    """The lowered forward (interpreted in fp32, materialized operands included) == eager in
    float64, and the derived backward == torch.autograd of eager, within 3x the fp32 error.
    scaled: the backend's lowering, fed score x c (c = mod.score_scale(), what cuDNN's attention
    scale then holds) and its dS multiplied by c (what cuDNN does after the backward callback)."""
    g, out, dout, ops, _ = _lower(mod, sq, skv, B, H, scaled=scaled)
    c = mod.score_scale() if scaled else 1.0
    score = torch.randn(B, H, sq, skv) * scale
    ds = torch.randn(B, H, sq, skv)
    leaves = {"score": score * c, "dS": ds, **ops}
    got = interpret(out, leaves).expand(B, H, sq, skv)
    idx = (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
           torch.arange(sq).view(1, 1, sq, 1), torch.arange(skv).view(1, 1, 1, skv))
    lens = (torch.full((B, 1, 1, 1), sq), torch.full((B, 1, 1, 1), skv))
    ref64 = mod.eager(score.double(), *idx, *lens)
    ref32 = mod.eager(score, *idx, *lens)
    ref64, ref32 = ref64.expand_as(got), ref32.expand_as(got)
    fin = torch.isfinite(ref64)
    # In attention the gradient reaching a masked (-inf) score is exactly 0 (softmax weight 0):
    # the lowering's backward relies on it, so the incoming gradient here is 0 there too.
    ds = torch.where(fin, ds, torch.zeros_like(ds))
    leaves["dS"] = ds
    assert torch.equal(torch.isfinite(got), fin), "mask differs"
    testing.assert_close(got, ref64, testing.bound_from(ref32, ref64, torch.float32), what="lowered forward")
    s = score.double().requires_grad_(True)
    (gref,) = torch.autograd.grad(mod.eager(s, *idx, *lens), s, ds.double())
    gs = score.clone().requires_grad_(True)
    (g32,) = torch.autograd.grad(mod.eager(gs, *idx, *lens), gs, ds)
    gd = (interpret(dout, leaves) * c).expand_as(gref)
    testing.assert_close(gd, gref, testing.bound_from(g32, gref, torch.float32), what="derived backward")
    return g


@pytest.mark.parametrize("key", list(_mods()))
def test_scaled_lowering_matches_eager_and_autograd(key):
    mod, sq, skv = _mods()[key]
    check_lowering(mod, B, H, sq, skv, scaled=True)


@pytest.mark.parametrize("key", list(_mods()))
def test_no_op_on_graph_inputs_only_and_no_pbv_first(key):
    mod, sq, skv = _mods()[key]
    g, _, _, ops, _ = _lower(mod, sq, skv)
    memo = {}
    for t in g.ops:
        if t.op == "gen_index":
            assert t.inputs[0].name == "score"
            continue
        assert any(_derived(i, memo) for i in t.inputs), f"{t.op} has only graph-input operands"
        first = t.inputs[0]
        assert not (first.op == "leaf" and ops.get(first.name, torch.empty(2)).numel() == 1 and first.name not in ("score", "dS")), (
            f"{t.op} has a pass-by-value scalar as first input"
        )


def test_backward_reuses_forward_intermediates():
    mod = sm.softcap(1.0)
    g, out, dout, _, n_fwd = _lower(mod, SQ, SKV)
    bwd = [t.op for t in g.ops[n_fwd:]]
    assert bwd == ["mul", "tanh_backward", "div"]
    tb = g.ops[n_fwd + 1]
    assert tb.inputs[1] is g.ops[0]  # tanh's input from the forward (score / cap)
    masked = sm.causal()
    g, out, dout, _, n_fwd = _lower(masked, SQ, SKV)
    assert g.ops[n_fwd:] == []  # an outer mask differentiates to the identity: no backward ops
    assert dout.op == "leaf" and dout.name == "dS"
    inner = sm.score_mod(lambda score, b, h, q_idx, kv_idx: sm.tanh(sm.where(kv_idx <= q_idx, score, 0.0)))
    g, out, dout, _, n_fwd = _lower(inner, SQ, SKV)
    ops = [t.op for t in g.ops[n_fwd:]]
    assert "binary_select" in ops  # a mask inside the expression still selects the gradient


def test_mask_patterns_match_probe():
    """Comparisons become `kv_idx - q_idx` against one host-folded scalar (probe-accepted forms)."""
    g, _, _, ops, n_fwd = _lower(sm.causal_bottom_right(), SQ, SKV)
    names = [t.op for t in g.ops[:n_fwd]]
    assert names == ["gen_index", "gen_index", "sub", "cmp_le", "binary_select"]
    cmp = g.ops[3]
    assert cmp.inputs[1].op == "leaf" and ops[cmp.inputs[1].name].item() == SKV - SQ
    g, _, _, ops, n_fwd = _lower(sm.document_mask(torch.tensor([0, 0, 1, 1, 1, 2, 2])), SKV, SKV)
    assert [t.op for t in g.ops[:n_fwd]] == ["gen_index", "sub", "add", "cmp_eq", "binary_select"]
    assert ops["doc_ids@q"].shape == (1, 1, SKV, 1) and ops["doc_ids@k"].shape == (1, 1, 1, SKV)
    assert ops["doc_ids@q"].dtype == torch.int32


def test_length_folds_missing_raise():
    mod = sm.causal_bottom_right()
    assert mod.needs_host_lengths and not sm.padding_mask().needs_host_lengths
    ops = {k: FakeTensor("leaf", name=k) for k in list(mod.cudnn_operands()) + ["q_len", "kv_len"]}
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        mod.lower_forward(FakeGraph(), FakeTensor("leaf", name="score"), ops, {})


def test_operands_are_cached_cpu_scalars():
    mod = sm.softcap(3.0)
    a, b = mod.cudnn_operands(), mod.cudnn_operands()
    assert a["cap"] is b["cap"] and a["cap"].shape == (1, 1, 1, 1) and a["cap"].dtype == torch.float32
    assert a["cap"].device.type == "cpu" and a["cap"].item() == 3.0
    assert sm.alibi(sm.alibi_slopes(4)).cudnn_operands()["slopes@h"].shape == (1, 4, 1, 1)


@pytest.mark.slow  # a fresh interpreter
def test_lowering_never_imports_cudnn_at_import_time():
    import subprocess
    import sys

    code = "import sys, score_mods; score_mods.softcap(2.0).cudnn_operands(); print('cudnn' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert res.stdout.strip() == "False", res.stderr


# --------------------------------------------------------------------------- new constructs

from helpers.zoo import H as ZH, S as ZS, zoo  # noqa: E402


@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_lowering_matches_eager_and_autograd(name):
    mod, _ = zoo(dtype=torch.float32)[name]
    check_lowering(mod, 1, ZH, ZS, ZS)


@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_scaled_lowering_matches_eager_and_autograd(name):
    mod, _ = zoo(dtype=torch.float32)[name]
    check_lowering(mod, 1, ZH, ZS, ZS, scaled=True)


@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_lowering_emits_only_accepted_patterns(name):
    _check_patterns(zoo(dtype=torch.float32)[name][0], ZS, ZS, 1, ZH)


def _check_patterns(mod, sq, skv, b, h):
    g, _, _, ops, _ = _lower(mod, sq, skv, b, h)
    memo = {}
    for t in g.ops:
        if t.op == "gen_index":
            assert t.inputs[0].name == "score"
            continue
        assert any(_derived(i, memo) for i in t.inputs), f"{t.op} has only graph-input operands"
        first = t.inputs[0]
        assert not (first.op == "leaf" and first.name not in ("score", "dS")), f"{t.op} has the graph input {first.name} first"


def _summary(mod):
    return mod.plan.summary()


def test_plan_classification():
    z = zoo(dtype=torch.float32)
    natten = _summary(z["natten"][0])
    # index arithmetic stays in-graph (measured exact in the backward; graph-input masks are not)
    assert not natten["single"] and not natten["dense"]
    assert {"floor", "div", "abs", "le", "select", "minimum", "maximum"} <= set(natten["in_graph"])
    morton = _summary(z["morton_natten"][0])
    assert len(morton["single"]) == 4 and not morton["dense"] and "&" in morton["single"]["mat0@q"]
    t5 = _summary(z["t5_bias"][0])
    assert list(t5["dense"]) == ["mat0@hqk"] and t5["dense"]["mat0@hqk"].startswith("table[h, ")
    assert t5["in_graph"] == ["add"] and not t5["single"]
    dilated = _summary(z["dilated_window"][0])
    assert not dilated["single"] and not dilated["dense"]  # % in-graph: a - b * floor(a / b)
    assert {"floor", "div", "mul", "sub", "abs"} <= set(dilated["in_graph"])
    blocks = _summary(z["block_diagonal"][0])
    assert not blocks["single"] and blocks["in_graph"] == ["div", "eq", "floor", "select"]
    sandwich = _summary(z["sandwich"][0])
    assert sandwich["dense"] == {"mat0@qk": "rel_bias[((q_idx - kv_idx) + 15)]"}  # (1, 1, S, S), not per head
    assert sandwich["views"] == {"head_scale@h": "head_scale[h]"}
    alibi = _summary(z["gym_alibi"][0])
    assert not alibi["single"] and not alibi["dense"] and "pow" in alibi["in_graph"]  # 2 ** (...): positive base
    glob = _summary(z["global_window"][0])
    assert sorted(glob["single"].values()) == ["is_global[kv_idx]", "is_global[q_idx]"]  # bool: 0/1 fp32
    graph = _summary(z["graphormer"][0])
    assert list(graph["dense"]) == ["mat0@bhqk"]
    for name in ("gelu_activation", "power_mod", "quantized"):
        summary = _summary(z[name][0])
        assert not summary["single"] and not summary["dense"] and not summary["unsupported"], name
    assert {"erf", "log"} <= set(_summary(z["gelu_activation"][0])["in_graph"])  # exp appears in the backward
    assert "pow" in _summary(z["power_mod"][0])["in_graph"]
    ops = z["global_window"][0].cudnn_operands((2, 3, 8, 8), device="cpu")
    assert ops["mat1@q"].shape == (1, 1, 8, 1) and ops["mat0@k"].shape == (1, 1, 1, 8)
    assert ops["mat1@q"].dtype == torch.float32
    dense = z["t5_bias"][0].cudnn_operands((1, ZH, ZS, ZS), device="cpu")["mat0@hqk"]
    assert dense.shape == (1, ZH, ZS, ZS)


def test_materialized_condition_is_compared_with_half():
    mod, _ = zoo(dtype=torch.float32)["global_window"]
    g, _, _, ops, n_fwd = _lower(mod, ZS, ZS, 1, ZH)
    cmps = [t for t in g.ops[:n_fwd] if t.op == "cmp_gt"]
    assert len(cmps) == 2
    for c in cmps:
        assert c.inputs[0].op == "add" and c.inputs[0].inputs[1].name.startswith("mat")  # anchored graph input
        assert ops[c.inputs[1].name].item() == 0.5


@pytest.fixture
def in_graph_table():
    """Edit lower_cudnn.IN_GRAPH for one test (as after a GPU probe); plans are rebuilt."""
    saved = dict(lower_cudnn.IN_GRAPH)
    lower_cudnn.plan_for.cache_clear()
    yield lower_cudnn.IN_GRAPH
    lower_cudnn.IN_GRAPH.clear()
    lower_cudnn.IN_GRAPH.update(saved)
    lower_cudnn.plan_for.cache_clear()


def test_the_in_graph_table_switches_ops_to_materialization(in_graph_table):
    in_graph_table["floor"] = None  # say the probe found floor declined
    assert not lower_cudnn.emittable("floordiv") and not lower_cudnn.emittable("mod")
    z = zoo(dtype=torch.float32)
    dilated = z["dilated_window"][0].renamed("dilated")
    summary = _summary(dilated)
    assert summary["dense"] == {"mat0@qk": "(abs((q_idx - kv_idx)) % dilation)"} and "floor" not in summary["in_graph"]
    check_lowering(dilated, 1, ZH, ZS, ZS)
    quantized = z["quantized"][0]
    assert "op 'mod' is not emitted" in quantized.cudnn_unsupported
    with pytest.raises(NotImplementedError, match="cannot run on cuDNN: .*backend='reference'"):
        quantized.cudnn_operands((1, 1, 4, 4))
    with pytest.raises(NotImplementedError, match="cannot run on cuDNN"):
        quantized.lower_forward(FakeGraph(), FakeTensor("leaf", name="score"), {}, {})


def test_unsupported_and_dims_contract():
    @sm.score_mod
    def score_indexed(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        return score + table[sm.floor(score).clamp(0, 3)]

    mod = score_indexed(table=torch.randn(4))
    assert "tensor gather whose index depends on the score" in mod.cudnn_unsupported
    natten = zoo()["morton_natten"][0]  # bit operations on one axis: materialized
    assert natten.needs_dims and not sm.softcap(2.0).needs_dims and sm.softcap(2.0).cudnn_unsupported is None
    assert not zoo()["natten"][0].needs_dims  # // and % on positions: in-graph
    with pytest.raises(ValueError, match="must call cudnn_operands\\(dims=\\(B, H, Sq, Skv\\), device=...\\)"):
        natten.cudnn_operands()
    with pytest.raises(TypeError, match="dims must be \\(B, H, Sq, Skv\\)"):
        natten.cudnn_operands((4, 4))
    assert set(sm.softcap(2.0).cudnn_operands()) == set(sm.softcap(2.0).cudnn_operands((1, 1, 4, 4)))
    chained = sm.compose(natten, sm.raw_callback(_raw_identity, bprop=_raw_identity))
    assert chained.needs_dims and "m0_mat0@q" in chained.cudnn_operands((1, 1, 16, 16), device="cpu")


def _raw_identity(graph, score, tensors):
    return score


def test_lengths_in_materializations_need_host_lengths():
    @sm.mask_mod
    def from_the_end(b, h, q_idx, kv_idx):
        return (sm.q_len() - 1 - q_idx) // 4 == (sm.kv_len() - 1 - kv_idx) // 4

    assert from_the_end.needs_host_lengths and from_the_end.plan.length_materialized == ["mat0@q", "mat1@k"]
    ops = from_the_end.cudnn_operands((1, 1, 6, 9), device="cpu")
    assert ops["mat0@q"].flatten().tolist() == [1, 1, 0, 0, 0, 0] and ops["mat1@k"].flatten().tolist() == [2, 1, 1, 1, 1, 0, 0, 0, 0]
    assert not sm.padding_mask().needs_host_lengths  # plain comparisons with lengths stay in-graph


def test_irregular_mask_is_a_structural_fact():
    z = zoo(dtype=torch.float32)
    # masks whose condition reads graph inputs along the keys (ids, neighbourhoods) are irregular:
    # the cuDNN backend refuses their backward where its quirk irregular_mask_backward applies
    for name in ("morton_natten", "global_window"):
        assert z[name][0].irregular_mask and z[name][0].has_backward, name
    # in-graph index arithmetic (floor / div) recomputes exactly (measured: NATTEN dQ 3e-4 in fp16)
    for name in ("natten", "block_diagonal", "dilated_window", "prefix_lm", "t5_bias", "sandwich", "gelu_activation",
                 "bias_under_mask"):
        assert not z[name][0].irregular_mask, name
    assert sm.document_mask(torch.arange(4)).irregular_mask
    assert not sm.document_mask(torch.arange(4), contiguous=True).irregular_mask


def test_div_recipe_switch(in_graph_table):
    in_graph_table["div"] = "mul_reciprocal"  # if the probe declined tensor / tensor division
    in_graph_table["floordiv"] = None          # a * (1 / b) is not exact enough to floor
    in_graph_table["mod"] = None
    mod = sm.softcap(2.0).renamed("softcap_probe")
    g = check_lowering(mod, 1, 2, 4, 4)
    assert "div" not in [t.op for t in g.ops]  # score / cap became score * (1 / cap), 1 / cap folded on the host
    dilated = zoo(dtype=torch.float32)["dilated_window"][0].renamed("dilated_probe")
    assert list(dilated.plan.summary()["dense"].values()) == ["(abs((q_idx - kv_idx)) % dilation)"]
    check_lowering(dilated, 1, ZH, ZS, ZS)


def test_bucketed_batch_dims_repeat_the_last_row_of_b_indexed_tables():
    mod, _ = zoo(dtype=torch.float32)["graphormer"]  # spatial[h, dist[b, q_idx, kv_idx]], dist has batch 1
    dense = mod.cudnn_operands((4, ZH, ZS, ZS), device="cpu")["mat0@bhqk"]
    assert dense.shape == (4, ZH, ZS, ZS) and torch.equal(dense[3], dense[0])


def test_operands_are_memoized_per_object_and_follow_tensor_versions():
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])

    @sm.mask_mod
    def halves(b, h, q_idx, kv_idx, ids=sm.TensorParam("int")):
        return ids[q_idx // 2] == ids[kv_idx // 2]

    mod = halves(ids=ids)
    a, b = mod.cudnn_operands((1, 1, 8, 8), device="cpu"), mod.cudnn_operands((1, 1, 8, 8), device="cpu")
    assert all(a[k] is b[k] for k in a)
    ids[0] = 5  # in place: the version changes, the operands follow
    c = mod.cudnn_operands((1, 1, 8, 8), device="cpu")
    assert c["mat0@q"][0, 0, 0, 0].item() == 5.0 and a["mat0@q"] is not c["mat0@q"]


@pytest.mark.parametrize("cap", [1.5, -1.5, 3.0])
def test_scalar_conditions_lower_as_host_folded_comparisons(cap):
    @sm.score_mod
    def signed(score, b, h, q_idx, kv_idx, cap=1.0):
        return sm.where(cap > 0, score, -score) + sm.where((cap > 2) & (q_idx < 2), 1.0, 0.0)

    check_lowering(signed(cap=cap), 1, 1, 4, 5)


def test_chains_report_unsupported_parts():
    @sm.score_mod
    def score_indexed(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        return score + table[sm.floor(score).clamp(0, 3)]

    chained = sm.compose(score_indexed(table=torch.randn(4)), sm.raw_callback(_raw_identity))
    assert "cannot run on cuDNN" in chained.cudnn_unsupported
    assert sm.compose(sm.causal(), sm.raw_callback(_raw_identity)).cudnn_unsupported is None


def test_gathers_at_constant_indices_are_materialized_not_folded():
    @sm.score_mod
    def const_index(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), k=2):
        return score * table[k] + table[0] * 0.5

    mod = const_index(table=torch.tensor([1.5, -2.0, 3.0]))
    summary = mod.plan.summary()
    assert sorted(summary["single"].values()) == ["(table[0] * 0.5)", "table[k]"]
    # the one scalar is the -inf of the masked-score guard: score * table[k] turns a masked -inf
    # into +inf (or NaN) when table[k] <= 0, so masked scores are kept masked explicitly
    assert summary["scalar"] == ["c0"] and "select" in summary["in_graph"]
    assert mod.cudnn_operands((1, 1, 3, 3), device="cpu")["mat0@s"].shape == (1, 1, 1, 1)
    check_lowering(mod, 1, 1, 3, 3)


@pytest.mark.parametrize("name", list(zoo()))
def test_masked_scores_give_no_nan_forward_or_backward(name):
    """cuDNN runs the mod and its derivative also where the score is already -inf (masked, past
    the keys of a partial tile) with dS = 0 there. The lowered forward must leave those positions
    -inf or finite and the backward must give 0, whatever eager gives at -inf (s % c, gelu(s),
    |s| ** p are NaN there), and finite positions keep their values."""
    mod, _ = zoo(dtype=torch.float32)[name]
    g, out, dout, ops, _ = _lower(mod, ZS, ZS, 1, ZH)
    score = torch.randn(1, ZH, ZS, ZS) * 2.0
    masked = torch.rand(1, ZH, ZS, ZS, generator=torch.Generator().manual_seed(3)) < 0.3
    ds = torch.where(masked, torch.zeros_like(score), torch.randn(1, ZH, ZS, ZS))
    plain = interpret(out, {"score": score, "dS": ds, **ops}).expand_as(score)
    plain_d = interpret(dout, {"score": score, "dS": ds, **ops}).expand_as(score)
    leaves = {"score": score.masked_fill(masked, float("-inf")), "dS": ds, **ops}
    got = interpret(out, leaves).expand_as(score)
    got_d = interpret(dout, leaves).expand_as(score)
    assert not torch.isnan(got).any() and not (got == float("inf")).any(), f"{name}: forward NaN/+inf at a masked score"
    assert torch.equal(got[~masked], plain[~masked])
    assert torch.equal(got_d[masked], torch.zeros_like(got_d[masked])), f"{name}: backward non-zero at a masked score"
    assert torch.equal(got_d[~masked], plain_d[~masked])


def test_the_masked_score_guard_is_added_only_where_needed():
    z = zoo(dtype=torch.float32)
    for name in ("quantized", "gelu_activation", "power_mod"):
        root = z[name][0].root
        assert lower_cudnn._masked_stays_masked(root) is not root, name
    for mod in (sm.softcap(20.0), z["t5_bias"][0], z["bias_under_mask"][0], z["natten"][0]):
        assert lower_cudnn._masked_stays_masked(mod.root) is mod.root, mod


# --------------------------------------------------------------------------- the softmax-scale fold

def _op_counts(mod, scaled):
    g, _, _, _, n_fwd = _lower(mod, 4, 4, 1, 1, scaled=scaled)
    return n_fwd, len(g.ops) - n_fwd


def test_softcap_folds_its_divisor_into_the_attention_scale():
    mod = sm.softcap(50.0)
    plan = lower_cudnn.scaled_plan_for(mod.root)
    assert lower_cudnn.show(plan.forward) == "(tanh(score) * cap)" and plan.score_scale is not None
    assert mod.score_scale() == pytest.approx(1 / 50.0)
    assert _op_counts(mod, scaled=False) == (3, 3) and _op_counts(mod, scaled=True) == (2, 2)
    assert mod.plan.score_scale is None  # the plain plan (chains' later parts, eager tools) is unchanged
    # the factor follows the values bound now, the structure (and graph) stays
    other = sm.softcap(20.0)
    assert other.cache_key == mod.cache_key and other.score_scale() == pytest.approx(1 / 20.0)
    assert mod.take_values(other) and mod.score_scale() == pytest.approx(1 / 20.0)


def _pick(name):
    @sm.score_mod(name=name)
    def divide_then(score, b, h, q_idx, kv_idx, t=2.0):
        return sm.where(q_idx >= kv_idx, sm.tanh(score / t) * t, -float("inf"))

    @sm.score_mod(name=name)
    def scale_then(score, b, h, q_idx, kv_idx, t=2.0):
        return sm.tanh(score * t) * t

    @sm.score_mod(name=name)
    def used_twice(score, b, h, q_idx, kv_idx, t=2.0):
        return sm.tanh(score * t) + score

    @sm.score_mod(name=name)
    def product_only(score, b, h, q_idx, kv_idx, t=2.0):
        return score * t

    @sm.score_mod(name=name)
    def by_length(score, b, h, q_idx, kv_idx):
        return sm.tanh(score / sm.kv_len())

    @sm.score_mod(name=name)
    def by_tensor(score, b, h, q_idx, kv_idx, w=sm.TensorParam()):
        return sm.tanh(score * w[h])

    @sm.score_mod(name=name)
    def by_constant(score, b, h, q_idx, kv_idx):
        return sm.tanh(score * 0.5)

    return {"divide_then": divide_then, "scale_then": scale_then, "used_twice": used_twice, "product_only": product_only,
            "by_length": by_length, "by_tensor": by_tensor(w=torch.rand(H) + 0.5), "by_constant": by_constant}


@pytest.mark.parametrize("name,folds", [("divide_then", True), ("scale_then", False), ("used_twice", False),
                                        ("product_only", False), ("by_length", False), ("by_tensor", False),
                                        ("by_constant", False)])
def test_what_folds(name, folds):
    """Only a score reached solely through one product / quotient with host scalars folds, and only
    when the mod then binds exactly the same operands: scale_then's plain lowering guards
    score * t at masked scores (t = 0 would make -inf * t NaN) with a -inf constant its folded
    form does not need, and by_constant's factor is the constant itself."""
    mod = _pick(f"fold_{name}")[name]
    plan = lower_cudnn.scaled_plan_for(mod.root)
    assert (plan.score_scale is not None) == folds
    assert (mod.score_scale() != 1.0) == folds
    check_lowering(mod, B, H, SQ, SKV, scale=0.5, scaled=True)


def test_chains_fold_only_their_first_part():
    first = sm.compose(sm.softcap(4.0), sm.raw_callback(_raw_identity, bprop=_raw_identity))
    later = sm.compose(sm.raw_callback(_raw_identity, bprop=_raw_identity), sm.softcap(4.0))
    assert first.score_scale() == pytest.approx(0.25) and later.score_scale() == 1.0
    for mod in (first, later):
        g, out, dout, ops, n_fwd = _lower(mod, SQ, SKV, scaled=True)
        score = torch.randn(B, H, SQ, SKV) * 3
        got = interpret(out, {"score": score * mod.score_scale(), "dS": score, **ops})
        want = 4.0 * torch.tanh(score / 4.0)
        testing.assert_close(got, want, testing.agreement_bound(want, torch.float32), what="folded softcap")
    assert [t.op for t in _lower(later, SQ, SKV, scaled=True)[0].ops][:3] == ["div", "tanh", "mul"]


def test_the_backend_binds_the_folded_factor_and_refuses_a_non_positive_one():
    from fused_attn.backends.cudnn import lowering as L

    plain = torch.full((1, 1, 1, 1), 0.125)
    mod = sm.softcap(8.0)
    low = L.Lowering(None, False, mod, mod, "", {}, None)
    bound = L.attn_scale(low, mod, 0.125, plain)
    assert bound.item() == pytest.approx(0.125 / 8.0) and L.attn_scale(low, mod, 0.125, plain) is bound
    assert L.attn_scale(L.Lowering(None, False, None, None, "", {}, None), mod, 0.125, plain) is plain
    neg = _pick("fold_negative")["divide_then"](t=-2.0)
    with pytest.raises(NotImplementedError, match="-0.5.*positive and finite"):
        L.attn_scale(L.Lowering(None, False, neg, neg, "", {}, None), neg, 0.125, plain)
    causal = sm.causal()
    assert L.attn_scale(L.Lowering(None, False, causal, causal, "", {}, None), causal, 0.125, plain) is plain
