"""backend="auto" splitting a training call: the forward on one engine, the backward on another,
where the measured table says the pair beats every single engine (`engine_speed.split`,
`engines.choose`, `split_runner.SplitRunner`). Two stub engines on the reference's math stand in
for FA4 (forward half) and cuDNN (backward half); the table is a stub too."""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn import engine_speed, engines
from fused_attn import plan as P
from fused_attn.backends import reference
from fused_attn.testing import agreement_bound, assert_attention_close, assert_close
from helpers.attention import band_mask, cu_seqlens
from helpers.grad_ownership import note_returned_grads
from helpers.stub_engines import StubEngineBase


class HalfEngine(StubEngineBase):
    """A CPU engine on the reference's math that counts which of its runners' halves ran."""

    def __init__(self, name: str, halves: Tuple[str, ...]) -> None:
        self.name, self.split_halves = name, halves
        self.ran = {"forward": 0, "backward": 0, "backward_with_lse": 0}

    def make_runner(self, problem: Any) -> Any:
        engine, inner = self, reference.make_runner(problem)

        class Runner:
            backend = engine.name

            def grad_inputs(self, mod, sinks):
                return inner.grad_inputs(mod, sinks)

            def op_grads(self, mod, sinks, grads):
                return inner.op_grads(mod, sinks, grads)

            def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=(), dest=None):
                engine.ran["forward"] += 1
                out, lse, saved, state = inner.forward(q, k, v, varlen, mod, sinks, rng, extras, dest)
                return out, lse, saved + (out, lse), state

            def forward_lse(self, saved):
                return saved[-1]

            def backward(self, state, saved, grad_out):
                engine.ran["backward"] += 1
                return inner.backward(state, saved[:-2], grad_out)

            def backward_with_lse(self, *args, **kwargs):
                engine.ran["backward_with_lse"] += 1
                engine.lse_seen = args[4]
                return inner.backward_with_lse(*args, **kwargs)

        return Runner()


@pytest.fixture
def pair(monkeypatch):
    """fwd: fast forward, slow backward; bwd: the reverse. The table: fwd 0.2 + bwd's 0.5 = 0.7
    per training call against 1.0 for the best single engine."""
    fwd, bwd = HalfEngine("fwd", ("forward",)), HalfEngine("bwd", ("backward",))
    engines.register(fwd, before="cudnn")
    engines.register(bwd, before="cudnn")
    rows = {"fwd": (0.2, 1.2), "bwd": (0.5, 1.0)}
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(engine_speed, "table", lambda arch: _Rows(rows))
    P.clear_plans()
    try:
        yield fwd, bwd, rows
    finally:
        engines.unregister("fwd")
        engines.unregister("bwd")
        P.clear_plans()


class _Rows(dict):
    """Every family has the same rows (engine -> (fwd ms, fwd+bwd ms)) at S=64."""

    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def get(self, family, default=None):
        return [engine_speed.Measured(64, e, f, fb) for e, (f, fb) in self.rows.items()]


def _qkv(dtype=torch.float64, grad=True, s=64):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(2, s, 4, 16, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad) for _ in range(3)]


def _reference(q, k, v, grad_out, **kw):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fused_attn.dot_product_attention(*leaves, backend="reference", **kw)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def test_the_pair_runs_the_forward_on_one_engine_and_the_backward_on_the_other(pair):
    fwd, bwd, _ = pair
    q, k, v = _qkv(torch.float32)
    why = fused_attn.explain(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(20.0))
    assert (why.backend, why.backward_backend) == ("fwd", "bwd")
    assert "fwd serves the forward and bwd the backward" in why.reason
    assert "0.200 ms + bwd's backward 0.500 ms = 0.700 ms" in why.reason and "1.000 ms for bwd alone" in why.reason
    out = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(20.0))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    assert (fwd.ran["forward"], fwd.ran["backward"], bwd.ran["forward"]) == (1, 0, 0)
    assert bwd.ran["backward_with_lse"] == 1
    logical = lambda t: t.detach().transpose(1, 2)  # noqa: E731
    cap = lambda s, b, h, i, j: 20.0 * torch.tanh(s / 20.0)  # noqa: E731
    assert_attention_close(logical(out), logical(q), logical(k), logical(v), 16 ** -0.5,
                           mask=band_mask(64, 64, right=0), score_fn=cap,
                           grads=[logical(t.grad) for t in (q, k, v)], grad_out=logical(grad_out), what="split ")


