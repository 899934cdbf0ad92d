"""The check that a score_mod's values are still those its forward used."""

from __future__ import annotations

from typing import Any

__all__ = ["check_mod_unchanged"]


def check_mod_unchanged(mod: Any, forward_values: Any) -> None:
    """Raise if the score_mod's values changed since the forward (a module updates them in place:
    TracedMod.take_values replaces the values dict): the gradient would be another function's."""
    values = getattr(mod, "_values", None)
    if values is not forward_values and values != forward_values:
        raise RuntimeError(
            f"score_mod {getattr(mod, 'name', '?')!r} changed its values between this forward and its "
            f"backward (from {forward_values} to {values}, e.g. `attn.score_mod = ...` before backward()): "
            "the gradient would be that of another function; set the new score_mod after backward()")
