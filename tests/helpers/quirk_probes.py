"""One probe per cuDNN quirk entry: the configuration that shows the fault, run on the plain path
(the entry lifted) and checked against the float64 reference backend.

    python quirk_probes.py NAME      prints "VERDICT ok" / "VERDICT wrong: ..." / "VERDICT declined: ..."

A probe runs in a process of its own (`test_quirks_gpu.py`): a fault may lose the CUDA context.
"ok" means the plain path is exact within the project's tolerance rule (forward and gradients);
anything else is the fault. Run with the repository root on the path.
"""

from __future__ import annotations

import math
import sys
from typing import Callable, Dict, List, Optional

import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import bound_from

DEV = "cuda"


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _compare(call: Callable, tensors: List[torch.Tensor], dtype: torch.dtype, grad: bool,
             extra_leaves: Callable = lambda exact: []) -> str:
    """call(q, k, v, backend=, extra=) on the probe's tensors: cuDNN in `dtype` against the
    reference in float64, the bound from the reference in `dtype` (`fused_attn.testing.bound_from`).
    extra_leaves(exact) -> further differentiated inputs (float64 ones when exact)."""

    def run(backend, dt):
        leaves = [t.to(DEV, dt).detach().requires_grad_(grad) for t in tensors]
        extra = extra_leaves(dt == torch.float64) if grad else []
        out = call(*leaves, backend=backend, extra=extra)
        if not grad:
            return [out.float().double()]
        do = _rand(*out.shape, seed=7).to(DEV, out.dtype)
        gs = torch.autograd.grad(out, leaves + extra, do)
        return [out.double()] + [g.double() for g in gs]

    exact = run("reference", torch.float64)
    same = run("reference", dtype)
    got = run("cudnn", dtype)
    for i, (g, e, s) in enumerate(zip(got, exact, same)):
        if not torch.isfinite(g).all():
            return f"wrong: result {i} has {int((~torch.isfinite(g)).sum())} non-finite values"
        err, bound = float((g - e).abs().max()), bound_from(s, e, dtype)
        if err > bound:
            return f"wrong: result {i} off by {err:.3g} > bound {bound:.3g}"
    return "ok"


def score_reused_in_pointwise() -> str:
    mod = sm.score_mod(lambda s, b, h, q, k: s - 0.05 * s * s, name="probe_square")
    t = [_rand(1, 128, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(
        q, k, v, score_mod=mod, backend=backend), t, torch.bfloat16, grad=True)


def _low_rows(skv: int, softcap: Optional[float]) -> str:
    """Every other query row under a -200 bias (its lse far below -88.7), keys `skv` long; the
    bias alone or next to a softcap score_mod; gradients checked."""
    sq, h = 128, 2
    bias = torch.zeros(1, h, sq, skv, dtype=torch.float64)
    bias[:, :, ::2] = -200.0
    t = [_rand(1, sq, h, 64, seed=1), _rand(1, skv, h, 64, seed=2), _rand(1, skv, h, 64, seed=3)]

    def call(q, k, v, backend, extra):
        mod = sm.post_scale_bias(bias.to(DEV, q.dtype))
        if softcap is not None:
            mod = sm.compose(sm.softcap(softcap), mod)
        return fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend=backend)

    return _compare(call, t, torch.bfloat16, grad=True)


def nan_dq_kv_64_mod_128() -> str:
    return _low_rows(192, None)


def nan_dq_kv_64_mod_128_score_mod_bias() -> str:
    return _low_rows(576, 30.0)


def ragged_sink_backward() -> str:
    h, d = 2, 64
    cu = torch.tensor([0, 37, 37, 160], dtype=torch.int32, device=DEV)
    t = [_rand(160, h, d, seed=i) for i in range(3)]
    sink0 = _rand(h, seed=9).float()

    def extra(exact):
        return [sink0.to(DEV, torch.float64 if exact else torch.float32).requires_grad_()]

    def call(q, k, v, backend, extra):
        return fused_attn.dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                attn_mask_type="causal", softmax_type="learnable", sinks=extra[0],
                                                backend=backend)

    return _compare(call, t, torch.bfloat16, grad=True, extra_leaves=extra)