def test_no_split_without_a_clear_gain_or_where_the_backward_is_more_than_q_k_v(pair):
    fwd, bwd, rows = pair
    q, k, v = _qkv()
    rows["fwd"] = (0.48, 1.2)  # the pair's 0.48 + 0.5 is within WALL_TIE of bwd's 1.0 alone
    P.clear_plans()
    why = fused_attn.explain(q, k, v)
    assert why.backend == why.backward_backend == "bwd" and "serves the forward" not in why.reason
    rows["fwd"] = (0.2, 1.2)
    P.clear_plans()
    for kw in (dict(softmax_type="learnable", sinks=torch.randn(4, dtype=torch.float64, requires_grad=True)),
               dict(score_mod=sm.alibi(torch.rand(4, dtype=torch.float64)))):
        why = fused_attn.explain(q, k, v, **kw)
        assert why.backend == why.backward_backend, kw  # sinks / score_mod tensors: one engine
    assert fused_attn.explain(q, k, v, backend="fwd").backward_backend == "fwd"
    with torch.no_grad():
        why = fused_attn.explain(q, k, v)
    assert why.backend == why.backward_backend == "fwd"  # no backward: the forward column alone


def test_rows_without_a_key_weigh_nothing_in_the_other_engines_backward(pair):
    """thd whose key lengths differ from the query lengths (one sequence has no key): the forward
    engine's lse is -inf on those rows; the split hands the backward +inf there, so the
    reference's backward (which would read exp(s - -inf) = inf) gives their exact zero."""
    fwd, bwd, _ = pair
    g = torch.Generator().manual_seed(5)
    cq, ck = cu_seqlens([5, 7, 4]), cu_seqlens([6, 0, 9])
    q = torch.randn(16, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(15, 4, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kw = dict(qkv_format="thd", cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=7, max_seqlen_kv=9)
    why = fused_attn.explain(q, k, v, **kw)
    assert (why.backend, why.backward_backend) == ("fwd", "bwd")
    out = fused_attn.dot_product_attention(q, k, v, **kw)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    want_out, want = _reference(q, k, v, grad_out, **kw)
    assert bwd.ran["backward_with_lse"] == 1
    seen = bwd.lse_seen  # (H, Tq): the second sequence's 7 query rows have no key
    assert torch.isposinf(seen[:, 5:12]).all() and torch.isfinite(seen[:, :5]).all() and torch.isfinite(seen[:, 12:]).all()
    assert_close(out, want_out, agreement_bound(want_out), "out")
    for name, got, w in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want):
        assert torch.isfinite(got).all(), name
        # the halves meet in the contract's fp32 lse: float64 inputs, float32's rounding
        assert_close(got, w, agreement_bound(w, torch.float32), name)


def test_which_problems_may_have_rows_without_a_key():
    base = P._static_problem(*_spec_and_mod(), *_qkv(grad=False), P.NO_VARLEN, None)
    assert not engines._may_have_empty_rows(base)
    causal = dataclasses.replace(base, spec=dataclasses.replace(base.spec, band=fused_attn.problem.Band(None, 0, True)))
    assert not engines._may_have_empty_rows(causal)
    assert engines._may_have_empty_rows(dataclasses.replace(causal, seqlen_q=32))  # bottom-right, Sq < Skv
    shifted = dataclasses.replace(base.spec, band=fused_attn.problem.Band(4, -1, False))
    assert engines._may_have_empty_rows(dataclasses.replace(base, spec=shifted))  # the diagonal left out
    spec, mod = _spec_and_mod(score_mod=sm.softcap(3.0))
    assert not engines._may_have_empty_rows(dataclasses.replace(base, spec=spec))
    spec, mod = _spec_and_mod(score_mod=sm.document_mask(torch.zeros(64, dtype=torch.int64)))
    assert engines._may_have_empty_rows(dataclasses.replace(base, spec=spec))  # any other mod may mask a row


def _spec_and_mod(**kw):
    from fused_attn.spec import resolve_spec

    return resolve_spec(**kw)


def test_split_picks_the_cheapest_pair_and_says_so(monkeypatch):
    problem = P._static_problem(*_spec_and_mod(), *_qkv(), P.NO_VARLEN, None)
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")
    rows = {"a": (0.2, 1.3), "b": (0.4, 1.0), "c": (0.3, 0.8)}
    monkeypatch.setattr(engine_speed, "table", lambda arch: _Rows(rows))
    got = engine_speed.split(problem, ["a", "b", "c"], ["b", "c"], ["a", "b", "c", "reference"])
    assert (got.forward, got.backward) == ("a", "c")  # 0.2 + 0.5 against c's 0.8 alone
    assert "0.700 ms per fwd+bwd against 0.800 ms for c alone" in got.reason
    assert engine_speed.split(problem, ["a"], ["a"], ["a", "b", "c"]) is None  # a pair needs two engines
    assert engine_speed.split(dataclasses.replace(problem, needs_grad=False), ["a"], ["c"], ["a", "c"]) is None


def test_a_measured_pair_row_prices_the_pair(monkeypatch):
    """Where the table has the pair's own row (what bench engines timed when auto ran it), that
    row decides: faster than the best single engine by more than WALL_TIE, the pair runs;
    slower, it does not, whatever the estimate from the single engines' rows says."""
    problem = P._static_problem(*_spec_and_mod(), *_qkv(), P.NO_VARLEN, None)
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")
    rows = {"a": (0.2, 1.3), "c": (0.3, 0.8), "a+c": (0.2, 0.74)}
    monkeypatch.setattr(engine_speed, "table", lambda arch: _Rows(rows))
    got = engine_speed.split(problem, ["a"], ["c"], ["a", "c"])
    assert (got.forward, got.backward) == ("a", "c")
    assert "a + c measured as a pair near S=64: 0.740 ms per fwd+bwd against 0.800 ms for c alone" in got.reason
    rows["a+c"] = (0.2, 0.9)  # the estimate says 0.7; the pair measured 0.9
    assert engine_speed.split(problem, ["a"], ["c"], ["a", "c"]) is None


def test_the_backward_from_a_given_lse_shares_its_two_steps():
    """fused_attn.lse_backward, used by every runner's backward_with_lse and the split: -inf rows
    become +inf (weight 0), and dK / dV land in caller-owned views when given."""
    from fused_attn.lse_backward import into_dest, weightless_empty_rows

    lse = torch.tensor([[1.5, float("-inf"), -3.0]])
    assert torch.equal(weightless_empty_rows(lse), torch.tensor([[1.5, float("inf"), -3.0]]))
    grads = (torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0), torch.full((1,), 4.0))
    assert into_dest(grads, None) is grads
    dk, dv = torch.zeros(2), torch.zeros(2)
    got = into_dest(grads, (None, dk, dv))
    assert got[1] is dk and got[2] is dv and torch.equal(dk, grads[1]) and torch.equal(dv, grads[2])
    assert got[0] is grads[0] and got[3] is grads[3]


def test_a_split_calls_gradients_are_the_backward_engines_own_tensors(pair, monkeypatch):
    """autograd takes them as .grad without a copy (nothing else holds them), step after step."""
    returned = note_returned_grads(monkeypatch)
    for step in range(3):
        q, k, v = _qkv(torch.float32)
        out = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal")
        out.backward(torch.randn_like(out))
        assert [t.grad.data_ptr() for t in (q, k, v)] == returned[-1], f"step {step}"
    assert pair[1].ran["backward_with_lse"] == 3
