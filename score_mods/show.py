"""Small pictures of a score_mod, the way attention-gym draws its masks.

    >>> print(sm.causal().describe(4, 4))
    causal (4x4): x attend, . masked
    x . . .
    x x . .
    x x x .
    x x x x

A pure mask is drawn as x / .; any other mod as its values at score = 0 (for an additive
bias: the bias), masked positions as `.`. `visualize` draws the same grid into a PNG with
matplotlib (an optional dependency) and returns the (Sq, Skv) tensor it drew.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .expr import leaves


def _check(n: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be a positive int, got {n!r}")
    return n


def grid(mod, q_len: int, kv_len: int, b: int = 0, h: int = 0) -> Tuple[torch.Tensor, bool]:
    """(values, is_mask): a bool (Sq, Skv) attend grid for a pure mask, else mod(0) as float64."""
    _check(q_len, "q_len")
    _check(kv_len, "kv_len")
    tensors = mod.tensors()
    dev = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    zero = torch.zeros(1, 1, q_len, kv_len, dtype=torch.float64, device=dev)
    idx = (torch.tensor(b, device=dev).view(1, 1, 1, 1), torch.tensor(h, device=dev).view(1, 1, 1, 1),
           torch.arange(q_len, device=dev).view(1, 1, -1, 1), torch.arange(kv_len, device=dev).view(1, 1, 1, -1))
    with torch.no_grad():
        out = mod.eager(zero, *idx, q_len, kv_len).detach().double().cpu().expand(1, 1, q_len, kv_len)[0, 0]
    if mod.mask_condition() is not None:
        return torch.isfinite(out), True
    return out.clone(), False


def _header(mod, q_len: int, kv_len: int, b: int, h: int) -> str:
    axes = {n.attr for n in leaves(mod.root, "index")}
    where = "".join(f", {a}={v}" for a, v in (("b", b), ("h", h)) if a in axes)
    return f"{mod.name} ({q_len}x{kv_len}{where})"


def describe(mod, q_len: int = 8, kv_len: int = 8, *, b: int = 0, h: int = 0) -> str:
    """Text picture: rows are queries, columns keys. Masks: x attend, . masked; other mods:
    the values at score = 0 (the bias of an additive mod), . where masked."""
    values, is_mask = grid(mod, q_len, kv_len, b, h)
    head = _header(mod, q_len, kv_len, b, h)
    if is_mask:
        rows = [" ".join("x" if v else "." for v in row.tolist()) for row in values]
        return "\n".join([f"{head}: x attend, . masked"] + rows)
    cells = [[("." if v == float("-inf") else f"{v:.3g}") for v in row.tolist()] for row in values]
    width = max(len(c) for row in cells for c in row)
    rows = [" ".join(c.rjust(width) for c in row) for row in cells]
    return "\n".join([f"{head}: values at score=0, . masked"] + rows)


def visualize(mod, q_len: int = 16, kv_len: int = 16, path: Optional[str] = None, *, b: int = 0, h: int = 0) -> torch.Tensor:
    """Draw the grid of `describe` into a PNG at `path` (default "<name>.png") with matplotlib;
    return the (Sq, Skv) tensor drawn (bool for masks, float64 values otherwise)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "score_mod.visualize() needs matplotlib (pip install matplotlib); describe() gives a text picture "
            "without it"
        ) from exc
    values, is_mask = grid(mod, q_len, kv_len, b, h)
    fig = Figure(figsize=(max(3.0, kv_len * 0.3), max(3.0, q_len * 0.3)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    shown = values.float() if is_mask else values.masked_fill(~torch.isfinite(values), float("nan"))
    img = ax.imshow(shown.numpy(), cmap="Blues" if is_mask else "viridis", interpolation="nearest")
    if not is_mask:
        fig.colorbar(img, ax=ax)
    ax.set_title(_header(mod, q_len, kv_len, b, h))
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    fig.savefig(path or f"{mod.name}.png", dpi=100, bbox_inches="tight")
    return values
