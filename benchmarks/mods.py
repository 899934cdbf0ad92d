"""score_mod benchmark: fused_attn score_mods vs compiled flex_attention, and causal via a
score_mod vs cuDNN's own causal mask. B=2 H=16 S=4096 D=128 bf16, forward and forward + backward.

Also checks that changing a softcap value reuses the cached graphs (cache_info().builds delta 0)
and that the new value takes effect (result checked against the reference).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from .common import Impl, attn_flops, check_impl, naive_attention, reference_and_bounds, worst_error
from .runner import SuiteResult, run_config

B, H, S, D = 2, 16, 4096, 128
#: T5's head dim (d_kv of t5-small / base / large): the T5 case also runs at it
T5_HEAD_DIM = 64
REF_SCORES = 1 << 28
_FLEX = {}


def _compiled_flex() -> Callable:
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def alibi_slope_values(heads: int, device: torch.device) -> torch.Tensor:
    """The usual ALiBi slopes 2^(-8 (i+1) / H), i = 0..H-1, fp32 (H,)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)


class ModCase:
    """One modifier: fused_attn variants (impl name -> call kwargs), a flex score_mod / block mask,
    and the reference's score_fn and/or causal mask."""

    def __init__(self, name: str, fused_kwargs: Callable[[], Dict], score_fn: Optional[Callable] = None,
                 causal: bool = False, flex_score: Optional[Callable] = None, flex_causal: bool = False,
                 mask_fn: Optional[Callable] = None, flex_mask: Optional[Callable] = None, note: str = "",
                 trained: Optional[Dict[str, torch.Tensor]] = None, trained_score: Optional[Callable] = None,
                 trained_head_dim: int = 1):
        self.name, self.fused_kwargs, self.score_fn, self.causal = name, fused_kwargs, score_fn, causal
        self.flex_score, self.flex_causal = flex_score, flex_causal
        self.mask_fn = mask_fn  # (b, h, q_idx, kv_idx) -> bool: the reference's mask
        self.flex_mask = flex_mask or mask_fn  # flex's mask_mod (its block mask), as a flex user writes it
        self.note = note
        # trained: name -> leaf whose gradient is timed and checked too ("d<name>"), its heads on dim
        # trained_head_dim ((1, H, S, S) bias: 1; (H, buckets) table: 0); trained_score(params): the
        # reference's score_fn reading the reference's copies of them
        self.trained, self.trained_score = trained or {}, trained_score
        self.trained_head_dim = trained_head_dim

    def trained_heads(self, t: torch.Tensor, hs: int) -> torch.Tensor:
        """A trained leaf's first hs heads (the slice the reference checks)."""
        return t.narrow(self.trained_head_dim, 0, hs)


