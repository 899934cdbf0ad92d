"""Dense padded batches (attn_mask_type "padding" / "padding_causal") served as packed sequences.

A padded (B, S, H, D) batch with per-sequence lengths is the packed (B*S, H, D) batch whose
sequence b starts at row b*S: the thd runner then reads only real tokens (keys past a length
are never loaded — padding is often uninitialised memory, and the dense kernel lets NaN there
reach other rows), writes zeros in rows past a query length, and a sequence without keys gets
zero rows (the dense kernel leaves them unwritten). bshd inputs are viewed without a copy; sbhd
and bhsd inputs are copied into that order first. A packed form that cuDNN's ragged graphs cannot
bound (a score_mod without a top-left causal mask: `runs_as_dense`) runs as the packed-as-dense
batch of `packed_dense`, whose bias holds the lengths.

Shapes: q (B, Sq, H, D) etc. in the plan's format; out in the same format; lse (B, H, Sq).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch

from ...layouts import token_rows
from ...static import Varlen, bucket
from .thd import ThdRunner

__all__ = ["PaddedAsThdRunner", "thd_problem"]

_TO_BSHD = {"bshd": (0, 1, 2, 3), "sbhd": (1, 0, 2, 3), "bhsd": (0, 2, 1, 3)}


def thd_problem(problem: Any) -> Any:
    """The packed StaticProblem equivalent to a dense padded one."""
    spec = dataclasses.replace(problem.spec, qkv_format="thd", padding=False)
    h, hkv, d, dv = problem.heads, problem.kv_heads, problem.head_dim, problem.head_dim_v
    return dataclasses.replace(
        problem, spec=spec, seqlen_q=bucket(problem.seqlen_q), seqlen_kv=bucket(problem.seqlen_kv),
        q_strides=(h * d, d, 1), k_strides=(hkv * d, d, 1), v_strides=(hkv * dv, dv, 1), aligned=True,
        q_offsets=True, kv_offsets=True)


class PaddedAsThdRunner:
    """forward/backward of a dense padded plan through a ThdRunner (see the module docstring)."""

    backend = "cudnn"
    validates_lengths = True  # the thd preparation checks cu_seqlens against S and the padded offsets

    def __init__(self, problem: Any, version: int, make_packed: Optional[Callable[[Any], Any]] = None) -> None:
        """make_packed(packed problem): the packed runner (default: cuDNN's, see the module doc;
        tests pass one over the reference)."""
        self.static = problem
        self.fmt = problem.spec.qkv_format
        self.perm = _TO_BSHD[self.fmt]
        b, sq, skv = problem.batch, problem.seqlen_q, problem.seqlen_kv
        self.shape = (b, sq, skv)
        self.runner = (make_packed or (lambda packed: _packed_runner(packed, version)))(thd_problem(problem))
        self.quirks = tuple(getattr(self.runner, "quirks", ()))
        dev = problem.device
        self.pad_q = torch.arange(b + 1, dtype=torch.int32, device=dev) * sq
        self.pad_kv = torch.arange(b + 1, dtype=torch.int32, device=dev) * skv

    def _packed(self, t: torch.Tensor, s: int) -> torch.Tensor:
        t = t.permute(self.perm)  # (B, S, H, D)
        return t.reshape(t.shape[0] * s, t.shape[2], t.shape[3])

    def _unpacked(self, t: torch.Tensor, s: int) -> torch.Tensor:
        b = self.shape[0]
        t = t.view(b, s, t.shape[1], t.shape[2]).permute(self.perm)
        return t if self.fmt == "bshd" else t.contiguous()

    def _varlen(self, varlen: Varlen) -> Varlen:
        _, sq, skv = self.shape
        return Varlen(varlen.cu_seqlens_q, varlen.cu_seqlens_kv, self.pad_q, self.pad_kv, sq, skv)

    def grad_inputs(self, mod: Any, sinks: Any) -> tuple:
        return self.runner.grad_inputs(mod, sinks)

    def _inputs(self, q, k, v) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, sq, skv = self.shape
        return self._packed(q, sq), self._packed(k, skv), self._packed(v, skv)

    def _lse(self, lse: torch.Tensor) -> torch.Tensor:
        b, sq, _ = self.shape
        return lse.view(lse.shape[0], b, sq).permute(1, 0, 2).contiguous()  # (H, B*Sq) -> (B, H, Sq)

    def forward(self, q, k, v, varlen, mod, sinks, rng=None, extras=None):
        out, lse, saved, state = self.runner.forward(*self._inputs(q, k, v), self._varlen(varlen), mod, sinks, rng,
                                                     extras)
        out = self._unpacked(out, self.shape[1])
        return out, (None if lse is None else self._lse(lse)), saved, state

    def _grads(self, grads) -> tuple:
        _, sq, skv = self.shape
        dq, dk, dv = grads[:3]
        return (self._unpacked(dq, sq), self._unpacked(dk, skv), self._unpacked(dv, skv)) + tuple(grads[3:])

    def backward(self, state, saved, grad_out):
        return self._grads(self.runner.backward(state, saved, self._packed(grad_out, self.shape[1])))

    def op_grads(self, mod: Any, sinks: Any, grads: tuple) -> list:
        """The extra gradients of `backward_call`, already per op input (see DenseRunner.op_grads)."""
        return list(grads[3:])

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None):
        sq = self.shape[1]
        return self._grads(self.runner.backward_call(*self._inputs(q, k, v), self._packed(out, sq), stats,
                                                     self._varlen(varlen), mod, sinks, self._packed(grad_out, sq),
                                                     rng))

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out):
        sq = self.shape[1]
        packed_lse = token_rows(lse).t()  # (B, H, Sq) -> (H, B*Sq), the transpose of token rows (one copy)
        return self._grads(self.runner.backward_with_lse(*self._inputs(q, k, v), self._packed(out, sq), packed_lse,
                                                         self._varlen(varlen), mod, sinks, self._packed(grad_out, sq)))


def _packed_runner(packed: Any, version: int) -> Any:
    from . import runs_as_dense

    if runs_as_dense(packed):
        from .packed_dense import PackedAsDenseRunner

        return PackedAsDenseRunner(packed, version)
    return ThdRunner(packed, version)
