"""Packed (T, H, D) benchmark inputs and their reference: seeded lengths, cu_seqlens, random
tensors, and naive attention one sequence at a time (shared by the varlen suite and the step bench).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .checks import naive_attention


def random_lengths(n: int, max_len: int, multiple: int, seed: int) -> List[int]:
    """n lengths, multiples of `multiple` in [multiple, max_len], from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(1, max_len // multiple + 1, (n,), generator=gen) * multiple).tolist()


def cu_seqlens(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """(N+1,) int32 cumulative offsets starting at 0."""
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)


def packed_tensors(total: int, h: int, d: int, device, seed: int):
    """q, k, v (bf16 (total, h, d), requiring grad) and a gradient for out, from a seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ts = [torch.randn(total, h, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    return [t.requires_grad_() for t in ts[:3]] + [ts[3]]


def reference_packed(q, k, v, do, lengths: Sequence[int], causal: bool, dtype, *,
                     lengths_kv: Optional[Sequence[int]] = None,
                     score_fn: Optional[Callable[..., torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """Naive attention per sequence on packed (T, H, D) tensors (T = sum(lengths)): out, dq, dk, dv
    (T, H, D) in `dtype`, one sequence at a time (so memory follows the longest sequence).
    lengths_kv: the key lengths where they differ from the query lengths (causal is then
    bottom-right per sequence: query i attends keys j <= i + kv_len - q_len); score_fn: a
    score_mod in `naive_attention`'s form."""
    parts: Dict[str, List[torch.Tensor]] = {key: [] for key in ("out", "dq", "dk", "dv")}
    sq = sk = 0
    scale = 1 / math.sqrt(q.shape[-1])
    for nq, nk in zip(lengths, lengths if lengths_kv is None else lengths_kv):
        if nq:
            sl = [t.detach()[a:a + n].transpose(0, 1).unsqueeze(0) for t, a, n in
                  ((q, sq, nq), (k, sk, nk), (v, sk, nk), (do, sq, nq))]
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq) if causal else None
            res = naive_attention(*sl[:3], scale=scale, dtype=dtype, mask=mask, score_fn=score_fn, grad_out=sl[3])
            for key, t in res.items():
                parts[key].append(t[0].transpose(0, 1))
        sq, sk = sq + nq, sk + nk
    return {key: torch.cat(ts) for key, ts in parts.items()}

