"""One training call on two engines: the forward of one engine's runner, the backward of
another's (`engines.choose` pairs them where the measured table says the pair is faster,
`engine_speed.split`).

The two halves meet in what every engine's backward can start from: q, k, v, the output and the
fp32 log-sum-exp (dense (B, H, Sq), thd (H, Tq), sinks folded in). The forward runner gives its
lse with `forward_lse(saved)`; the backward runner takes it through `backward_with_lse`, the call
context parallelism already uses for key chunks. Only problems whose whole backward is the
gradients of q, k and v are split (no sinks, no score_mod tensor parameters, no dropout):
`engines.choose` checks that before pairing.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch

from .lse_backward import into_dest, weightless_empty_rows

__all__ = ["SplitRunner"]


class SplitRunner:
    """The runner interface (`engines.Runner`) over a forward runner and a backward runner.
    forward -> (out, lse or None, saved (q, k, v, out, lse), state (varlen, mod, sinks));
    backward -> (dq, dk, dv) from the backward runner's `backward_with_lse`.
    `clear_empty_rows`: rows that may attend no key (lse -inf) get lse +inf before the backward,
    so their weights exp(s - lse) are 0 on every engine (some read -inf as a weight of inf)."""

    def __init__(self, forward: Any, backward: Any, clear_empty_rows: bool) -> None:
        self.forward_runner, self.backward_runner = forward, backward
        self.backend = forward.backend
        self.backward_backend = backward.backend
        self.clear_empty_rows = clear_empty_rows
        self.quirks: Tuple[str, ...] = tuple(dict.fromkeys(
            tuple(getattr(forward, "quirks", ())) + tuple(getattr(backward, "quirks", ()))))
        self.validates_lengths = bool(getattr(forward, "validates_lengths", False))

    def grad_inputs(self, mod: Any, sinks: Optional[torch.Tensor]) -> tuple:
        return ()

    def op_grads(self, mod: Any, sinks: Optional[torch.Tensor], grads: tuple) -> list:
        return []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Any, mod: Any,
                sinks: Optional[torch.Tensor], rng: Any = None, extras: Sequence[torch.Tensor] = (),
                dest: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor], tuple, Any]:
        out, lse, saved, _ = self.forward_runner.forward(q, k, v, varlen, mod, sinks, rng, extras=extras, dest=dest)
        return out, lse, (q, k, v, out, self.forward_runner.forward_lse(saved)), (varlen, mod, sinks)

    def backward(self, state: Any, saved: tuple, grad_out: torch.Tensor) -> tuple:
        varlen, mod, sinks = state
        q, k, v, out, lse = saved
        return self.backward_with_lse(q, k, v, out, lse, varlen, mod, sinks, grad_out)

    def backward_call(self, q, k, v, out, stats, varlen, mod, sinks, grad_out, rng=None) -> tuple:
        """The custom-op path: `stats` is the forward's lse (as `forward_lse` gave it)."""
        return self.backward_with_lse(q, k, v, out, stats, varlen, mod, sinks, grad_out)

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None) -> tuple:
        if self.clear_empty_rows:
            lse = weightless_empty_rows(lse)
        grads = self.backward_runner.backward_with_lse(q, k, v, out, lse, varlen, mod, sinks, grad_out)
        return into_dest(tuple(grads[:3]), dest)
