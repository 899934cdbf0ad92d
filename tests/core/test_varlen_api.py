"""varlen_attn (torch's varlen signature) against the packed float64 reference (`fused_attn.testing`), on CPU."""

import math

import pytest
import torch

import fused_attn
from fused_attn import AuxRequest, varlen_attn
from fused_attn.testing import assert_close, max_error, packed_tolerances
from helpers.quick import quick_cover
from score_mods.base import ScoreMod


class EagerSoftcap(ScoreMod):
    """A reference-only softcap used to check that score_mod reaches the backend."""

    name = "test_softcap"

    def __init__(self, cap: float):
        self.cap = cap

    @property
    def cache_key(self):
        return ("test_softcap",)

    def scalars(self):
        return {"cap": self.cap}

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return self.cap * torch.tanh(score / self.cap)

    def lower_forward(self, graph, score, operands, memo):  # pragma: no cover - CPU tests only
        raise NotImplementedError


def expected(q, k, v, cu_q, cu_k, window=(-1, -1), scale=None, score_mod=None, grad_out=None):
    """(exact, bounds): a varlen_attn call (flash-style windows, bottom-right per sequence) in float64
    and the project's bounds for q's dtype (`fused_attn.testing.packed_tolerances`)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    fn = None if score_mod is None else (lambda s, b, h, i, j: score_mod.eager(s, b, h, i, j, None, None))
    return packed_tolerances(q, k, v, grad_out, cu_q, cu_k, scale, q.dtype, band=(*window, True), score_fn=fn)


def make(lens_q, lens_k, h=4, hkv=4, d=16, dv=16, dtype=torch.float32, grad=False):
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, h, d, dtype=dtype, requires_grad=grad)
    k = torch.randn(tk, hkv, d, dtype=dtype, requires_grad=grad)
    v = torch.randn(tk, hkv, dv, dtype=dtype, requires_grad=grad)
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k)


LENS = [
    ([5, 9, 1, 16], [5, 9, 1, 16]),
    ([0, 7, 1, 0, 12], [0, 7, 1, 0, 12]),  # zero-length and length-1 sequences
    ([3, 9, 4], [8, 2, 4]),  # q_len != k_len per sequence
]
WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 1), (0, 0), (4, -1)]


@pytest.mark.parametrize("lens,window", quick_cover([(x,) for x in LENS], [(w,) for w in WINDOWS]))
def test_forward_and_lse_match_naive(lens, window):
    q, k, v, cu_q, cu_k = make(*lens)
    out, lse = varlen_attn(
        q, k, v, cu_q, cu_k, max(lens[0]), max(lens[1]), window_size=window, return_aux=AuxRequest(lse=True)
    )
    want, bounds = expected(q, k, v, cu_q, cu_k, window=window)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (q.shape[1], q.shape[0])  # (H, T) like torch's varlen_attn
    assert not torch.isnan(out).any()
    assert_close(out, want["out"], bounds["out"], "out")
    assert_close(lse, want["lse"], bounds["lse"], "lse")


def test_causal_rows_without_keys_are_zero_with_lse_minus_inf():
    # q_len 4 > k_len 2, bottom-right causal: the first two query rows see no key.
    q, k, v, cu_q, cu_k = make([4], [2])
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 4, 2, window_size=(-1, 0), return_aux=AuxRequest(lse=True))
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.isinf(lse[:, :2]).all() and (lse[:, :2] < 0).all()
    assert torch.isfinite(lse[:, 2:]).all()


def test_returns_plain_tensor_without_aux_and_with_lse_false():
    q, k, v, cu_q, cu_k = make([4, 6], [4, 6])
    assert isinstance(varlen_attn(q, k, v, cu_q, cu_k, 6, 6), torch.Tensor)
    assert isinstance(varlen_attn(q, k, v, cu_q, cu_k, 6, 6, return_aux=AuxRequest()), torch.Tensor)


def test_gqa_scale_and_value_dim():
    q, k, v, cu_q, cu_k = make([6, 3, 11], [6, 3, 11], h=6, hkv=2, dv=8)
    out = varlen_attn(q, k, v, cu_q, cu_k, 11, 11, enable_gqa=True, scale=0.3, window_size=(-1, 0))
    want, bounds = expected(q, k, v, cu_q, cu_k, window=(-1, 0), scale=0.3)
    assert out.shape == (20, 6, 8)
    assert_close(out, want["out"], bounds["out"], "out")


@pytest.mark.slow
def test_score_mod_softcap():
    q, k, v, cu_q, cu_k = make([5, 12], [5, 12])
    q = q * 4  # large scores so the cap matters
    sm = EagerSoftcap(2.0)
    out = varlen_attn(q, k, v, cu_q, cu_k, 12, 12, window_size=(-1, 0), score_mod=sm)
    want, bounds = expected(q, k, v, cu_q, cu_k, window=(-1, 0), score_mod=sm)
    plain, _ = expected(q, k, v, cu_q, cu_k, window=(-1, 0))
    assert_close(out, want["out"], bounds["out"], "out")
    assert max_error(plain["out"], want["out"]) > 10 * bounds["out"]  # the modifier changes the answer


@pytest.mark.slow
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0)])
def test_grads_match_naive_autograd(window):
    lens_q = [0, 5, 1, 9]
    lens_k = [3, 5, 1, 9] if window == (-1, -1) else [0, 5, 1, 9]
    q, k, v, cu_q, cu_k = make(lens_q, lens_k, h=4, hkv=2, grad=True)
    out = varlen_attn(q, k, v, cu_q, cu_k, 9, 9, window_size=window, enable_gqa=True)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    want, bounds = expected(q, k, v, cu_q, cu_k, window=window, grad_out=g)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert_close(got, want[name], bounds[name], name)


@pytest.mark.slow
def test_bf16_matches_naive():
    q, k, v, cu_q, cu_k = make([7, 16], [7, 16], dtype=torch.bfloat16)
    out = varlen_attn(q, k, v, cu_q, cu_k, 16, 16, window_size=(-1, 0))
    want, bounds = expected(q, k, v, cu_q, cu_k, window=(-1, 0))  # the bound: bf16 torch math
    assert out.dtype == torch.bfloat16
    assert_close(out, want["out"], bounds["out"], "out")


def test_aux_request_is_frozen_like_torch():
    a = AuxRequest(lse=True)
    assert a.lse and not AuxRequest().lse
    with pytest.raises(AttributeError):
        a.lse = False  # type: ignore[misc]


def test_exported_from_package():
    assert fused_attn.varlen_attn is varlen_attn and fused_attn.AuxRequest is AuxRequest


# ---- errors ------------------------------------------------------------------------------------


def _args():
    return make([4, 6], [4, 6], h=4, hkv=2)


def test_gqa_needs_enable_gqa():
    q, k, v, cu_q, cu_k = _args()
    with pytest.raises(ValueError, match=r"same number of heads, got H_q=4 and H_kv=2.*enable_gqa=True"):
        varlen_attn(q, k, v, cu_q, cu_k, 6, 6)


def test_gqa_heads_not_multiple():
    q, k, v, cu_q, cu_k = make([4], [4], h=4, hkv=3)
    # the phrase of torch's varlen_attn message ("a multiple of kv heads"), plus the head counts
    with pytest.raises(ValueError, match=r"query heads must be a multiple of kv heads, got H_q=4 and H_kv=3"):
        varlen_attn(q, k, v, cu_q, cu_k, 4, 4, enable_gqa=True)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"seqused_k": torch.tensor([4, 6], dtype=torch.int32)}, NotImplementedError, "seqused_k"),
        ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, NotImplementedError, "block_table"),
        ({"num_splits": 1}, NotImplementedError, "num_splits"),
        ({"window_size": (-2, 0)}, ValueError, r"window_size left must be >= -1 \(-1 = unbounded\), got -2"),
        ({"window_size": (1.5, 0)}, TypeError, r"window_size left must be an int >= -1 \(-1 = unbounded\), got 1.5"),
        ({"window_size": (1, 2, 3)}, ValueError, r"window_size must be None or a \(left, right\) pair of ints >= -1, got \(1, 2, 3\)"),
        ({"return_aux": True}, TypeError, "return_aux must be None or AuxRequest"),
    ],
)
def test_argument_errors(kwargs, exc, match):
    q, k, v, cu_q, cu_k = _args()
    with pytest.raises(exc, match=match):
        varlen_attn(q, k, v, cu_q, cu_k, 6, 6, enable_gqa=True, **kwargs)


def test_shape_and_max_errors():
    q, k, v, cu_q, cu_k = _args()
    with pytest.raises(ValueError, match=r"query must have shape \(T, H, D\) \(3 dims\), got shape \(10, 4\)"):
        varlen_attn(q[..., 0], k, v, cu_q, cu_k, 6, 6, enable_gqa=True)
    with pytest.raises(ValueError, match="key and value must agree on"):
        varlen_attn(q, k, v[:3], cu_q, cu_k, 6, 6, enable_gqa=True)
    with pytest.raises(TypeError, match="max_q must be an int, got 6.0"):
        varlen_attn(q, k, v, cu_q, cu_k, 6.0, 6, enable_gqa=True)
    with pytest.raises(ValueError, match="max_k must be >= 0, got -1"):
        varlen_attn(q, k, v, cu_q, cu_k, 6, -1, enable_gqa=True)
    with pytest.raises(NotImplementedError, match="cu_seq_k=None"):
        varlen_attn(q, k, v, cu_q, None, 6, 6, enable_gqa=True)
    with pytest.raises(TypeError, match="cu_seq_q must be an"):
        varlen_attn(q, k, v, [0, 4, 10], cu_k, 6, 6, enable_gqa=True)


def test_argument_checks_run_once_per_call_configuration(monkeypatch):
    """A model's layers repeat one call: its argument checks run once per configuration (shapes,
    max lengths, window, scale, lse, score_mod); values equal to cached ones but of other types
    are still refused, and new cu_seqlens tensors need no new check (their values are checked
    per call)."""
    from fused_attn import varlen as vl

    calls = []
    real = vl._check_heads
    monkeypatch.setattr(vl, "_check_heads", lambda *a: (calls.append(1), real(*a))[1])
    q, k, v, cu_q, cu_k = make([4, 6], [5, 6])
    first = varlen_attn(q, k, v, cu_q, cu_k, 6, 6, window_size=(2, 0), scale=0.3)
    again = varlen_attn(q, k, v, cu_q.clone(), cu_k.clone(), 6, 6, window_size=(2, 0), scale=0.3)
    assert len(calls) == 1 and torch.equal(first, again)
    want, bounds = expected(q, k, v, cu_q, cu_k, window=(2, 0), scale=0.3)
    assert_close(first, want["out"], bounds["out"], "out")
    varlen_attn(q, k, v, cu_q, cu_k, 6, 6, window_size=(2, 0), scale=0.3, return_aux=AuxRequest(lse=True))
    assert len(calls) == 2  # another configuration
    with pytest.raises(TypeError, match="max_q must be an int, got True"):
        varlen_attn(q, k, v, cu_q, cu_k, True, 6, window_size=(2, 0), scale=0.3)
    with pytest.raises(TypeError, match="window_size left must be an int"):
        varlen_attn(q, k, v, cu_q, cu_k, 6, 6, window_size=(2.0, 0), scale=0.3)
    with pytest.raises(TypeError, match="enable_gqa must be a bool"):
        varlen_attn(q, k, v, cu_q, cu_k, 6, 6, enable_gqa=0)
    with pytest.raises(ValueError, match="max_q must be >= 0, got -1"):
        varlen_attn(q, k, v, cu_q, cu_k, -1, 6)


# ----------------------------------------------------------------------------- varlen_attn_out

@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 1)])
def test_varlen_attn_out_writes_the_result_into_out(window):
    lens = ([3, 9, 4], [8, 2, 4])
    q, k, v, cu_q, cu_k = make(*lens, dv=8)
    out = torch.full((q.shape[0], q.shape[1], 8), float("nan"))  # every element must be written
    got, lse = fused_attn.varlen_attn_out(out, q, k, v, cu_q, cu_k, 9, 8, window_size=window,
                                          return_aux=AuxRequest(lse=True))
    assert got is out
    want, bounds = expected(q, k, v, cu_q, cu_k, window=window)
    assert_close(out, want["out"], bounds["out"], "out")
    assert_close(lse, want["lse"], bounds["lse"], "lse")
    assert fused_attn.varlen_attn_out(out, q, k, v, cu_q, cu_k, 9, 8, window_size=window) is out


def test_varlen_attn_out_may_alias_the_query():
    q, k, v, cu_q, cu_k = make([5, 7], [5, 7])
    want = varlen_attn(q, k, v, cu_q, cu_k, 7, 7, window_size=(-1, 0))
    got = fused_attn.varlen_attn_out(q, q, k, v, cu_q, cu_k, 7, 7, window_size=(-1, 0))
    assert got is q and torch.equal(q, want)


def test_varlen_attn_out_errors():
    q, k, v, cu_q, cu_k = make([4, 6], [4, 6])
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        fused_attn.varlen_attn_out(None, q, k, v, cu_q, cu_k, 6, 6)
    for bad in (torch.empty(10, 4, 8), torch.empty(10, 4, 16, dtype=torch.float64)):
        with pytest.raises(ValueError, match=r"out must be a \(10, 4, 16\) torch.float32 tensor"):
            fused_attn.varlen_attn_out(bad, q, k, v, cu_q, cu_k, 6, 6)
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="records no backward"):
        fused_attn.varlen_attn_out(torch.empty_like(q), qg, k, v, cu_q, cu_k, 6, 6)
    with torch.no_grad():
        fused_attn.varlen_attn_out(torch.empty_like(q), qg, k, v, cu_q, cu_k, 6, 6)
