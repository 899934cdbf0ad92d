"""Recorded calls of flash-attn-4: what fixes FA4's host path for a call (`signature`), and the
memo of recordings per runner and signature (`lookup` / `store`).

FA4's `_flash_attn_fwd` and `_flash_attn_bwd` spend most of a call's host time checking
arguments, choosing tiles, building compile-cache keys and allocating buffers, and then launch a
few compiled kernels. All of that is fixed by the call's signature: the tensors' shapes, strides,
dtypes, devices, 16-byte alignment and aliasing, the aux scalars' types and the arguments that
are not tensors. So a runner records a signature's work once (`replay.record`) and replays it on
later calls (`replay.replay`); a signature whose work cannot be replayed keeps FA4's own path,
with the reason (`Host`). A stored recording holds no tensor.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, NamedTuple, Optional, Sequence

import torch

from ...memo import BoundedMemo

__all__ = ["Host", "signature", "view", "lookup", "store", "new_owner", "info"]


class Host(NamedTuple):
    """A signature that stays on FA4's own host path, and why."""
    why: str


#: (owner, signature) -> replay.Replay | Host; owners are runners (`new_owner`), so no runner
#: reuses another's entries
_RECORDED: BoundedMemo = BoundedMemo(1024, "fa4.recorded_calls")
_owners = itertools.count()
_owners_lock = threading.Lock()


def new_owner() -> int:
    """A token that keys one runner's recordings apart from every other runner's."""
    with _owners_lock:
        return next(_owners)


def _meta(t: Optional[torch.Tensor]) -> Any:
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def view(t: torch.Tensor) -> tuple:
    """(data pointer, metadata): two arguments with equal views are one and the same view."""
    return (t.data_ptr(), _meta(t))


def signature(own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[Sequence[torch.Tensor]],
              aux_scalars: Optional[tuple], constants: tuple) -> tuple:
    """What fixes FA4's host path for a call: each own and aux tensor's metadata, which own
    tensors are one and the same view (q is k in self-attention), the aux scalars' types and
    the call's other arguments (`constants`: scale, causal, window, max_seqlen, ...)."""
    views = tuple(None if t is None else view(t) for t in own)
    metas = tuple(None if v is None else v[1] for v in views)
    aliasing = tuple(None if v is None else views.index(v) for v in views)
    aux = None if aux_tensors is None else tuple(_meta(t) for t in aux_tensors)
    scalar_types = None if aux_scalars is None else tuple(type(s) for s in aux_scalars)
    return metas, aliasing, aux, scalar_types, constants


def info() -> Any:
    """The memo's statistics (`fused_attn.memo.MemoInfo`)."""
    return _RECORDED.info()


def lookup(owner: int, sig: tuple) -> Any:
    """The recording (`replay.Replay`) or `Host` stored for a runner's signature, or None."""
    return _RECORDED.get((owner, sig))


def store(owner: int, sig: tuple, entry: Any) -> None:
    """Keep a runner's recording or `Host` for a signature (the memo is bounded: LRU)."""
    _RECORDED.put((owner, sig), entry)
