"""What a score_mod's expression reads of the index arguments: which it uses arithmetically and
which subscript each dim of a tensor parameter (shared by the cuDNN band rectangles, which may
cut only mods that read no position, and by distributed sharding rules).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

__all__ = ["index_uses", "tensor_axes"]


def _index_reads(root: Any) -> Tuple[set, Dict[str, list]]:
    """(index axes read arithmetically, {tensor name: per dim, the set of what indexes it}):
    an index argument used directly as a tensor parameter's subscript (``bias[b, h, q_idx,
    kv_idx]``) is recorded against that dim; anything else (``q_idx - kv_idx``, ``table[h, b + 1]``)
    counts as arithmetic use, and a computed subscript is recorded as "*"."""
    arithmetic: set = set()
    dims: Dict[str, list] = {}
    seen: set = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "index":
            arithmetic.add(n.attr)
        elif n.op == "length":
            arithmetic.add("length")
        elif n.op == "gather":
            slots = dims.setdefault(n.attr, [set() for _ in n.args])
            for d, a in enumerate(n.args):
                if a.op == "index":
                    slots[d].add(a.attr)
                else:
                    slots[d].add("*")
                    stack.append(a)
            continue
        stack.extend(n.args)
    return arithmetic, dims


def index_uses(mod: Any) -> Optional[frozenset]:
    """The index arguments a score_mod reads arithmetically ({"b", "h", "q_idx", "kv_idx",
    "length"}), or None when unknown (not a traced mod). Indexing a tensor parameter
    (``bias[b, h, q_idx, kv_idx]``) is not arithmetic use (see `tensor_axes`), unless the same
    dim of that tensor is also read at another subscript (a shard could not serve both)."""
    if mod is None:
        return frozenset()
    root = mod.root
    if root is None:
        return None
    arithmetic, dims = _index_reads(root)
    for slots in dims.values():
        for labels in slots:
            if len(labels) > 1:
                arithmetic.update(a for a in labels if a != "*")
    return frozenset(arithmetic)


def tensor_axes(mod: Any) -> Optional[Dict[str, tuple]]:
    """{tensor parameter name: per dim, the index axis that subscripts it (None: computed or mixed)}
    for a traced mod, else None."""
    if mod is None:
        return {}
    root = mod.root
    if root is None:
        return None if mod.tensors() else {}
    _, dims = _index_reads(root)
    return {name: tuple(next(iter(labels)) if len(labels) == 1 and "*" not in labels else None for labels in slots)
            for name, slots in dims.items()}
