"""The engine contract with a stub second engine plugged in through `fused_attn.engines.register`,
without touching the core: forced, chosen by backend="auto" (eager and compiled), refused with
its reason, explained, and gone again after `unregister`."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

import fused_attn
from fused_attn import engines
from fused_attn.backends import reference
from fused_attn.testing import assert_close, bound_from, reference_attention
from helpers.stub_engines import StubEngineBase


class StubEngine(StubEngineBase):
    """Serves CPU float32 problems with the reference's math, counting its runs."""

    def __init__(self) -> None:
        self.runs = 0

    def refusal(self, problem: Any) -> Optional[str]:
        if problem.dtype != torch.float32:
            return f"the stub engine takes float32, got {problem.dtype}"
        return None

    def make_runner(self, problem: Any) -> Any:
        engine, inner = self, reference.make_runner(problem)

        class Runner:
            backend = "stub"

            def __getattr__(self, name):
                return getattr(inner, name)

            def forward(self, *args, **kwargs):
                engine.runs += 1
                return inner.forward(*args, **kwargs)

        return Runner()

    def traced_refusal(self, device_type, dtype, head_dim, head_dim_v) -> Optional[str]:
        return None if device_type == "cpu" and dtype == torch.float32 else "float32 CPU tensors only"


@pytest.fixture
def stub():
    engine = StubEngine()
    engines.register(engine, before="cudnn")  # first in auto's order
    try:
        yield engine
    finally:
        engines.unregister("stub")


def _qkv(dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, 33, 2, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
            for _ in range(3)]


def _check(out, q, k, v, dtype):
    to = lambda t: t.detach().double().transpose(1, 2)  # noqa: E731
    exact, _ = reference_attention(to(q), to(k), to(v), 16 ** -0.5, dtype=torch.float64)
    same, _ = reference_attention(to(q).to(dtype), to(k).to(dtype), to(v).to(dtype), 16 ** -0.5, dtype=dtype)
    assert_close(out.detach().double().transpose(1, 2), exact, bound_from(same.double(), exact, dtype), "out")


def test_registered_engine_is_chosen_by_auto_and_forced(stub):
    q, k, v = _qkv(grad=True)
    out = fused_attn.dot_product_attention(q, k, v)
    assert stub.runs == 1
    _check(out, q, k, v, torch.float32)
    out.sum().backward()  # the contract's backward (the runner's, through PlanAttention)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    why = fused_attn.explain(q, k, v)
    assert why.backend == "stub" and "stub serves it" in why.reason
    fused_attn.dot_product_attention(q, k, v, backend="stub")
    assert stub.runs == 2


def test_auto_skips_a_refusing_engine_with_its_reason(stub):
    q, k, v = _qkv(torch.float64)
    why = fused_attn.explain(q, k, v)
    assert why.backend != "stub" and "stub cannot serve it: the stub engine takes float32" in why.reason
    with pytest.raises(NotImplementedError, match="backend='stub' cannot run this problem: the stub engine takes"):
        fused_attn.dot_product_attention(q, k, v, backend="stub")
    assert stub.runs == 0


def test_compiled_calls_choose_through_the_same_place(stub):
    q, k, v = _qkv()
    compiled = torch.compile(lambda a, b, c: fused_attn.dot_product_attention(a, b, c), backend="eager",
                             fullgraph=True)
    out = compiled(q, k, v)
    assert stub.runs == 1
    _check(out, q, k, v, torch.float32)


def test_register_checks_and_unregister_restores():
    with pytest.raises(TypeError, match="lacks the Engine attributes"):
        engines.register(object())
    bad = StubEngine()
    bad.name = "auto"
    with pytest.raises(ValueError, match="other than 'auto'"):
        engines.register(bad)
    with pytest.raises(ValueError, match="before='nope' names no engine"):
        engines.register(StubEngine(), before="nope")
    with pytest.raises(ValueError, match="not a registered plug-in engine"):
        engines.unregister("cudnn")
    engines.register(StubEngine())  # default: just before the reference
    assert engines.names()[-2:] == ("stub", "reference")
    engines.unregister("stub")
    assert "stub" not in engines.names()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend='stub'"):
        fused_attn.dot_product_attention(q, k, v, backend="stub")
    assert fused_attn.explain(q, k, v).backend != "stub"


def test_an_engines_own_route_applies_only_where_auto_chooses_that_engine(stub):
    """backend='auto' takes an engine's own way to serve a dense call (cuDNN: rectangles of a
    band) only when that engine is the one auto chooses for the call, the same choice as the
    plain path's plan and explain(): a call auto gives to another engine never takes cuDNN's
    route (it did: a causal + softcap call ran cuDNN's rectangles where auto had chosen FA4)."""
    from score_mods import softcap

    from fused_attn import plan as P
    from fused_attn.spec import resolve_spec
    from fused_attn.static import NO_VARLEN

    routed = []
    stub.route = lambda *args: routed.append(args) or None  # the stub's own way: run the plain plan
    spec, mod = resolve_spec(score_mod=softcap(5.0), attn_mask_type="causal")
    assert spec.may_cut_band
    P.clear_plans()
    for dtype, stub_chosen in ((torch.float32, True), (torch.float64, False)):  # the stub takes float32 only
        q, k, v = _qkv(dtype)
        sig = P.call_signature(spec, q, k, v, NO_VARLEN, mod, None)
        name = P.routed_engine(spec, mod, q, k, v, None, sig)
        assert name == fused_attn.explain(q, k, v, score_mod=softcap(5.0), attn_mask_type="causal").backend
        assert (name == "stub") is stub_chosen
        assert P.ROUTED.peek(sig) == name  # decided once per signature
        before = len(routed)
        assert engines.route(name, spec, mod, q, k, v, None, sig) is None
        assert len(routed) == before + stub_chosen  # the stub's route runs only for the call auto gives it
    forced, _ = resolve_spec(score_mod=softcap(5.0), attn_mask_type="causal", backend="reference")
    q, k, v = _qkv()
    assert P.routed_engine(forced, mod, q, k, v, None, P.call_signature(forced, q, k, v, NO_VARLEN, mod, None)) \
        == "reference"
    P.clear_plans()
    assert len(P.ROUTED) == 0
