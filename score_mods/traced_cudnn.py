"""The cuDNN side of `TracedMod`: its lowering plan, graph operands and callbacks (a mixin).

`CudnnLowering` implements the ScoreMod members the cuDNN backend calls (`cudnn_operands`,
`lower_forward`, ...) over `lower_cudnn`'s plan of the mod's DAG and `materialization`'s
operands; it reads the traced mod's root, values, scalars and tensors.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from . import expr, lower_cudnn, materialization


class CudnnLowering:
    """TracedMod's cuDNN members (see ScoreMod): plan facts, operands and the lowered callbacks."""

    @property
    def plan(self) -> "lower_cudnn.Plan":
        """The structural lowering plan (see lower_cudnn): what is in-graph, materialized, folded."""
        return lower_cudnn.plan_for(self.root)

    @property
    def irregular_mask(self) -> bool:
        """True when a mask condition reads a tensor parameter or a materialized operand that
        varies along kv_idx (document ids, 2-D neighbourhoods, ...): the cuDNN backend refuses
        such masks' backward where its quirk `irregular_mask_backward` applies (the engines
        recompute them wrongly: document masks ~100% off, 2-D neighbourhoods dQ off by up to
        4.0, while the forward is right)."""
        got = self.__dict__.get("_irregular_mask")
        if got is None:
            got = self._irregular_mask = bool(self.plan.mask_reads_key_inputs)
        return got

    @property
    def needs_host_lengths(self) -> bool:
        """True when the cuDNN lowering folds q_len/kv_len on the host (dense problems only)."""
        got = self.__dict__.get("_needs_host_lengths")
        if got is None:
            got = self._needs_host_lengths = self.plan.needs_host_lengths
        return got

    @property
    def needs_dims(self) -> bool:
        """True when `cudnn_operands` needs the graph dims (it materializes subexpressions)."""
        return bool(self.plan.materialized)

    @property
    def cudnn_unsupported(self) -> Optional[str]:
        """Why the cuDNN lowering cannot run this mod (a score-dependent op the engines lack),
        or None. The reference backend and to_flex() run every mod."""
        plan = self.plan
        return lower_cudnn.unsupported_message(plan, self.name) if plan.unsupported else None

    def cudnn_operands(self, dims: Optional[Tuple[int, int, int, int]] = None, *, device: Any = None) -> Dict[str, torch.Tensor]:
        """See ScoreMod.cudnn_operands: scalars, tensor views and, given dims, materialized operands."""
        plan = self.plan
        if plan.unsupported:
            raise NotImplementedError(lower_cudnn.unsupported_message(plan, self.name))
        if self._operands is None:
            ops = lower_cudnn.scalar_operands(plan, self.scalars_typed())
            tensors = self.tensors()
            for name, (p, axes) in plan.views.items():
                ops[name] = _view4d(tensors[p], axes)
            self._operands = ops
        if not plan.materialized:
            return dict(self._operands)
        if dims is None:
            raise ValueError(
                f"score_mod {self.name!r} materializes index expressions ({', '.join(plan.materialized)}); the backend "
                "must call cudnn_operands(dims=(B, H, Sq, Skv), device=...) with the graph's dims"
            )
        tensors = self.tensors()
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values())
        # per-call fast path: this object's values are fixed, so (dims, device, tensor versions) decide
        memo_key = (tuple(dims), str(device), tuple((id(t), t._version) for t in tensors.values()))
        hit = self.__dict__.get("_op_memo")
        if hit is not None and hit[0] == memo_key and not grad:
            return dict(hit[1])
        out = dict(self._operands)
        out.update(materialization.operands(plan, self, dims, device))
        if not grad:
            self._op_memo = (memo_key, out)
        return dict(out)

    def length_operands(self, q_len: int, kv_len: int) -> Dict[str, torch.Tensor]:
        return lower_cudnn.scalar_operands(self.plan, self.scalars_typed(), {"q_len": q_len, "kv_len": kv_len})

    def lower_forward(self, graph, score, operands, memo):
        return lower_cudnn.lower_forward(self.plan, graph, score, operands, memo, self.name)

    def lower_backward(self, graph, dscore, operands, memo):
        return lower_cudnn.lower_backward(self.plan, graph, dscore, operands, memo, self.name)

    def score_scale(self) -> float:
        """The host value of the factor folded out of this mod (lower_cudnn.scaled_plan_for), or 1.0."""
        node = lower_cudnn.scaled_plan_for(self.root).score_scale
        if node is None:
            return 1.0
        hit = self.__dict__.get("_score_scale")
        if hit is not None and hit[0] is self._values:
            return hit[1]
        value = float(lower_cudnn.eval_scalar(node, self.scalars_typed()))
        self._score_scale = (self._values, value)
        return value

    def lower_scaled_forward(self, graph, score, operands, memo):
        return lower_cudnn.lower_forward(lower_cudnn.scaled_plan_for(self.root), graph, score, operands, memo,
                                         self.name)

    def lower_scaled_backward(self, graph, dscore, operands, memo):
        return lower_cudnn.lower_backward(lower_cudnn.scaled_plan_for(self.root), graph, dscore, operands, memo,
                                          self.name)


def _view4d(t: torch.Tensor, axes: tuple) -> torch.Tensor:
    """(1|.., 1|.., 1|.., 1|..) view of a tensor parameter; integer ids become int32."""
    shape = [1, 1, 1, 1]
    for d, a in enumerate(axes):
        shape[expr.INDEX_AXES.index(a)] = t.shape[d]
    if not t.is_floating_point() and t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t.reshape(shape)