def cases(device: torch.device, b: int, h: int, s: int) -> List[ModCase]:
    """softcap(30) alone, causal and windowed, causal (score_mod and native), post_scale_bias (fixed
    and trained), alibi, T5's trained relative-position table, and NATTEN 2-D when S is a square (a
    mask score_mod on cuDNN vs flex_attention with the same mask as a block mask)."""
    from score_mods.gym import relative_position_bias
    from score_mods.library import alibi, causal, post_scale_bias, softcap

    cap = 30.0
    window = max(1, s // 4)  # Gemma 2's local layers see a window of half its context (4096 of 8192)
    gen = torch.Generator(device=device).manual_seed(1234)
    bias = torch.randn(1, h, s, s, device=device, dtype=torch.float32, generator=gen)
    trained = {dt: bias.to(dt).requires_grad_() for dt in (torch.float32, torch.bfloat16)}
    slopes = alibi_slope_values(h, device)
    t5_table = torch.randn(h, 32, device=device, generator=gen).requires_grad_()
    t5 = lambda table: relative_position_bias(table, 128)
    capped = lambda sc, b_, h_, q, k: cap * torch.tanh(sc / cap)
    biased = _bias_score(bias)
    alibied = lambda sc, b_, h_, q, k: sc + slopes[h_] * (k - q).to(sc.dtype)
    side = math.isqrt(s)
    natten_cases = []
    if side * side == s and side >= 3:  # NATTEN 2-D on a side x side image, a 13 x 13 (or 3 x 3) kernel
        from score_mods.gym import _neighbours, natten

        kernel = 13 if side >= 13 else 3
        mod = natten(side, side, kernel, kernel)

        def natten_mask_mod(b_, h_, q, k):  # attention-gym's NATTEN mask_mod in plain torch (square canvas)
            return _neighbours(q // side, q % side, k // side, k % side, side, side, kernel, kernel)

        natten_cases.append(ModCase(
            f"natten 2-D {side}x{side} k{kernel}x{kernel}", lambda: {"fused_attn": {"score_mod": mod}},
            mask_fn=mod.to_flex_mask(), flex_mask=natten_mask_mod,
            note=f"{kernel * kernel}/{s} keys per query; flex skips empty tiles (block mask), cuDNN computes all "
                 "tiles; tflops: dense-equivalent"))
    return [
        ModCase("softcap(30)", lambda: {"fused_attn": {"score_mod": softcap(cap)}}, capped, flex_score=capped),
        ModCase("softcap(30) + causal (Gemma 2)", lambda: {"fused_attn": {"score_mod": softcap(cap),
                                                                         "attn_mask_type": "causal"}},
                capped, causal=True, flex_score=capped, flex_causal=True,
                note="cuDNN declines its band next to a score_mod: a select in the callback, the whole square "
                     "computed, unless rectangles of the band are estimated faster (band_chunks.strategy)"),
        ModCase(f"softcap(30) + window {window} (Gemma 2 local)",
                lambda: {"fused_attn": {"score_mod": softcap(cap), "attn_mask_type": "causal",
                                        "window_size": (window - 1, 0)}},
                capped, flex_score=capped, mask_fn=lambda b_, h_, q, k: (q >= k) & (q - k < window),
                note="cuDNN declines its band next to a score_mod: the whole square unless rectangles of the "
                     "band are estimated faster (band_chunks.strategy); flex skips the tiles outside the window "
                     "(block mask); tflops: dense-equivalent"),
        ModCase("causal", lambda: {"fused_attn_scoremod": {"score_mod": causal()},
                                   "fused_attn_native": {"attn_mask_type": "causal"}}, causal=True, flex_causal=True),
        ModCase("post_scale_bias", lambda: {"fused_attn": {"score_mod": post_scale_bias(bias)}}, biased,
                flex_score=biased, note="a fixed fp32 bias (no gradient)"),
    ] + [
        ModCase(f"post_scale_bias {str(dt).replace('torch.', '')} trained",
                lambda t=t: {"fused_attn": {"score_mod": post_scale_bias(t)}},
                flex_score=_bias_score(t), trained={"bias": t},
                trained_score=lambda p: _bias_score(p["bias"]),
                note="the bias (1, H, S, S) requires grad: fwd+bwd times and checks its gradient too (summed over "
                     "the batch), on every batch row and the first heads with B * heads * S^2 <= 2^28")
        for dt, t in trained.items()
    ] + [
        ModCase("alibi", lambda: {"fused_attn": {"score_mod": alibi(slopes)}}, alibied, flex_score=alibied),
        ModCase("T5 relative_position_bias trained", lambda: {"fused_attn": {"score_mod": t5(t5_table)}},
                flex_score=t5(t5_table).to_flex(), trained={"table": t5_table}, trained_head_dim=0,
                trained_score=lambda p: t5(p["table"]).to_flex(),
                note="T5's learned fp32 (H, 32) table (bidirectional buckets, max_distance 128) requires grad: "
                     "fwd+bwd times and checks its gradient too; cuDNN reads it as a materialized (1, H, S, S) "
                     "bias, flex through its captured-buffer gradient"),
    ] + natten_cases


def _bias_score(bias: torch.Tensor) -> Callable:
    """A flex score_mod adding bias[0, h, q, k] (a closure: flex tells score_mods by their arity)."""
    return lambda sc, b_, h_, q, k: sc + bias[0, h_, q, k]


def _dense_mask(mask_fn: Callable, s: int, device: torch.device) -> torch.Tensor:
    """(S, S) bool of a mask_mod evaluated on every (q_idx, kv_idx)."""
    idx = torch.arange(s, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return torch.as_tensor(mask_fn(zero, zero, idx.view(-1, 1), idx.view(1, -1))).expand(s, s)


def _fused_fn(kwargs: Dict, backend: str) -> Callable:
    import fused_attn

    return lambda q, k, v: fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend=backend, **kwargs)


def _flex_fn(case: ModCase, device: torch.device, b: int, s: int) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled_flex()
    block_mask = None
    if case.flex_causal:
        block_mask = create_block_mask(lambda b_, h_, q, k: q >= k, b, None, s, s, device=device)
    elif case.flex_mask is not None:
        block_mask = create_block_mask(case.flex_mask, b, None, s, s, device=device)

    def fn(q, k, v):
        o = flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=case.flex_score,
                 block_mask=block_mask)
        return o.transpose(1, 2)

    return fn


def _impl(name: str, fn: Callable, q, k, v, do, required: bool, trained: Optional[Dict] = None) -> Impl:
    """The timed calls and checked outputs of one implementation; trained: name -> leaf whose
    gradient the backward computes too (output "d<name>")."""
    extra = dict(trained or {})
    wrt = (q, k, v) + tuple(extra.values())

    def outputs():
        out = fn(q, k, v)
        dq, dk, dv, *dp = torch.autograd.grad(out, wrt, do)
        return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv, **{f"d{n}": g for n, g in zip(extra, dp)}}

    return Impl(name, lambda: fn(q, k, v), lambda: torch.autograd.grad(fn(q, k, v), wrt, do), outputs,
                required=required)


