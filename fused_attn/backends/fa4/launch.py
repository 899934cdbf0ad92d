"""Recorded launches of flash-attn-4's forward kernel: the same kernel, without FA4's host path
on every call.

`_flash_attn_fwd` spends most of a forward's host time (about 150 us per call on an H200's
host) checking arguments, choosing tiles and building its compile-cache key, and then launches
one compiled kernel. All of that is fixed by the launch signature (`signature`: the tensors'
shapes, strides, dtypes, devices, 16-byte alignment and aliasing, and the arguments that are
not tensors). So the first call of a signature runs FA4's function with its compile cache
watched (`record`), and later calls launch the recorded kernel with their own tensors and aux
data (`launch`).

A recording is kept only where it replays the very same work:
- exactly one kernel was launched through FA4's forward compile cache;
- every tensor argument is one of the call's own (q, k, v, out, lse, cu_seqlens, sinks: the same
  memory, shape, strides and dtype), and the aux data is the call's aux tensors and scalars;
- every other argument is an immutable constant (None, numbers, strings, CuTe numeric scalars,
  tuples of those).
Anything else (a buffer FA4 made for the call, such as varlen scheduler metadata or split-KV
partials; a problem with no keys, which launches nothing) keeps the signature on FA4's own path,
with the reason (`Host`). A stored launch holds no tensor.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ...memo import BoundedMemo
from . import install

__all__ = ["Launch", "Host", "signature", "record", "launch", "lookup", "store", "new_owner", "info"]

#: positions of the call's own tensors in `own` (the order `record` / `launch` take them)
OWN_NAMES = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "learnable_sink")
_OUT, _LSE = OWN_NAMES.index("out"), OWN_NAMES.index("lse")


class _Slot(NamedTuple):
    """A tensor argument: the call's own tensor at `index` of `own`."""
    index: int


class _AuxSlot(NamedTuple):
    """The aux data argument, rebuilt per call from the call's aux tensors and scalars."""
    kind: type


class Launch(NamedTuple):
    """A recorded launch: the compiled kernel and its arguments (constants and slots)."""
    kernel: Callable[..., Any]
    arguments: tuple


class Host(NamedTuple):
    """A signature that stays on FA4's own host path, and why."""
    why: str


#: (owner, signature) -> Launch | Host | backward_replay.Replay; owners are runners (`new_owner`),
#: so no runner reuses another's entries
_LAUNCHES: BoundedMemo = BoundedMemo(1024, "fa4.launches")
_owners = itertools.count()
_owners_lock = threading.Lock()


def new_owner() -> int:
    """A token that keys one runner's launches apart from every other runner's."""
    with _owners_lock:
        return next(_owners)


def _meta(t: Optional[torch.Tensor]) -> Any:
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def _view(t: torch.Tensor) -> tuple:
    """(data pointer, metadata): two arguments with equal views are one and the same view."""
    return (t.data_ptr(), _meta(t))


def signature(own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[Sequence[torch.Tensor]],
              aux_scalars: Optional[tuple], constants: tuple) -> tuple:
    """What fixes FA4's host path for a call: each own and aux tensor's metadata, which own
    tensors are one and the same view (q is k in self-attention), the aux scalars' types and
    the call's other arguments (`constants`: scale, causal, window, max_seqlen, ...)."""
    views = tuple(None if t is None else _view(t) for t in own)
    metas = tuple(None if v is None else v[1] for v in views)
    aliasing = tuple(None if v is None else views.index(v) for v in views)
    aux = None if aux_tensors is None else tuple(_meta(t) for t in aux_tensors)
    scalar_types = None if aux_scalars is None else tuple(type(s) for s in aux_scalars)
    return metas, aliasing, aux, scalar_types, constants


def info() -> Any:
    """The launch memo's statistics (`fused_attn.memo.MemoInfo`)."""
    return _LAUNCHES.info()


def lookup(owner: int, sig: tuple) -> Any:
    return _LAUNCHES.get((owner, sig))


def store(owner: int, sig: tuple, entry: Any) -> None:
    _LAUNCHES.put((owner, sig), entry)