def sq1_skv1_backward() -> str:
    t = [_rand(2, 1, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(q, k, v, backend=backend),
                    t, torch.bfloat16, grad=True)


def kv_broadcast_operand_backward() -> str:
    w = _rand(256, seed=4)

    @sm.score_mod(name="probe_key_bias")
    def key_bias(score, b, h, q_idx, kv_idx, w=sm.TensorParam("float")):
        return score + w[kv_idx]

    t = [_rand(1, 256, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(
        q, k, v, score_mod=key_bias(w=w.to(DEV, torch.float32 if q.dtype != torch.float64 else q.dtype)),
        backend=backend), t, torch.bfloat16, grad=True)


def batch_broadcast_operand() -> str:
    lens = torch.tensor([5, 200, 130, 256], dtype=torch.int32)

    @sm.score_mod(name="probe_mask_b")
    def mask_b(score, b, h, q_idx, kv_idx, lens=sm.TensorParam("int")):
        return sm.where(kv_idx < lens[b], score, -math.inf)

    t = [_rand(4, 256, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(
        q, k, v, score_mod=mask_b(lens=lens.to(DEV)), backend=backend), t, torch.bfloat16, grad=False)


def ragged_batch_operand() -> str:
    w = _rand(3, seed=5)
    cu = torch.tensor([0, 100, 130, 256], dtype=torch.int32, device=DEV)

    @sm.score_mod(name="probe_seq_scale")
    def seq_scale(score, b, h, q_idx, kv_idx, w=sm.TensorParam("float")):
        return score + w[b]

    t = [_rand(256, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(
        q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="causal",
        score_mod=seq_scale(w=w.to(DEV, torch.float32 if q.dtype != torch.float64 else q.dtype)), backend=backend),
        t, torch.bfloat16, grad=False)


def dbias_next_to_score_mod() -> str:
    b0 = _rand(1, 2, 128, 128, seed=6)

    def extra(exact):
        return [b0.to(DEV, torch.float64 if exact else torch.bfloat16).requires_grad_()]

    def call(q, k, v, backend, extra):
        mod = sm.compose(sm.softcap(20.0), sm.post_scale_bias(extra[0]))
        return fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend=backend)

    t = [_rand(1, 128, 2, 64, seed=i) for i in range(3)]
    return _compare(call, t, torch.bfloat16, grad=True, extra_leaves=extra)


def ragged_key_tail_next_to_score_mod() -> str:
    """A padded dense batch run as packed sequences (its plain ragged graph): a window over
    separate query and key lengths with more queries than keys (rows with no key at all: their
    lse must be -inf and their output 0)."""
    lens_q, lens_kv = [37, 192, 100], [5, 192, 77]
    cu_q, cu_kv = (torch.tensor([0] + [sum(n[:i + 1]) for i in range(3)], dtype=torch.int32, device=DEV)
                   for n in (lens_q, lens_kv))
    t = [_rand(3, 192, 2, 64, seed=i) for i in range(3)]

    def call(q, k, v, backend, extra):
        out, lse = fused_attn.dot_product_attention(
            q, k, v, attn_mask_type="padding", window_size=(24, 24), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
            score_mod=sm.softcap(20.0), backend=backend, return_lse=True)
        rows = torch.cat([lse[i, :, :n] for i, n in enumerate(lens_q)], dim=-1)
        empty = torch.isinf(rows)
        if backend == "cudnn":
            want = torch.isinf(call_reference_lse(q, k, v))
            if not torch.equal(empty, want):
                raise _LseMismatch(f"{int((empty != want).sum())} rows' lse disagree on having no key")
        return out

    def call_reference_lse(q, k, v):
        _, lse = fused_attn.dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask_type="padding", window_size=(24, 24), cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_kv, score_mod=sm.softcap(20.0), backend="reference", return_lse=True)
        return torch.cat([lse[i, :, :n] for i, n in enumerate(lens_q)], dim=-1)

    try:
        return _compare(call, t, torch.bfloat16, grad=True)
    except _LseMismatch as exc:
        return f"wrong: {exc}"


class _LseMismatch(Exception):
    pass


def irregular_mask_backward() -> str:
    ids = torch.tensor([0] * 40 + [1] * 50 + [0] * 38, device=DEV)
    t = [_rand(1, 128, 2, 64, seed=i) for i in range(3)]
    return _compare(lambda q, k, v, backend, extra: fused_attn.dot_product_attention(
        q, k, v, score_mod=sm.document_mask(ids), backend=backend), t, torch.bfloat16, grad=True)


def band_next_to_score_mod() -> str:
    """A raw graph: cuDNN's own causal band with a softcap callback (the library never builds it
    where the entry applies)."""
    import cudnn

    dt = cudnn.data_type
    b, h, s, d = 1, 2, 128, 64
    handle = cudnn.create_handle()
    g = cudnn.pygraph(io_data_type=dt.BFLOAT16, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT,
                      handle=handle)
    st = [s * h * d, d, h * d, 1]
    qt, kt, vt = (g.tensor(dim=[b, h, s, d], stride=st, data_type=dt.BFLOAT16, name=n) for n in "qkv")

    def softcap(gr, sc):
        t = gr.tanh(gr.mul(sc, inv, compute_data_type=dt.FLOAT), compute_data_type=dt.FLOAT)
        return gr.mul(t, cap, compute_data_type=dt.FLOAT)

    inv = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT, is_pass_by_value=True, name="inv")
    cap = g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.FLOAT, is_pass_by_value=True, name="cap")
    o, stats = g.sdpa(q=qt, k=kt, v=vt, attn_scale=d ** -0.5, generate_stats=True, score_mod=softcap,
                      diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0, name="p")
    o.set_output(True).set_dim([b, h, s, d]).set_stride(st).set_data_type(dt.BFLOAT16)
    stats.set_output(True).set_data_type(dt.FLOAT)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as exc:  # noqa: BLE001 - the frontend's refusal is the verdict
        return f"declined: {str(exc)[:160]}"
    q, k, v = (_rand(b, s, h, d, seed=i).to(DEV, torch.bfloat16) for i in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, 1, device=DEV)
    ws = torch.empty(g.get_workspace_size(), device=DEV, dtype=torch.uint8)
    pbv = {inv: torch.full((1, 1, 1, 1), 1 / 20.0), cap: torch.full((1, 1, 1, 1), 20.0)}
    g.execute({qt: q, kt: k, vt: v, o: out, stats: lse, **pbv}, ws, handle=handle)
    exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), attn_mask_type="causal",
                                             score_mod=sm.softcap(20.0), backend="reference")
    same = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(20.0),
                                            backend="reference")
    err, bound = float((out.double() - exact).abs().max()), bound_from(same.double(), exact, torch.bfloat16)
    return "ok" if err <= bound else f"wrong: off by {err:.3g} > bound {bound:.3g}"


