"""The eager and flex_attention side of `TracedMod` (a mixin): the reference evaluation, the
flex score_mod / mask_mod exports, and the text / PNG pictures of show.py."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import eager as eager_mod
from .expr import Node
from .parts import pure_mask_condition


class EagerAdapters:
    """TracedMod's eager evaluation, flex_attention exports and pictures."""

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len) -> torch.Tensor:
        env = eager_mod.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len)
        return eager_mod.evaluate(self.root, env, self._params())

    def to_flex(self, q_len: Optional[int] = None, kv_len: Optional[int] = None) -> Callable:
        """A flex_attention score_mod `(score, b, h, q_idx, kv_idx) -> score`.

        flex_attention has no per-sequence lengths: q_len / kv_len are the full Sq / Skv,
        which must be given here when the mod uses them.
        """
        if self.uses_lengths and (q_len is None or kv_len is None):
            raise ValueError(f"score_mod {self.name!r} reads q_len/kv_len; call to_flex(q_len=Sq, kv_len=Skv)")

        prog, params = eager_mod.program(self.root), self._params()  # made here, in eager code

        def flex_mod(score, b, h, q_idx, kv_idx):
            return eager_mod.run(prog, eager_mod.index_env(score, b, h, q_idx, kv_idx, q_len, kv_len), params)

        flex_mod.__name__ = f"{self.name}_flex"
        return flex_mod

    def mask_condition(self) -> Optional[Node]:
        """The condition of a pure mask (the mod is where(cond, score, -inf) chains over the bare
        score; nested masks are and-ed), else None."""
        return pure_mask_condition(self.root)

    def to_flex_mask(self, q_len: Optional[int] = None, kv_len: Optional[int] = None) -> Callable:
        """For a pure mask: a flex_attention mask_mod `(b, h, q_idx, kv_idx) -> bool` (for
        create_block_mask). ValueError for mods that change scores."""
        cond = self.mask_condition()
        if cond is None:
            raise ValueError(f"score_mod {self.name!r} is not a pure mask (it changes scores); use to_flex()")
        if self.uses_lengths and (q_len is None or kv_len is None):
            raise ValueError(f"score_mod {self.name!r} reads q_len/kv_len; call to_flex_mask(q_len=Sq, kv_len=Skv)")

        prog, params = eager_mod.program(cond), self._params()  # made here, in eager code

        def flex_mask(b, h, q_idx, kv_idx):
            env = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, "q_len": q_len, "kv_len": kv_len}
            out = eager_mod.run(prog, env, params)
            return out if isinstance(out, torch.Tensor) else torch.full((), bool(out), dtype=torch.bool, device=q_idx.device)

        flex_mask.__name__ = f"{self.name}_flex_mask"
        return flex_mask

    # pictures ---------------------------------------------------------------
    def describe(self, q_len: int = 8, kv_len: int = 8, *, b: int = 0, h: int = 0) -> str:
        """A text picture of the mask (x attend, . masked) or of the added values; see show.py."""
        from .show import describe

        return describe(self, q_len, kv_len, b=b, h=h)

    def visualize(self, q_len: int = 16, kv_len: int = 16, path: Optional[str] = None, *, b: int = 0, h: int = 0) -> torch.Tensor:
        """Draw the mask / values into a PNG (matplotlib); return the (Sq, Skv) tensor drawn; see show.py."""
        from .show import visualize

        return visualize(self, q_len, kv_len, path, b=b, h=h)
