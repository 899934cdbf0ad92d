"""fused_attn::attn_fwd / attn_bwd custom ops on the reference backend (CPU): opcheck, torch.compile."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

import fused_attn
import score_mods as sm
from fused_attn import ops
from fused_attn.plan import NO_VARLEN, Varlen
from fused_attn.spec import resolve_spec
from fused_attn.testing import (agreement_bound, assert_close, grad_tolerances, mask_band, max_error,
                                packed_tolerances, reference_attention, tolerance)
from helpers.compile_cases import Block, check_compiled_bias_calls
from score_mods.base import ScoreMod
from score_mods.library import softcap


class Softcap(ScoreMod):
    """Eager-only softcap with a float parameter and rebind(), as the ops require."""

    name = "test_softcap"

    def __init__(self, cap: float):
        self.cap = cap

    @property
    def cache_key(self):
        return ("test_softcap", "cap:float")

    def scalars(self):
        return {"cap": self.cap}

    def rebind(self, scalars, tensors):
        return Softcap(scalars["cap"])

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return self.cap * torch.tanh(score / self.cap)

    def lower_forward(self, graph, score, operands, memo):  # pragma: no cover - CPU tests only
        raise NotImplementedError


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def dense_call(score_mod=None, causal=True, grad=True, b=2, s=8, h=4, hkv=2, d=16):
    """(q, k, v) BSHD leaves, their spec, and no varlen."""
    q, k, v = (torch.randn(b, s, hh, d, requires_grad=grad) for hh in (h, hkv, hkv))
    spec, mod = resolve_spec(qkv_format="bshd", attn_mask_type="causal" if causal else "no_mask",
                             score_mod=score_mod, backend="reference", return_lse=True)
    return (q, k, v), spec, mod, NO_VARLEN


def thd_call(score_mod=None):
    cu = torch.tensor([0, 0, 3, 4, 11], dtype=torch.int32)
    q, k, v = (torch.randn(11, 4, 16, requires_grad=True) for _ in range(3))
    spec, mod = resolve_spec(qkv_format="thd", attn_mask_type="causal", score_mod=score_mod, backend="reference",
                             return_lse=True)
    return (q, k, v), spec, mod, Varlen(cu, cu, None, None, 7, 7)


def exact_and_bounds(fmt, q, k, v, grad_out, scale, cu=None, mod=None):
    """float64 out and gradients of a causal call, and their bounds (the project's rule in q's dtype);
    q/k/v leaves in their format (bshd or thd)."""
    fn = None if mod is None else (lambda s, *_: mod.eager(s, None, None, None, None, None, None))
    if fmt == "thd":
        exact, bounds = packed_tolerances(q, k, v, grad_out, cu, cu, scale, q.dtype, band=mask_band("causal"),
                                          score_fn=fn)
        return [exact[n] for n in ("out", "dq", "dk", "dv")], [bounds[n] for n in ("out", "dq", "dk", "dv")]
    ql, kl, vl, gl = (t.detach().transpose(1, 2) for t in (q, k, v, grad_out))
    mask = torch.ones(ql.shape[2], kl.shape[2], dtype=torch.bool).tril()
    out, _ = reference_attention(ql, kl, vl, scale, mask, fn)
    grads, grad_bounds = grad_tolerances(ql, kl, vl, gl, scale, ql.dtype, mask, fn)
    return ([t.transpose(1, 2) for t in (out, *grads)],
            [tolerance(ql, kl, vl, scale, ql.dtype, mask, fn), *grad_bounds])


def fwd_args(qkv, spec, mod, varlen):
    scalars = torch.tensor(list(mod.scalars().values()) if mod else [], dtype=torch.float64)
    return (*qkv, varlen.cu_seqlens_q, varlen.cu_seqlens_kv, None, None, varlen.max_seqlen_q, varlen.max_seqlen_kv,
            None, scalars, [], None, ops.register_spec(spec))


@pytest.mark.slow
@pytest.mark.parametrize("make", [dense_call, thd_call])
@pytest.mark.parametrize("sm", [None, Softcap(3.0)])
def test_opcheck_forward(make, sm):
    qkv, spec, mod, varlen = make(sm)
    torch.library.opcheck(torch.ops.fused_attn.attn_fwd.default, fwd_args(qkv, spec, mod, varlen))


@pytest.mark.slow
def test_opcheck_backward():
    qkv, spec, mod, varlen = dense_call(Softcap(2.0))
    a = fwd_args(qkv, spec, mod, varlen)
    out, lse, saved = torch.ops.fused_attn.attn_fwd(*a)
    # attn_bwd is not itself differentiable (no double backward): check it on detached inputs.
    bwd = (torch.randn(out.shape), *(t.detach() for t in a[:3]), out.detach(), saved.detach()) + a[3:]
    torch.library.opcheck(torch.ops.fused_attn.attn_bwd.default, bwd)


@pytest.mark.slow
@pytest.mark.parametrize("make", [dense_call, thd_call])
def test_attention_forward_backward_match_naive(make):
    (q, k, v), spec, mod, varlen = make(Softcap(2.5))
    out, lse = ops.attention_by_key(ops.register_spec(spec), mod, q, k, v, varlen, None)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want, bounds = exact_and_bounds(spec.qkv_format, q, k, v, g, 0.25, varlen.cu_seqlens_q, mod)
    assert lse.dtype == torch.float32
    for name, a, b, bound in zip(("out", "dq", "dk", "dv"), (out, *got), want, bounds):
        assert_close(a, b, bound, name)


def test_unregistered_key_and_missing_rebind():
    with pytest.raises(ValueError, match="spec key 'nope' is not registered"):
        ops.lookup_spec("nope")

    class NoRebind(Softcap):
        rebind = ScoreMod.rebind  # the contract's default: a mod with parameters cannot rebind them

        @property
        def cache_key(self):
            return ("norebind",)

    (q, k, v), spec, mod, varlen = dense_call(NoRebind(1.0))
    with pytest.raises(NotImplementedError, match="no rebind"):
        ops.attention_by_key(ops.register_spec(spec), mod, q, k, v, varlen, None)


def test_spec_key_is_structural():
    specs = [dense_call(Softcap(c))[1] for c in (1.0, 7.0)]
    assert ops.spec_key(specs[0]) == ops.spec_key(specs[1])
    assert ops.spec_key(specs[0]).startswith("reference:test_softcap:")
    assert ops.spec_key(dense_call(Softcap(1.0), causal=False)[1]) != ops.spec_key(specs[0])


def _run(model, x, *extra):
    x = x.detach().requires_grad_()
    y = model(x, *extra)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads


@pytest.mark.slow  # torch.compile on CPU: seconds a case
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("sm", [None, 2.0])
def test_compiled_block_matches_eager(backend, varlen, sm, request):
    torch.manual_seed(0)
    model = Block(score_mod=None if sm is None else softcap(sm))
    x = torch.randn(2, 8, 32)
    extra = (torch.tensor([0, 5, 8, 9, 16], dtype=torch.int32), 8) if varlen else ()
    y0, g0 = _run(model, x, *extra)
    # thd: the functional API validates cu_seqlens values on the host, a graph break by design.
    compiled = torch.compile(model, backend=backend, fullgraph=not varlen)
    y1, g1 = _run(compiled, x, *extra)
    assert_close(y1, y0, agreement_bound(y0, torch.float32), "out")
    for i, (a, b) in enumerate(zip(g0, g1)):
        assert_close(b, a, agreement_bound(a, torch.float32), f"grad {i}")


@pytest.mark.slow  # torch.compile on CPU: seconds a case
def test_inductor_small_case():
    torch.manual_seed(0)
    model = Block(score_mod=softcap(2.0))
    x = torch.randn(2, 8, 32)
    y0, g0 = _run(model, x)
    try:
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        y1, g1 = _run(compiled, x)
    except Exception as exc:  # no C++ compiler on this machine
        if "compiler" in str(exc).lower() or "InvalidCxxCompiler" in type(exc).__name__:
            pytest.skip(f"inductor unavailable: {type(exc).__name__}")
        raise
    assert_close(y1, y0, agreement_bound(y0, torch.float32), "out")
    for i, (a, b) in enumerate(zip(g0, g1)):
        assert_close(b, a, agreement_bound(a, torch.float32), f"grad {i}")


@pytest.mark.slow  # torch.compile on CPU: seconds a case
def test_no_recompile_when_float_param_changes():
    torch._dynamo.reset()
    model = Block(score_mod=softcap(2.0))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(2, 8, 32)
    outs = []
    for cap in (2.0, 3.0, 5.0, 0.7):
        model.attn.score_mod = softcap(cap)
        outs.append(compiled(x))
        want = model(x)
        assert_close(outs[-1], want, agreement_bound(want, torch.float32), f"cap {cap}")
    # dynamo may specialise on the first value once, then the float becomes dynamic:
    assert counter.frame_count <= 2
    before = counter.frame_count
    model.attn.score_mod = softcap(11.0)
    compiled(x)
    assert counter.frame_count == before
    assert max_error(outs[0], outs[1]) > agreement_bound(outs[1], torch.float32)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_sees_custom_ops_in_forward_and_backward():
    (q, k, v), spec, mod, varlen = dense_call(Softcap(2.0), causal=False)
    with OpLog() as fwd_log:
        out, _ = ops.attention_by_key(ops.register_spec(spec), mod, q, k, v, varlen, None)
    with OpLog() as bwd_log:
        out.sum().backward()
    assert any(n.startswith("fused_attn.attn_fwd") for n in fwd_log.names)
    assert any(n.startswith("fused_attn.attn_bwd") for n in bwd_log.names)
    assert q.grad is not None and k.grad is not None and v.grad is not None


@pytest.mark.slow  # torch.compile on CPU: seconds a case
def test_functional_call_compiles_fullgraph_with_score_mod_and_mask():
    mod = softcap(3.0)

    def f(q, k, v):
        return fused_attn.dot_product_attention(q, k, v, score_mod=mod, attn_mask_type="causal")

    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


@pytest.mark.slow  # torch.compile on CPU: seconds a case
def test_varlen_and_doc_packed_compile_fullgraph():
    cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32)
    cu_seq = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32)

    def f(q, k, v):
        a = fused_attn.varlen_attn(q, k, v, cu, cu, 8, 8, window_size=(-1, 0))
        b = fused_attn.doc_packed_attn(q.view(2, 8, 4, 16), k.view(2, 8, 4, 16), v.view(2, 8, 4, 16), cu_seq,
                                       is_causal=True)
        return a, b

    q, k, v = (torch.randn(16, 4, 16) for _ in range(3))
    got = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    for a, b in zip(got, f(q, k, v)):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- mods built in the compiled function

_H, _S = 4, 8
_TABLE = torch.randn(_H, 16)
_BIAS = torch.randn(1, _H, _S, _S)
_BUILT_INSIDE = {
    "softcap": lambda t: sm.softcap(20.0),
    "bind": lambda t: sm.softcap(20.0).bind(cap=7.0),
    "alibi": lambda t: sm.alibi(t["slopes"]),
    "trained_bias": lambda t: sm.post_scale_bias(t["bias"]),
    "trained_t5_table": lambda t: sm.gym.relative_position_bias(t["table"], max_distance=8),
    "compose": lambda t: sm.compose(sm.softcap(20.0), sm.post_scale_bias(t["bias"]), sm.causal()),
    "sliding_window": lambda t: sm.sliding_window(3, 0),
    "and_masks": lambda t: sm.and_masks(sm.causal(), sm.sliding_window(4, -1)),
}


@pytest.fixture
def fresh_structures(monkeypatch):
    """An empty structure registry: structures are first made while the compiler traces."""
    from score_mods import templates

    monkeypatch.setattr(templates, "_SLOTS", templates._Slots())
    monkeypatch.setattr(templates, "_ORDER", templates.OrderedDict())


@pytest.mark.slow  # torch.compile on CPU: seconds a case
@pytest.mark.parametrize("name", list(_BUILT_INSIDE))
def test_score_mods_built_inside_a_fullgraph_compiled_function(name, fresh_structures):
    """A model may build its score_mod in forward (softcap(self.cap), post_scale_bias(self.bias),
    a T5 table, compose(...)): under torch.compile(fullgraph=True) that used to crash inside the
    compiler (the spec was resolved from an object the compiler only tracked). Outputs and every
    gradient (tables included) equal eager; an in-place change of a table recompiles nothing.
    The compiled call runs first, and each call also builds a second structured mod, so
    structures are made during the trace, several in one trace."""
    params = {"bias": _BIAS.clone().requires_grad_(), "table": _TABLE.clone().requires_grad_(),
              "slopes": sm.alibi_slopes(_H)}
    make = _BUILT_INSIDE[name]

    def f(q, k, v):
        other = fused_attn.dot_product_attention(q, k, v, score_mod=sm.and_masks(sm.causal(), sm.sliding_window(2, 1)),
                                                 backend="reference")
        return fused_attn.dot_product_attention(q, k, v, score_mod=make(params), backend="reference") + other

    q, k, v = (torch.randn(2, _S, _H, 16, requires_grad=True) for _ in range(3))
    leaves = (q, k, v, params["bias"], params["table"])

    def run(fn):
        for t in leaves:
            t.grad = None
        out = fn(q, k, v)
        out.square().sum().backward()
        return out.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]

    counter = CompileCounter()
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for _ in range(2):
        got, got_grads = run(compiled)
        want, want_grads = run(f)
        torch.testing.assert_close(got, want)
        for a, b in zip(got_grads, want_grads):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b)
        with torch.no_grad():  # new values, same structure
            params["bias"].mul_(0.5)
            params["table"].add_(0.25)
    assert counter.frame_count == 1


def test_structured_factories_make_their_structure_once():
    assert sm.sliding_window(3, 0).root is sm.sliding_window(7, 0).root
    assert sm.sliding_window(3, 0).root is not sm.sliding_window(3, -1).root
    assert sm.sliding_window(3, 0).name == "sliding_window_3_0" and sm.sliding_window(7, 0).name == "sliding_window_7_0"
    a = sm.compose(sm.softcap(20.0), sm.causal())
    b = sm.compose(sm.softcap(5.0), sm.causal())
    assert a.root is b.root and a.cache_key == b.cache_key and a.scalars() != b.scalars()
    assert sm.compose(sm.causal(), sm.softcap(5.0)).root is not a.root
    t = torch.randn(4, 16)
    assert sm.gym.relative_position_bias(t, 8).root is sm.gym.relative_position_bias(t * 2, 8).root


def test_structure_registry_is_bounded_and_rebuilds_what_it_dropped(monkeypatch):
    from collections import OrderedDict

    from score_mods import templates

    monkeypatch.setattr(templates, "_MAX", 2)
    monkeypatch.setattr(templates, "_ORDER", OrderedDict())  # empty: what earlier tests built is not counted
    monkeypatch.setattr(templates, "_SLOTS", templates._Slots())
    first = sm.sliding_window(3, 0).root
    sm.sliding_window(3, -1)
    sm.sliding_window(-1, 3, bottom_right=True)  # the first structure is dropped
    assert len(templates._ORDER) <= 2 and len(vars(templates._SLOTS)) <= 2
    again = sm.sliding_window(5, 0)
    assert again.root is not first and again.cache_key == sm.sliding_window(3, 0).cache_key
    torch.testing.assert_close(again.eager(torch.zeros(1, 1, 6, 6), *_grid(6), 6, 6),
                               sm.sliding_window(5, 0).eager(torch.zeros(1, 1, 6, 6), *_grid(6), 6, 6))


def _grid(s):
    z = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    return z, z, torch.arange(s).view(1, 1, -1, 1), torch.arange(s).view(1, 1, 1, -1)


@pytest.mark.slow  # torch.compile on CPU: seconds a case
def test_a_native_band_survives_into_the_compiled_spec():
    """The cuDNN lowering runs a pure library mask as its own band (`native_band`); the spec a
    compiled call registers must keep it, for mods passed in and built inside alike."""
    outside = sm.sliding_window(3, 0)
    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    for make in (lambda: outside, lambda: sm.sliding_window(3, 0)):
        torch._dynamo.reset()
        f = lambda a, b, c: fused_attn.dot_product_attention(a, b, c, score_mod=make(), backend="reference")  # noqa: E731
        torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(q, k, v), f(q, k, v))
        spec = ops.lookup_spec(next(reversed(ops._REGISTRY)))
        assert spec.score_mod.native_band == (3, 0, False)


@pytest.mark.slow  # torch.compile on CPU: seconds a case
@pytest.mark.parametrize("layout", ["dense", "expanded"])
def test_a_traced_mods_compiled_spec_is_the_one_the_mod_itself_gives(layout):
    """Under torch.compile a traced mod reaches the spec resolution as (origin, dtypes, ranks,
    native band): the registered spec must be exactly the one the complete mod gives (its
    template holds meta stand-ins; a call plan takes shapes from its own call's tensors, see
    test_cudnn_runners_cpu)."""
    from fused_attn.functional import _resolve_call

    t = torch.randn(1, _H, _S, _S) if layout == "dense" else torch.randn(1, 1, _S, _S).expand(2, _H, _S, _S)
    mod = sm.compose(sm.softcap(20.0), sm.post_scale_bias(t))
    config = ("bshd", "causal", None, None, None, None, None, False, "cudnn", False, "vanilla", 0.0)
    direct = ops.compiled_key(_resolve_call, config, mod, None, "cuda", torch.bfloat16, 16, 16)
    structured = ops.compiled_key(_resolve_call, config, *mod.compile_structure(), "cuda", torch.bfloat16, 16, 16)
    # the same spec (the key's digest is of the spec's repr, which leaves the template mod out: its
    # structure enters through score_mod_key); the label before it is the origin's value-free name
    assert structured.rsplit(":", 1)[1] == direct.rsplit(":", 1)[1]
    template = ops.lookup_spec(structured).score_mod.tensors()["m1_bias"]
    assert template.device.type == "meta" and template.dtype == t.dtype and template.dim() == t.dim()


@pytest.mark.slow
def test_compiled_bias_calls_follow_each_calls_shapes():
    check_compiled_bias_calls("cpu", "reference", torch.float32, 16)


@pytest.mark.slow
def test_origins_cross_into_compiled_code_by_name_while_they_live():
    """Compiled code hands a mod's origin to eager code by name (a constant in every torch
    version); the name table holds origins weakly, so it grows with live mods only."""
    import gc

    from score_mods.templates import template
    from score_mods.trace import origin_named

    @sm.score_mod
    def doubled(score, b, h, q_idx, kv_idx, k=2.0):
        return score * k

    name = doubled.origin_name
    bound = doubled(k=3.0)
    assert bound.origin_name == name and origin_named(name) is doubled
    del doubled, bound
    gc.collect()
    with pytest.raises(KeyError, match="no live score_mod origin named"):
        origin_named(name)
    with pytest.raises(TypeError, match="template arguments must be bools, ints, floats, strings or None, got "
                                        "TracedMod"):
        template(lambda m: m, sm.causal())
