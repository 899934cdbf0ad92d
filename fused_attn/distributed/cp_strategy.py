"""cp_comm="auto": which context-parallel strategy serves a call.

The rule (`choose_cp_comm`), in order:

1. "all_to_all" (head-parallel) when the query heads and the key/value heads are multiples of
   the group size and the score_mod can be split by heads (it does not read `h` arithmetically).
   Its communication per rank (q, k, v, out forward; dO, dq, dk, dv backward, each (N-1)/N of
   the local tensor) does not grow with N, it runs one attention call per rank over the whole
   sequence (no partial blocks, no merges, every mask and window, positions need no offsets),
   and load balance is exact whatever the layout.
2. "ring" otherwise: K/V travel around the group, overlapped with the block computations; the
   exchanged volume grows with N ((N-1) K/V hops forward, (N-1) K/V and N fp32 dK/dV hops
   backward) but is hidden behind compute at long sequences, except the final dK/dV hop.

"all_gather" is never chosen automatically: it moves the same K/V volume as the ring without
overlapping it (measured slower than the ring at every length on 2 GPUs,
benchmarks/results/cp_h200x2.md); it remains available by name.

Every rank passes the same shapes and arguments, so every rank makes the same choice (no
communication). The choice is a routing decision, not a fallback: an explicit cp_comm is never
replaced, and a strategy that cannot serve a call raises with the reason.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .cp_heads import heads_refusal
from .sharding import format_dims

__all__ = ["choose_cp_comm", "choose"]


def choose(query: torch.Tensor, key: torch.Tensor, fmt: str, n: int, mod: Any) -> Tuple[str, str]:
    """(strategy, reason) for local shards query / key of a validated call over n ranks."""
    _, hd, _ = format_dims(fmt)
    heads, kv_heads = query.shape[hd], key.shape[hd]
    why_not: Optional[str] = heads_refusal(heads, kv_heads, n, mod)
    if why_not is None:
        return "all_to_all", (f"{heads} query / {kv_heads} key-value heads split over {n} ranks: head-parallel "
                              "(communication independent of the group size, one call per rank)")
    return "ring", f"ring, since all_to_all cannot serve: {why_not}"


def choose_cp_comm(query: torch.Tensor, key: torch.Tensor, cp_group: Any = None, **kwargs: Any) -> Tuple[str, str]:
    """(strategy, reason) that cp_comm="auto" picks for `context_parallel_attention(query, key, ...,
    cp_group, **kwargs)` (the same keyword arguments; local shards)."""
    from .cp_args import validate

    args = validate(query, key, cp_group, kwargs.pop("layout", "load_balanced"), kwargs)
    return choose(query, key, args.fmt, args.n, args.mod)
