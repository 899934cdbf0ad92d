"""A training call split across engines on the GPU: FA4's forward, cuDNN's backward from FA4's
output and lse (`engines.choose` pairs them where the measured table says so; a stub table
forces the pair here). Every case against the float64 reference, out and gradients, with the
project's rule (`fused_attn.testing.bound_from`). Skipped where flash-attn-4, cuDNN or a sm90 /
sm100 GPU is missing."""

from __future__ import annotations

import pytest
import torch

import score_mods as sm

pytestmark = pytest.mark.gpu

fused_attn = pytest.importorskip("fused_attn")
from fused_attn import engine_speed, engines, testing  # noqa: E402
from fused_attn import plan as P  # noqa: E402
from helpers.attention import cu_seqlens  # noqa: E402
from helpers.fa4_gpu_cases import dense_inputs, rand, run  # noqa: E402

if not torch.cuda.is_available() or not engines.available("fa4") or not engines.available("cudnn"):
    pytest.skip("needs a CUDA GPU, flash-attn-4 and cuDNN", allow_module_level=True)
if torch.cuda.get_device_capability()[0] not in (9, 10):
    pytest.skip("the FA4 engine runs on sm90 / sm100", allow_module_level=True)

DEV = torch.device("cuda")
DT = torch.bfloat16


class _PairTable(dict):
    """Every family: FA4's forward cheapest, cuDNN's backward cheapest (0.1 + 0.2 ms a pair
    against 0.7 ms for cuDNN alone)."""

    def get(self, family, default=None):
        return [engine_speed.Measured(1024, "fa4", 0.1, 1.0), engine_speed.Measured(1024, "cudnn", 0.5, 0.7)]


@pytest.fixture(autouse=True)
def pair_table(monkeypatch):
    monkeypatch.setattr(engine_speed, "table", lambda arch: _PairTable())
    P.clear_plans()
    yield
    P.clear_plans()


def _rand(*shape, seed):
    return rand(DEV, *shape, seed=seed)


def check(name, q, k, v, dout, **kw):
    """auto (split) vs the float64 reference; the bf16 reference sets the bounds. Two auto calls
    on other values first: FA4 compiles, then records its forward (the checked call replays it)."""
    leaves = [t.to(DT).requires_grad_(True) for t in (q, k, v)]
    why = fused_attn.explain(*leaves, **kw)
    assert (why.backend, why.backward_backend) == ("fa4", "cudnn"), f"{name}: {why.reason}"
    exact = run("reference", torch.float64, q, k, v, dout, **kw)
    same = run("reference", DT, q, k, v, dout, **kw)
    run("auto", DT, q.flip(-1), k, -v, dout, **kw)
    run("auto", DT, -q, v, k, dout, **kw)
    got = run("auto", DT, q, k, v, dout, **kw)
    testing.assert_close(got[0].float(), exact[0], testing.bound_from(same[0], exact[0], DT), f"{name} out")
    for what, g, e, s in zip(("dq", "dk", "dv"), got[2], exact[2], same[2]):
        assert g is not None and torch.isfinite(g).all(), f"{name} {what}: missing or non-finite"
        testing.assert_close(g.double(), e, testing.bound_from(s, e, DT), f"{name} {what}")


DENSE = {
    "causal_softcap_gqa": dict(attn_mask_type="causal", score_mod=sm.softcap(30.0), hkv=2),
    "window_softcap_gqa": dict(attn_mask_type="causal", window_size=(64, 0), score_mod=sm.softcap(50.0), hkv=2),
    "causal": dict(attn_mask_type="causal"),
    "plain_d128": dict(d=128),
    "causal_bottom_right_sq_lt_skv": dict(attn_mask_type="causal_bottom_right", sq=96),
}


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("case", list(DENSE))
def test_fa4_forward_cudnn_backward_matches_reference(case, fmt):
    q, k, v, dout, kw = dense_inputs(DEV, DENSE[case], fmt)
    check(f"{case} {fmt}", q, k, v, dout, qkv_format=fmt, **kw)


def _cu(lens):
    return cu_seqlens(lens).to(DEV)


@pytest.mark.parametrize("kind", ["causal", "window_softcap_gqa"])
def test_thd_split_matches_reference(kind):
    lens = [5, 130, 64, 257]
    cu, t, h = _cu(lens), sum(lens), 4
    hkv = 2 if kind == "window_softcap_gqa" else h
    q, dout = _rand(t, h, 64, seed=1), _rand(t, h, 64, seed=4)
    k, v = _rand(t, hkv, 64, seed=2), _rand(t, hkv, 64, seed=3)
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens),
              attn_mask_type="padding_causal")
    if kind == "window_softcap_gqa":
        kw.update(window_size=(64, 0), score_mod=sm.softcap(50.0))
    check(f"thd {kind}", q, k, v, dout, **kw)


def test_thd_split_with_other_key_lengths_matches_reference():
    """Separate query and key lengths: the split clears lse -inf rows before cuDNN's backward."""
    lens_q, lens_kv = [40, 130, 64], [70, 100, 64]
    cq, ck = _cu(lens_q), _cu(lens_kv)
    q, dout = _rand(sum(lens_q), 4, 64, seed=1), _rand(sum(lens_q), 4, 64, seed=4)
    k, v = _rand(sum(lens_kv), 4, 64, seed=2), _rand(sum(lens_kv), 4, 64, seed=3)
    check("thd cross", q, k, v, dout, qkv_format="thd", cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=130,
          max_seqlen_kv=100, attn_mask_type="padding")