class _Watched:
    """FA4's forward compile cache while one call is recorded: lookups and stores pass through;
    each kernel it hands out notes its launch before running it."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.launches: List[Tuple[Callable[..., Any], tuple, dict]] = []

    def __contains__(self, key: Any) -> bool:
        return key in self.cache

    def __setitem__(self, key: Any, value: Any) -> None:
        self.cache[key] = value

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        kernel = self.cache[key]

        def noted(*args: Any, **kwargs: Any) -> Any:
            self.launches.append((kernel, args, kwargs))
            return kernel(*args, **kwargs)

        return noted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def _is_cute_scalar(x: Any) -> bool:
    kind = type(x)
    return kind.__module__.startswith("cutlass") and any(c.__name__ == "Numeric" for c in kind.__mro__)


def _constant(x: Any) -> bool:
    if x is None or type(x) in (bool, int, float, str):
        return True
    if type(x) is tuple:
        return all(_constant(e) for e in x)
    return _is_cute_scalar(x)


def record(run: Callable[[], Any], own: Sequence[Optional[torch.Tensor]],
           aux_tensors: Optional[list], aux_scalars: Optional[tuple]) -> Union[Launch, Host, None]:
    """Run `run()` (one `_flash_attn_fwd` call with these own tensors and aux data) with FA4's
    forward compile cache watched; the recorded `Launch`, a `Host` with the reason, or None
    when another thread's FA4 call ran meanwhile (nothing to conclude: record again later)."""
    fn = install.module()._flash_attn_fwd
    with install.cache_swap_lock():
        real = fn.compile_cache
        watched = _Watched(real)
        fn.compile_cache = watched
        try:
            run()
        finally:
            fn.compile_cache = real
    return _template(watched.launches, own, aux_tensors, aux_scalars)


def _template(launches: list, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
              aux_scalars: Optional[tuple]) -> Union[Launch, Host, None]:
    if not launches:
        return Host("FA4 launched no forward kernel for this signature (an empty problem)")
    if len(launches) > 1:
        return None
    kernel, args, kwargs = launches[0]
    if kwargs:
        return Host(f"FA4 launched its kernel with keyword arguments {sorted(kwargs)}")
    views = [None if t is None else _view(t) for t in own]
    aux_kind = install.module().utils.AuxData
    arguments: list = []
    for a in args:
        if isinstance(a, torch.Tensor):
            try:
                arguments.append(_Slot(views.index(_view(a))))
            except ValueError:
                return Host(f"FA4 launched with a tensor of its own making {tuple(a.shape)} {a.dtype} "
                            "(scheduler metadata or split-KV partials)")
        elif type(a) is aux_kind:
            if not _identical(a.tensors, aux_tensors):
                return Host("FA4 launched with aux tensors that are not the call's own")
            if not _identical(a.scalars, aux_scalars):
                return Host("FA4 launched with aux scalars that are not the call's own")
            arguments.append(_AuxSlot(aux_kind))
        elif _constant(a):
            arguments.append(a)
        else:
            return Host(f"FA4 launched with a {type(a).__name__} argument")
    slots = {s.index for s in arguments if type(s) is _Slot}
    if not {_OUT, _LSE} <= slots:
        return Host("FA4's kernel does not write the call's out and lse buffers")
    return Launch(kernel, tuple(arguments))


def _identical(got: Optional[Sequence[Any]], own: Optional[Sequence[Any]]) -> bool:
    """Element-wise `is` (never `==`: tensors compare element-wise); None counts as empty."""
    got, own = tuple(got or ()), tuple(own or ())
    return len(got) == len(own) and all(x is y for x, y in zip(got, own))


def launch(entry: Launch, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
           aux_scalars: Optional[tuple]) -> None:
    """Launch a recorded kernel with this call's own tensors and aux data (on the current stream,
    as FA4's function does)."""
    args = []
    for a in entry.arguments:
        kind = type(a)
        if kind is _Slot:
            args.append(own[a.index].detach())
        elif kind is _AuxSlot:
            args.append(a.kind(aux_tensors, tuple(aux_scalars) if aux_scalars else None))
        else:
            args.append(a)
    entry.kernel(*args)
