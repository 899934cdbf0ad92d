"""Packed score_mod calls that cuDNN's ragged graphs cannot bound, run as one zero-padded dense batch.

Next to a score_mod cuDNN 9.19's ragged graphs mask no key past a sequence's length, and it reads
per-sequence graph inputs wrongly inside a mask, so a packed call with a score_mod is exact on
ragged graphs only under a top-left causal mask over one offsets tensor (`_key_tail_refusal`).
Every other one (no mask, two-sided or bottom-right windows, bottom-right causal with other query
than key lengths: chunked prefill, cross-attention, encoders) runs here:

    q (Tq, H, D) -> (B, Sq, H, D), k / v (Tk, Hkv, D) -> (B, Skv, Hkv, D)   zero-padded copies
    out = dense graph: the user's score_mod in the callback, then cuDNN's additive bias input
          (B, 1, Sq, Skv) of 0 / -inf holding every per-sequence bound (lengths, band, the
          bottom-right shift kv_len - q_len)                                 -> gathered rows

The bias is a full (.., Sq, Skv) input, which cuDNN reads right (forward and backward); Sq / Skv
are the max_seqlen buckets, so a batch costs its padded tiles (B x Sq x Skv), not its tokens. A
query row no key may attend gets key 0 in the bias (no all -inf row in the kernel), then out 0 and
lse -inf, and a zero gradient row (its dO is zeroed before the backward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import torch

from ...memo import BoundedMemo
from ...static import NO_VARLEN, Varlen
from . import varlen as VL

__all__ = ["PackedAsDenseRunner", "dense_problem", "MAX_BIAS_ELEMENTS"]

#: Largest (B, 1, Sq, Skv) bias served (2 GiB in bf16); larger batches are refused with the reason.
MAX_BIAS_ELEMENTS = 1 << 30


class _Batch(NamedTuple):
    """Per-batch index maps and bias: rows of the padded (B*S) buffers for each token (a dump row
    B*S for tokens between sequences), which tokens are real, and the bias / empty-row mask."""

    q_rows: torch.Tensor
    kv_rows: torch.Tensor
    q_real: torch.Tensor
    bias: torch.Tensor
    q_empty: torch.Tensor  # (Tq,) real query tokens with no key to attend


#: Batches by their cu_seqlens (identity and version): the layers of one step share one. Bounded by
#: the bytes of their biases too: one bias may reach MAX_BIAS_ELEMENTS (2 GiB in bf16), so the
#: bound keeps about one such batch, or many small ones, never 16 large ones.
MAX_BATCH_BYTES = 3 << 30
_BATCHES = BoundedMemo(16, "cudnn.packed_dense_batch", max_bytes=MAX_BATCH_BYTES)


def _composed(mod: Any, bias: torch.Tensor) -> Any:
    from score_mods.library import compose, post_scale_bias

    return compose(mod, post_scale_bias(bias))


def dense_problem(problem: Any) -> Any:
    """The dense (bshd) StaticProblem the packed `problem` runs as (its bias a meta template)."""
    from ...static import mod_signature as _mod_sig
    from ...spec import resolve_spec

    p, spec = problem, problem.spec
    b, h, hkv, sq, skv, d, dv = p.batch, p.heads, p.kv_heads, p.seqlen_q, p.seqlen_kv, p.head_dim, p.head_dim_v
    # the bias's shape, strides and dtype decide the graph; its values come per call (no memory here)
    template = _composed(spec.score_mod, torch.empty((b, 1, sq, skv), dtype=p.dtype, device="meta"))
    dense_spec, mod = resolve_spec(qkv_format="bshd", attn_mask_type="no_mask", softmax_scale=p.scale,
                                   score_mod=template, return_lse=True, backend="cudnn",
                                   deterministic=spec.deterministic)
    return dataclasses.replace(
        p, spec=dense_spec, seqlen_q=sq, seqlen_kv=skv, q_strides=(sq * h * d, d, h * d, 1),
        k_strides=(skv * hkv * d, d, hkv * d, 1), v_strides=(skv * hkv * dv, dv, hkv * dv, 1), aligned=True,
        same_lengths=False, q_offsets=False, kv_offsets=False, mod_tensors=_mod_sig(mod))


def refusal(problem: Any, dense_refusal: Any) -> Optional[str]:
    """None when `problem` (packed, with a score_mod) can run as a padded dense batch, else why."""
    from score_mods.trace import TracedMod

    spec = problem.spec
    head = "a score_mod on a packed batch that cuDNN's ragged graphs cannot bound runs as a padded dense batch"
    if not isinstance(spec.score_mod, TracedMod):
        return f"{head}, which needs a traced score_mod (a raw cuDNN callback cannot take the bounds as a bias)"
    if spec.has_sinks or spec.dropout_p:
        return f"{head}, which does not take attention sinks or dropout"
    from . import _tensor_axes

    positional = sorted(name for name, axes in _tensor_axes(spec.score_mod).items() if axes & {"q_idx", "kv_idx"})
    if positional:
        return (f"{head}, but the score_mod's tensor parameters {positional} are indexed by positions and sized for "
                "the packed lengths, not the padded batch's")
    numel = problem.batch * problem.seqlen_q * problem.seqlen_kv
    if numel > MAX_BIAS_ELEMENTS:
        return (f"{head} with a (B, 1, Sq, Skv) bias of {numel} elements (B={problem.batch}, Sq={problem.seqlen_q}, "
                f"Skv={problem.seqlen_kv}; at most {MAX_BIAS_ELEMENTS})")
    return dense_refusal(dense_problem(problem))


class PackedAsDenseRunner:
    """forward/backward of a packed score_mod plan through a dense one (see the module docstring)."""

    backend = "cudnn"
    validates_lengths = True  # the packed preparation checks cu_seqlens values (one device assertion)

    def __init__(self, problem: Any, version: int, make_dense: Optional[Any] = None) -> None:
        """make_dense(dense problem): the dense runner (default cuDNN's; tests pass the reference's)."""
        from .dense import DenseRunner

        self.static = p = problem
        self.band = p.spec.band
        dense = dense_problem(p)
        self.runner = DenseRunner(dense, version) if make_dense is None else make_dense(dense)
        self.quirks = ("ragged_key_tail_next_to_score_mod",) + tuple(getattr(self.runner, "quirks", ()))
        bb = VL.bucket_batch(p.batch)
        h, hkv, d, dv = p.heads, p.kv_heads, p.head_dim, p.head_dim_v
        self.layout = VL.ThdLayout(p.batch, bb, tuple(sorted({h * d, h * dv})), tuple(sorted({hkv * d, hkv * dv})),
                                   p.device)
        self.shape = (p.batch, p.seqlen_q, p.seqlen_kv)

    def grad_inputs(self, mod: Any, sinks: Any) -> tuple:
        return ()

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        return list(grads[3:])

    # ------------------------------------------------------------------ per batch

    def _batch(self, q: torch.Tensor, k: torch.Tensor, varlen: Varlen) -> _Batch:
        # the packed preparation checks the cu_seqlens values (one device assertion, memoized per batch)
        VL.prepare(self.layout, varlen, (q.shape[0], k.shape[0]), (varlen.max_seqlen_q, varlen.max_seqlen_kv))
        sources = (varlen.cu_seqlens_q, varlen.cu_seqlens_kv, varlen.cu_seqlens_q_padded, varlen.cu_seqlens_kv_padded)
        key = tuple((None, 0) if t is None else (id(t), t._version) for t in sources) + (
            q.shape[0], k.shape[0], self.shape, self.band, q.dtype)
        got = _BATCHES.get_identity(key, sources)
        if got is None:
            got = self._make_batch(q, k, varlen)
            _BATCHES.put_identity(key, sources, got)
        return got

    def _make_batch(self, q: torch.Tensor, k: torch.Tensor, varlen: Varlen) -> _Batch:
        b, sq, skv = self.shape
        dev = q.device
        cu_q, cu_k = varlen.cu_seqlens_q.long(), varlen.cu_seqlens_kv.long()
        len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
        q_rows, q_real = _rows(varlen.cu_seqlens_q_padded, cu_q, len_q, q.shape[0], sq, b)
        kv_rows, _ = _rows(varlen.cu_seqlens_kv_padded, cu_k, len_k, k.shape[0], skv, b)
        i = torch.arange(sq, device=dev).view(1, sq, 1)
        j = torch.arange(skv, device=dev).view(1, 1, skv)
        lq, lk = len_q.view(-1, 1, 1), len_k.view(-1, 1, 1)
        allowed = (i < lq) & (j < lk)
        band = self.band
        if band is not None:
            shift = (lk - lq) if band.bottom_right else 0
            dist = j - (i + shift)
            if band.right is not None:
                allowed &= dist <= band.right
            if band.left is not None:
                allowed &= dist >= -band.left
        empty = ~allowed.any(-1, keepdim=True)  # (B, Sq, 1): rows with no key
        allowed |= empty & (j == 0)  # key 0 keeps the kernel off all -inf rows; the row is zeroed after
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=dev).masked_fill_(~allowed, -math.inf).unsqueeze(1)
        q_empty = torch.cat([empty.view(-1), empty.new_ones(1)])[q_rows] & q_real
        return _Batch(q_rows, kv_rows, q_real, bias, q_empty)

    # ------------------------------------------------------------------ layout moves

    def _scatter(self, t: torch.Tensor, rows: torch.Tensor, s: int) -> torch.Tensor:
        """(T, Hx, Dx) packed -> (B, s, Hx, Dx) zero-padded (tokens between sequences to a dump row)."""
        b = self.shape[0]
        buf = t.new_zeros((b * s + 1,) + tuple(t.shape[1:]))
        buf.index_copy_(0, rows, t.detach())
        return buf[: b * s].view((b, s) + tuple(t.shape[1:]))

    @staticmethod
    def _gather(t: torch.Tensor, rows: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(B, s, Hx, Dx) -> (T, Hx, Dx) packed; tokens that are no sequence's get 0."""
        flat = t.reshape((-1,) + tuple(t.shape[2:]))
        got = flat.index_select(0, rows.clamp(max=flat.shape[0] - 1))
        return got.masked_fill_(~real.view(-1, 1, 1), 0.0)

    def _lse(self, stats: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """(H, Tq) fp32 from the dense Stats (B, H, Sq, 1); -inf for rows with no key and gaps."""
        flat = stats.squeeze(-1).transpose(1, 2).reshape(-1, stats.shape[1])  # (B*Sq, H)
        lse = flat.index_select(0, batch.q_rows.clamp(max=flat.shape[0] - 1))
        return lse.masked_fill_((batch.q_empty | ~batch.q_real).view(-1, 1), -math.inf).t().contiguous()

    def _stats(self, lse: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """Dense Stats (B, H, Sq, 1) fp32 from a packed lse (H, Tq). Rows of no token and rows
        with no key get +inf: the kernel's weights exp(s - lse) there are 0 (their key-0 stand-in
        must not weigh, whatever its score), and their dO is 0."""
        b, sq, _ = self.shape
        buf = torch.full((b * sq + 1, lse.shape[0]), math.inf, dtype=torch.float32, device=lse.device)
        rows = lse.t().to(torch.float32).masked_fill(batch.q_empty.view(-1, 1), math.inf)
        buf.index_copy_(0, batch.q_rows, rows)
        return buf[: b * sq].view(b, sq, -1).transpose(1, 2).unsqueeze(-1).contiguous()

    def _dense_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: _Batch) -> tuple:
        _, sq, skv = self.shape
        return (self._scatter(q, batch.q_rows, sq), self._scatter(k, batch.kv_rows, skv),
                self._scatter(v, batch.kv_rows, skv))

    def _dense_grad_out(self, grad_out: torch.Tensor, batch: _Batch) -> torch.Tensor:
        """dO padded, with rows that attend no key zeroed (their key-0 stand-in gets no gradient)."""
        return self._scatter(grad_out.masked_fill(batch.q_empty.view(-1, 1, 1), 0.0), batch.q_rows, self.shape[1])

    # ------------------------------------------------------------------ runner interface

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None):
        batch = self._batch(q, k, varlen)
        composed = _composed(mod, batch.bias)
        out_d, lse_d, saved_d, state_d = self.runner.forward(*self._dense_inputs(q, k, v, batch), NO_VARLEN,
                                                             composed, None)
        stats = lse_d.unsqueeze(-1)  # (B, H, Sq, 1): the dense graph's Stats
        out = self._gather(out_d, batch.q_rows, batch.q_real & ~batch.q_empty)
        lse = self._lse(stats, batch) if self.static.spec.return_lse else None
        return out, lse, (q, k, v, out, stats), (batch, saved_d, state_d)

    def backward(self, state, saved, grad_out):
        batch, saved_d, state_d = state
        return self._packed_grads(self.runner.backward(state_d, saved_d, self._dense_grad_out(grad_out, batch)), batch)

    def _packed_grads(self, grads: tuple, batch: _Batch) -> tuple:
        real_kv = batch.kv_rows < self.shape[0] * self.shape[2]
        return (self._gather(grads[0], batch.q_rows, batch.q_real), self._gather(grads[1], batch.kv_rows, real_kv),
                self._gather(grads[2], batch.kv_rows, real_kv))

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        """The backward from the call's arguments and the dense Stats it saved (the custom-op path)."""
        batch = self._batch(q, k, varlen)
        return self._backward_from(q, k, v, out, stats, batch, mod, grad_out)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out):
        """Gradients from a given output and packed fp32 lse (H, Tq) (see DenseRunner)."""
        batch = self._batch(q, k, varlen)
        return self._backward_from(q, k, v, out, self._stats(lse, batch), batch, mod, grad_out)

    def _backward_from(self, q, k, v, out, stats, batch, mod, grad_out):
        grads = self.runner.backward_call(*self._dense_inputs(q, k, v, batch),
                                          self._scatter(out, batch.q_rows, self.shape[1]), stats, NO_VARLEN,
                                          _composed(mod, batch.bias), None, self._dense_grad_out(grad_out, batch))
        return self._packed_grads(grads, batch)


def _rows(padded: Optional[torch.Tensor], cu: torch.Tensor, lens: torch.Tensor, tokens: int, s: int,
          batch: int) -> tuple:
    """(rows (T,) int64 into the padded (B*s + 1) buffer, real (T,) bool) of a packed side."""
    b, i, real = VL.token_positions(cu if padded is None else padded, lens, tokens, batch)
    return torch.where(real, b * s + i, batch * s), real