def nonfinite_value_in_causal_tile() -> str:
    """Causal, a NaN in V at key 150 of 200 (attended by queries 150 and later): rows 0-149,
    which do not attend it, against the float64 reference of the clean inputs."""
    s, pos = 200, 150
    q, k, v = (_rand(1, s, 2, 64, seed=i).to(DEV, torch.bfloat16) for i in range(3))
    bad = v.clone()
    bad[:, pos] = float("nan")
    got = fused_attn.dot_product_attention(q, k, bad, attn_mask_type="causal", backend="cudnn")[:, :pos]
    if not torch.isfinite(got).all():
        return f"wrong: {int((~torch.isfinite(got)).sum())} non-finite values in the rows before the poisoned key"
    exact = fused_attn.dot_product_attention(q.double(), k.double(), v.double(), attn_mask_type="causal",
                                             backend="reference")[:, :pos]
    same = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", backend="reference")[:, :pos]
    err, bound = float((got.double() - exact).abs().max()), bound_from(same.double(), exact, torch.bfloat16)
    return "ok" if err <= bound else f"wrong: off by {err:.3g} > bound {bound:.3g}"


PROBES: Dict[str, Callable[[], str]] = {f.__name__: f for f in (
    score_reused_in_pointwise, nan_dq_kv_64_mod_128, nan_dq_kv_64_mod_128_score_mod_bias, ragged_sink_backward, sq1_skv1_backward,
    kv_broadcast_operand_backward, batch_broadcast_operand, ragged_batch_operand, dbias_next_to_score_mod,
    ragged_key_tail_next_to_score_mod, irregular_mask_backward, band_next_to_score_mod,
    nonfinite_value_in_causal_tile)}


#: entries a probe lifts besides its own (a document mask's ids[kv_idx] is also a key-axis view)
ALSO_LIFTED = {"irregular_mask_backward": ("kv_broadcast_operand_backward",),
               "nan_dq_kv_64_mod_128_score_mod_bias": ("nan_dq_kv_64_mod_128",)}


def main(name: str) -> Optional[str]:
    from fused_attn.backends.cudnn import quirks

    with quirks.lifted(name, *ALSO_LIFTED.get(name, ())):
        try:
            verdict = PROBES[name]()
        except NotImplementedError as exc:
            verdict = f"declined: {str(exc)[:200]}"
        torch.cuda.synchronize()
    print(f"VERDICT {verdict}", flush=True)
    return verdict


if __name__ == "__main__":
    main(sys.argv[1])
