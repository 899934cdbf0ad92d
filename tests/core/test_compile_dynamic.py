"""torch.compile without recompiles: one graph for every sequence length under dynamic=True (module
and functional), one graph for score_mod objects of one structure, a value change before backward,
and `opcheck` of every fused_attn op with and without lse (reference backend, CPU)."""

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import fused_attn
import score_mods as sm
from fused_attn import DotProductAttention, ops
from fused_attn.plan import NO_VARLEN, Varlen
from fused_attn.spec import resolve_spec
from fused_attn.testing import assert_close, grad_tolerances, tolerance
from helpers.attention import band_mask
from helpers.quick import quick_cover

H, HKV, D = 4, 2, 16
#: ten lengths (more than the cache limit of 8); not 0 or 1, which torch.compile always specializes
LENGTHS = (3, 5, 6, 7, 9, 11, 12, 13, 17, 2)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(gen, s, b=2, grad=True):
    return [torch.randn(b, s, h, D, generator=gen).requires_grad_(grad) for h in (H, HKV, HKV)]


def _check_causal(out, q, k, v, cap=None, grad_out=None):
    """out (and q/k/v grads for grad_out) against the float64 reference, causal bshd."""
    lq, lk, lv = (t.detach().transpose(1, 2) for t in (q, k, v))
    mask = band_mask(q.shape[1], k.shape[1], right=0)
    fn = None if cap is None else (lambda s, *_: cap * torch.tanh(s / cap))
    scale = 1 / math.sqrt(D)
    from fused_attn.testing import reference_attention

    want, _ = reference_attention(lq, lk, lv, scale, mask, fn)
    assert_close(out.detach().transpose(1, 2), want, tolerance(lq, lk, lv, scale, torch.float32, mask, fn), "out")
    if grad_out is not None:
        exact, bounds = grad_tolerances(lq, lk, lv, grad_out.transpose(1, 2), scale, torch.float32, mask, fn)
        for name, t, e, bd in zip("qkv", (q, k, v), exact, bounds):
            assert_close(t.grad.transpose(1, 2), e, bd, f"d{name}")


def _one_graph_for_all_lengths(fn, seed: int) -> None:
    """fn(q, k, v) (causal bshd attention) compiled with dynamic=True, fullgraph=True: right on
    every length of LENGTHS, gradients included, from one graph."""
    gen = torch.Generator().manual_seed(seed)
    cc = CompileCounter()
    compiled = torch.compile(fn, backend=cc, fullgraph=True, dynamic=True)
    for s in LENGTHS:
        q, k, v = _qkv(gen, s)
        out = compiled(q, k, v)
        g = torch.randn(out.shape, generator=gen)
        out.backward(g)
        _check_causal(out, q, k, v, grad_out=g)
    assert cc.frame_count == 1


@pytest.mark.slow  # the functional twin and test_module_still_checks_heads_under_compile stay quick
def test_module_one_graph_for_all_lengths_dynamic():
    _one_graph_for_all_lengths(DotProductAttention(H, D, num_gqa_groups=HKV, attn_mask_type="causal",
                                                   backend="reference"), seed=0)


def test_module_still_checks_heads_under_compile():
    attn = DotProductAttention(H, D, backend="reference")
    compiled = torch.compile(attn, fullgraph=True, dynamic=True)
    q = torch.randn(2, 5, H + 1, D)
    with pytest.raises(Exception, match="heads but the module was built with num_attention_heads"):
        compiled(q, q, q)


def test_functional_one_graph_for_all_lengths_dynamic():
    def f(q, k, v):
        return fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", backend="reference")

    _one_graph_for_all_lengths(f, seed=1)


def test_functional_thd_one_graph_dynamic():
    gen = torch.Generator().manual_seed(2)
    cc = CompileCounter()

    def f(q, k, v, cu, m):
        return fused_attn.varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0), enable_gqa=True)

    compiled = torch.compile(f, backend=cc, fullgraph=True, dynamic=True)
    for lens in ((3, 4), (2, 6, 2), (5, 3, 7), (2, 2, 4, 9)):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        t = int(cu[-1])
        q, k, v = (torch.randn(t, h, D, generator=gen) for h in (H, HKV, HKV))
        out = compiled(q, k, v, cu, max(lens))
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if b > a:
                _check_causal(out[a:b].unsqueeze(0), *(x[a:b].unsqueeze(0) for x in (q, k, v)))
    assert cc.frame_count == 1


