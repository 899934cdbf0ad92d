"""The check that a score_mod's values and tensors are still those its forward used."""

from __future__ import annotations

from typing import Any

__all__ = ["check_mod_unchanged", "tensor_versions"]


def tensor_versions(mod: Any) -> tuple:
    """(name, tensor, version counter) of the score_mod's tensors (raw callbacks' score_mod_tensors
    and score_mod_bprop_tensors included), for `check_mod_unchanged`."""
    if mod is None:
        return ()
    return tuple((name, t, t._version) for name, t in mod.tensors().items())


def check_mod_unchanged(mod: Any, forward_values: Any, forward_versions: tuple = ()) -> None:
    """Raise if the score_mod's values changed since the forward (a module updates them in place:
    TracedMod.take_values replaces its `bound_values`) or one of its tensors was updated in place
    (torch's saved-tensor error): the gradient would be another function's."""
    for name, t, version in forward_versions:
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"score_mod {mod.name!r} tensor {name!r} of shape {tuple(t.shape)} is at version "
                f"{t._version}; expected version {version} instead. Update score_mod tensors after backward(), or "
                "pass a new tensor")
    values = None if mod is None else mod.bound_values
    if values is not forward_values and values != forward_values:
        raise RuntimeError(
            f"score_mod {mod.name!r} changed its values between this forward and its "
            f"backward (from {forward_values} to {values}, e.g. `attn.score_mod = ...` before backward()): "
            "the gradient would be that of another function; set the new score_mod after backward()")