def _checked_heads(case: ModCase, b: int, h: int, s: int) -> int:
    """Heads [0, hs) the reference checks: batch 0 only, or every batch row when a bias is trained
    (its gradient is summed over the batch)."""
    rows = b if case.trained else 1
    return max(1, min(h, REF_SCORES // (rows * s * s)))


def _select(case: ModCase, hs: int) -> Callable:
    """The checked slice of an output in BSHD (a trained leaf: its first hs heads)."""
    if case.trained:
        return lambda key, t: case.trained_heads(t, hs) if key[1:] in case.trained else t[:, :, :hs]
    return lambda key, t: t[:1, :, :hs]


def _reference(q, k, v, do, case: ModCase, hs: int, dtype) -> Dict[str, torch.Tensor]:
    """Naive out, dq, dk, dv (and the trained tables' gradients) in `dtype` on the checked slice
    (`_checked_heads`), in BSHD."""
    rows = q.shape[0] if case.trained else 1
    sl = [t.detach()[:rows, :, :hs].transpose(1, 2) for t in (q, k, v, do)]
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril() if case.causal else None
    if case.mask_fn is not None:
        mask = _dense_mask(case.mask_fn, s, q.device)
    params = {n: case.trained_heads(t.detach(), hs).to(dtype).requires_grad_() for n, t in case.trained.items()}
    score_fn = case.trained_score(params) if case.trained else case.score_fn
    res = naive_attention(*sl[:3], scale=1 / math.sqrt(q.shape[-1]), dtype=dtype, mask=mask,
                          score_fn=score_fn, grad_out=sl[3], params=params)
    return {key: (t if key[1:] in params else t.transpose(1, 2)) for key, t in res.items()}


def _inputs(device, b, h, s, d, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    ts = [torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    return [t.requires_grad_() for t in ts[:3]] + [ts[3]]


def _softcap_rebuild_check(q, k, v, do, hs, backend, select) -> SuiteResult:
    """Change softcap 30 -> 20: graphs must be reused (builds delta 0) and the new value applied."""
    import fused_attn
    from score_mods.library import softcap

    result = SuiteResult()
    _impl("warm", _fused_fn({"score_mod": softcap(30.0)}, backend), q, k, v, do, True).outputs()
    before = fused_attn.graph_cache.cache_info().builds
    cap = 20.0
    case = ModCase("softcap(20)", None, lambda sc, b_, h_, qi, ki: cap * torch.tanh(sc / cap))
    impl = _impl("fused_attn", _fused_fn({"score_mod": softcap(cap)}, backend), q, k, v, do, True)
    expected, bounds = reference_and_bounds(lambda dt: _reference(q, k, v, do, case, hs, dt), q.dtype)
    note = ""
    try:
        errs = check_impl(impl, expected, bounds, select)
    except Exception as exc:
        errs, note = {}, f"FAILED: {type(exc).__name__}: {exc}"
        result.failures.append(f"mods / softcap 30 -> 20: {note}")
    delta = fused_attn.graph_cache.cache_info().builds - before
    if delta != 0:
        result.failures.append(f"mods / softcap 30 -> 20: {delta} graph builds after a softcap value change (want 0)")
    worst, err, bound = worst_error(errs, bounds)
    result.rows.append({"suite": "mods", "config": "softcap 30 -> 20 (fwd+bwd)", "mode": "rebuild",
                        "impl": "fused_attn", "builds_delta": delta, "max_err": err, "bound": bound, "worst": worst,
                        "note": note})
    return result


def run(quick: bool, device: torch.device, *, shape=(B, H, S, D), with_flex: bool = True) -> SuiteResult:
    """All modifier cases at `shape` = (B, H, S, D) on `device` (CPU: reference backend, no flex)."""
    b, h, s, d = shape
    backend = "cudnn" if device.type == "cuda" else "reference"
    with_flex = with_flex and device.type == "cuda"
    q, k, v, do = _inputs(device, b, h, s, d, seed=7)
    hs = max(1, min(h, REF_SCORES // (s * s)))
    select = lambda key, t: t[:1, :, :hs]
    result = SuiteResult(notes=["fused_attn: dot_product_attention(backend='cudnn'); flex: "
                                "torch.compile(flex_attention) with a hand-written score_mod (causal: block mask)",
                                "checked against the float64 reference on batch 0, heads [0, hs) with "
                                "hs * S^2 <= 2^28 (all heads at S=4096)"])
    t5_cases = []
    for case in cases(device, b, h, s):
        _run_case(result, case, (q, k, v, do), backend, with_flex, quick)
        if case.name.startswith("T5"):
            t5_cases.append(case)
    if d != T5_HEAD_DIM:  # T5's own head dim (d_kv 64), where compiled flex also builds the table's gradient
        inputs = _inputs(device, b, h, s, T5_HEAD_DIM, seed=7)
        for case in t5_cases:
            _run_case(result, case, inputs, backend, with_flex, quick)
        del inputs
    result.extend(_softcap_rebuild_check(q, k, v, do, hs, backend, select))
    return result


def _run_case(result: SuiteResult, case: ModCase, inputs: tuple, backend: str, with_flex: bool, quick: bool) -> None:
    """One case's rows (fused_attn, and compiled flex where it has a score_mod) on `inputs`
    (q, k, v, do in BSHD), checked against float64 before timing."""
    q, k, v, do = inputs
    b, s, h, d = q.shape
    device = q.device
    impls = [_impl(name, _fused_fn(kw, backend), q, k, v, do, True, case.trained)
             for name, kw in case.fused_kwargs().items()]
    if with_flex and (case.flex_score is not None or case.flex_causal or case.mask_fn is not None):
        impls.append(_impl("flex_compiled", _flex_fn(case, device, b, s), q, k, v, do, False, case.trained))
    hs_case = _checked_heads(case, b, h, s)
    expected, bounds = reference_and_bounds(lambda dt: _reference(q, k, v, do, case, hs_case, dt), q.dtype)
    flops = {m: attn_flops(b, h, s, s, d, causal=case.causal, mode=m) for m in ("fwd", "fwd_bwd")}
    config = f"{case.name} B{b} H{h} S{s} D{d}"
    if case.note:
        result.notes.append(f"{config}: {case.note}")
    result.extend(run_config("mods", config, impls, expected, bounds, _select(case, hs_case), flops, device,
                             rep_ms=40.0 if quick else 80.0))
