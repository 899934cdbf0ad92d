"""cuDNN lowering of score_mods, checked on CPU with a recording fake graph and a torch interpreter.

The fake graph records every op (name, inputs, data types); the interpreter evaluates the
recorded ops with torch, so the forward lowering is compared with `eager` and the derived
backward with torch.autograd of `eager`, without a GPU.
"""

import math

import pytest
import torch

import score_mods as sm

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
    "cmp_eq": torch.eq, "cmp_neq": torch.ne,
}
_UN = {
    "neg": torch.neg, "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "abs": torch.abs,
    "sqrt": torch.sqrt, "sigmoid": torch.sigmoid, "reciprocal": torch.reciprocal,
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


def _lower(mod, sq, skv):
    g = FakeGraph()
    score, ds = FakeTensor("leaf", name="score"), FakeTensor("leaf", name="dS")
    ops = dict(mod.cudnn_operands())
    ops.update(mod.length_operands(sq, skv))
    ops["q_len"] = torch.full((1, 1, 1, 1), float(sq))
    ops["kv_len"] = torch.full((1, 1, 1, 1), float(skv))
    fake_ops = {k: FakeTensor("leaf", name=k) for k in ops}
    memo = {}
    out = mod.lower_forward(g, score, fake_ops, memo)
    n_fwd = len(g.ops)
    dout = mod.lower_backward(g, ds, fake_ops, memo)
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
    g, out, dout, ops, _ = _lower(mod, sq, skv)
    score = torch.randn(B, H, sq, skv) * 2
    ds = torch.randn(B, H, sq, skv)
    leaves = {"score": score, "dS": ds, **ops}
    got = interpret(out, leaves)
    idx = _grid(sq, skv)
    lens = (torch.full((B, 1, 1, 1), sq), torch.full((B, 1, 1, 1), skv))
    ref64 = mod.eager(score.double(), *idx, *lens)
    ref32 = mod.eager(score, *idx, *lens)
    fin = torch.isfinite(ref64)
    # In attention the gradient reaching a masked (-inf) score is exactly 0 (softmax weight 0):
    # the lowering's backward relies on it, so the incoming gradient here is 0 there too.
    ds = torch.where(fin, ds, torch.zeros_like(ds))
    leaves["dS"] = ds
    assert torch.equal(torch.isfinite(got), fin), "mask differs"
    tol = 3 * (ref32 - ref64)[fin].abs().max().item() + 1e-5
    assert (got.double() - ref64)[fin].abs().max().item() <= tol
    s = score.double().requires_grad_(True)
    (gref,) = torch.autograd.grad(mod.eager(s, *idx, *lens), s, ds.double())
    gs = score.clone().requires_grad_(True)
    (g32,) = torch.autograd.grad(mod.eager(gs, *idx, *lens), gs, ds)
    gtol = 3 * (g32.double() - gref).abs().max().item() + 1e-5
    gd = interpret(dout, leaves)
    torch.testing.assert_close(gd.double().expand_as(gref), gref, rtol=0, atol=gtol)


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


def test_lowering_never_imports_cudnn_at_import_time():
    import subprocess
    import sys

    code = "import sys, score_mods; score_mods.softcap(2.0).cudnn_operands(); print('cudnn' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=".")
    assert res.stdout.strip() == "False", res.stderr
