"""A traced score_mod evaluated at shifted positions: the same math for a block of a larger problem.

Context parallelism runs attention on blocks of the sequence; a mod that reads positions must see
the *global* ones:

    block = at_positions(alibi(slopes), q_offset=4096, kv_offset=0, q_len=8192, kv_len=8192)
    block.eager(score, b, h, q_idx, kv_idx, ...)  ==  alibi.eager(score, b, h, q_idx + 4096, kv_idx, 8192, 8192)

The mod's DAG gets q_idx -> q_idx + q_offset, kv_idx -> kv_idx + kv_offset and q_len / kv_len ->
the given lengths, all four as int parameters: values are bound per call, so every block of every
rank and step shares one cuDNN graph (`cache_key` has no values). Comparisons fold the offsets
into one host scalar against kv_idx - q_idx (the lowering's canonical form); an offset left in
arithmetic enters the graph as an int32 pass-by-value operand (measured on H100: cuDNN adds an
int32 scalar to `gen_index` correctly and an fp32 one wrongly; benchmarks/results/
frontend_probe_h100.md, third probe). Tensor parameters indexed by
positions are indexed globally, so they are checked against the given lengths.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from .expr import Node, substitute
from .templates import template
from .trace import ParamSpec, TracedMod, origin_named

__all__ = ["at_positions", "POSITION_PARAMS", "PositionedMod"]

#: the int parameters a positioned mod adds: q offset, kv offset, q length, kv length
POSITION_PARAMS = ("pos_q_offset", "pos_kv_offset", "pos_q_len", "pos_kv_len")
_INDEX_PARAM = {"q_idx": POSITION_PARAMS[0], "kv_idx": POSITION_PARAMS[1]}
_LENGTH_PARAM = {"q_len": POSITION_PARAMS[2], "kv_len": POSITION_PARAMS[3]}


class PositionedMod(TracedMod):
    """A TracedMod whose position parameters (POSITION_PARAMS) are int32 graph operands and whose
    tensor parameters are checked against the global lengths it carries."""

    def cudnn_operands(self, dims: Optional[Tuple[int, int, int, int]] = None, *,
                       device: Any = None) -> Dict[str, torch.Tensor]:
        ops = super().cudnn_operands(dims, device=device)
        for p in POSITION_PARAMS:
            if p in ops:
                ops[p] = torch.full((1, 1, 1, 1), int(self._values[p]), dtype=torch.int32)
        return ops

    def check(self, *, device: torch.device, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> None:
        """The block must lie inside the global lengths; tensor parameters are checked as the
        unshifted mod checks them for the global problem."""
        q_off, kv_off, q_len, kv_len = (int(self._values[p]) for p in POSITION_PARAMS)
        for what, off, n, total in (("query", q_off, seqlen_q, q_len), ("key", kv_off, seqlen_kv, kv_len)):
            if off + n > total:
                raise ValueError(f"score_mod {self.name!r}: a block of {n} {what} positions at offset {off} ends past "
                                 f"the global {what} length {total}")
        unshifted = self._origin.unshifted._copy({p: v for p, v in self._values.items() if p not in POSITION_PARAMS})
        unshifted.check(device=device, batch=batch, heads=heads, seqlen_q=q_len, seqlen_kv=kv_len)


def _shifted(n: Node, args: Tuple[Node, ...]) -> Optional[Node]:
    if n.op == "index" and n.attr in _INDEX_PARAM:
        return Node("add", (n, Node("param", attr=_INDEX_PARAM[n.attr], dtype="i")), dtype="i")
    if n.op == "length":
        return Node("param", attr=_LENGTH_PARAM[n.attr], dtype="i")
    return None


def _positioned_structure(origin_name: str) -> PositionedMod:
    """The structure of the origin named `origin_name` at shifted positions (made once per
    origin, see templates)."""
    origin = origin_named(origin_name)
    clash = sorted(set(POSITION_PARAMS) & set(origin.specs))
    if clash:
        raise ValueError(f"score_mod {origin.name!r} has parameters named {clash}, which at_positions adds; "
                         "rename them")
    specs = dict(origin.specs)
    specs.update({p: ParamSpec(p, "int", None, 0) for p in POSITION_PARAMS})
    values = {**origin._values, **{p: 0 for p in POSITION_PARAMS}}
    structure = PositionedMod(f"{origin.base_name}@positions", substitute(origin.root, _shifted), specs, values)
    structure.unshifted = origin
    return structure


def at_positions(mod: TracedMod, q_offset: int, kv_offset: int, q_len: int, kv_len: int) -> PositionedMod:
    """`mod` evaluated at q_idx + q_offset, kv_idx + kv_offset with lengths q_len / kv_len (see the
    module docstring). Offsets and lengths are Python ints; the mod's own values are kept."""
    if not isinstance(mod, TracedMod):
        raise TypeError(f"at_positions() takes a traced score_mod, got {type(mod).__name__}")
    for name, v in (("q_offset", q_offset), ("kv_offset", kv_offset), ("q_len", q_len), ("kv_len", kv_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"at_positions(): {name} must be an int, got {v!r} ({type(v).__name__})")
        if v < 0 or v >= 2 ** 31:
            raise ValueError(f"at_positions(): {name}={v} is outside [0, 2**31)")
    structure = template(_positioned_structure, mod.origin_name)
    values = {**mod._values, POSITION_PARAMS[0]: q_offset, POSITION_PARAMS[1]: kv_offset,
              POSITION_PARAMS[2]: q_len, POSITION_PARAMS[3]: kv_len}
    return structure._copy(values, name=f"{mod.name}@positions")