@pytest.mark.parametrize("dynamic", [True, pytest.param(None, marks=pytest.mark.slow)])
def test_new_score_mod_objects_share_a_graph(dynamic):
    """Ten softcap objects of one structure: one graph (dynamic=True), or the static one plus one
    generalised graph (default); never one per object (fullgraph would fail at the ninth)."""
    gen = torch.Generator().manual_seed(3)
    cc = CompileCounter()

    def f(q, k, v, mod):
        return fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=mod, backend="reference")

    compiled = torch.compile(f, backend=cc, fullgraph=True, dynamic=dynamic)
    attn = DotProductAttention(H, D, num_gqa_groups=HKV, attn_mask_type="causal", backend="reference",
                               score_mod=sm.softcap(0.5))
    compiled_module = torch.compile(attn, backend=cc, fullgraph=True, dynamic=dynamic)
    for i in range(10):
        cap = 1.0 + 0.5 * i
        q, k, v = _qkv(gen, 6, grad=False)
        _check_causal(compiled(q, k, v, sm.softcap(cap)), q, k, v, cap=cap)
        _check_causal(compiled_module(q, k, v, score_mod=sm.softcap(cap)), q, k, v, cap=cap)
        attn.score_mod = sm.softcap(cap)
        _check_causal(compiled_module(q, k, v), q, k, v, cap=cap)
    assert cc.frame_count <= (3 if dynamic else 6)  # f, module override, module attribute


def test_value_change_before_backward_differentiates_the_forward():
    """A compiled module's score_mod value assigned between forward and backward: the backward is
    that of the forward's function (not a cryptic in-place error, not the new value's gradient)."""
    gen = torch.Generator().manual_seed(4)
    attn = DotProductAttention(H, D, num_gqa_groups=HKV, attn_mask_type="causal", backend="reference",
                               score_mod=sm.softcap(2.0))
    compiled = torch.compile(attn, fullgraph=True, dynamic=True)
    q, k, v = _qkv(gen, 7)
    out = compiled(q, k, v)
    attn.score_mod = sm.softcap(5.0)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    _check_causal(out, q, k, v, cap=2.0, grad_out=g)
    q2, k2, v2 = _qkv(gen, 7)
    out2 = compiled(q2, k2, v2)  # and the next call runs the new value
    out2.backward(g)
    _check_causal(out2, q2, k2, v2, cap=5.0, grad_out=g)


def _op_args(fmt, return_lse, mod):
    gen = torch.Generator().manual_seed(5)
    if fmt == "thd":
        cu = torch.tensor([0, 0, 3, 4, 11], dtype=torch.int32)
        qkv = [torch.randn(11, h, D, generator=gen, requires_grad=True) for h in (H, HKV, HKV)]
        varlen = Varlen(cu, cu, None, None, 7, 7)
    else:
        qkv = _qkv(gen, 6)
        varlen = NO_VARLEN
    spec, mod = resolve_spec(qkv_format=fmt, attn_mask_type="causal", score_mod=mod, backend="reference",
                             return_lse=return_lse)
    scalars = ops._scalars(mod)
    return (*qkv, varlen.cu_seqlens_q, varlen.cu_seqlens_kv, None, None, varlen.max_seqlen_q, varlen.max_seqlen_kv,
            None, scalars, [], None, ops.register_spec(spec))


@pytest.mark.parametrize("fmt,return_lse,mod", quick_cover(["bshd", "thd"], [False, True], [None, sm.softcap(3.0)]))
def test_opcheck_every_op_with_and_without_lse(fmt, return_lse, mod):
    args = _op_args(fmt, return_lse, mod)
    torch.library.opcheck(torch.ops.fused_attn.attn_fwd.default, args)
    out, lse, saved = torch.ops.fused_attn.attn_fwd(*args)
    assert (lse.numel() > 0) == return_lse
    bwd = (torch.randn(out.shape), *(t.detach() for t in args[:3]), out.detach(), saved.detach()) + args[3:]
    torch.library.opcheck(torch.ops.fused_attn.attn_bwd.default, bwd)
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("fused_attn::")}
    assert registered == {"attn_fwd", "attn_bwd"}, f"ops without an opcheck here: {registered}"


def test_spec_key_is_structure_only():
    keys = {ops.spec_key(resolve_spec(score_mod=m)[0]) for m in (sm.softcap(10.0), sm.softcap(11.0))}
    keys_t = {ops.spec_key(resolve_spec(score_mod=sm.alibi(torch.randn(H)))[0]) for _ in range(2)}
    assert len(keys) == 1 and len(keys_t) == 1
    assert ops.spec_key(resolve_spec(score_mod=sm.softcap(1.0))[0]) != ops.spec_key(resolve_spec()[0])
