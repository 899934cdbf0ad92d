"""Recorded calls of flash-attn-4, replayed: the same kernels on the same kind of buffers, without
FA4's host path on every call.

`_flash_attn_fwd` and `_flash_attn_bwd` spend most of a call's host time choosing tiles,
building compile keys and allocating buffers, and then launch a few compiled kernels (the
forward: its kernel, for varlen its scheduler's tile sums first; the backward: a preprocess, the
main kernel, one to three postprocess conversions). Everything they decide is fixed by the call's
signature (`recorded.signature`). So a call of a signature runs FA4's function with every compile
cache of its interface watched and the torch operations it runs logged (`record`); later calls
allocate the same buffers and launch the same kernels with their own tensors and aux data
(`replay`).

A recording is kept only where it repeats the very same work:
- every torch operation FA4 ran was an allocation (empty / zeros / full, `_like` or not), an
  in-place fill of a buffer it had just allocated and not yet handed to a kernel, or a view;
- at least one kernel was launched, every launch positional, through one of the interface's
  compile caches, and each tensor argument is one of the call's own (exactly: the same memory,
  shape, strides and dtype) or a view of a buffer FA4 allocated in this call; the aux data is the
  call's aux tensors and scalars; every other argument is an immutable constant;
- what FA4 returned are the call's own tensors, whole buffers it allocated, or constants;
- no kernel was compiled during the call (a first call records again on the next one).
Anything else (a copy of a misaligned input, split-KV partials combined through a view of the
call's lse, ...) keeps the signature on FA4's own path, with the reason (`recorded.Host`). A stored
recording holds no tensor: allocations are kept as (shape, strides, dtype, device, fill).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import install
from .recorded import Host, view as _view

__all__ = ["Replay", "record", "replay"]

_aten = torch.ops.aten
#: allocations: op -> the fill they leave (None: uninitialized; ("arg", i): the op's positional argument i)
_ALLOCATIONS: Dict[Any, Any] = {
    _aten.empty.memory_format: None, _aten.empty_like.default: None, _aten.empty_strided.default: None,
    _aten.new_empty.default: None, _aten.new_empty_strided.default: None,
    _aten.zeros.default: 0, _aten.zeros_like.default: 0, _aten.new_zeros.default: 0,
    _aten.full.default: ("arg", 1), _aten.full_like.default: ("arg", 1), _aten.new_full.default: ("arg", 2),
}
_FILLS = {_aten.zero_.default, _aten.fill_.Scalar}
_VIEWS = {_aten.detach.default, _aten.alias.default, _aten.view.default, _aten._unsafe_view.default,
          _aten.permute.default, _aten.transpose.int, _aten.t.default, _aten.select.int, _aten.slice.Tensor,
          _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default,
          _aten.expand.default, _aten.as_strided.default, _aten.unflatten.int, _aten.flatten.using_ints}


class _Alloc(NamedTuple):
    """A buffer FA4 allocates: torch.empty_strided(shape, stride), then filled with `fill` (or not)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    fill: Optional[float]


class _Own(NamedTuple):
    """A tensor argument: the call's own tensor at `index` of `own`."""
    index: int


class _Buffer(NamedTuple):
    """A tensor argument: a view (shape, stride, storage offset) of the buffer allocated at
    `index`, or the buffer itself (`whole`)."""
    index: int
    shape: tuple
    stride: tuple
    offset: int
    whole: bool


class _Aux(NamedTuple):
    """The aux data argument, rebuilt per call from the call's aux tensors and scalars."""
    kind: type


class _Container(NamedTuple):
    """A tuple, list or named tuple (any tuple subclass) argument holding templated items."""
    kind: type
    items: tuple


class _Launch(NamedTuple):
    """A kernel launch: its arguments, and the positions among them rebuilt per call (the rest
    are constants passed as they are)."""
    kernel: Callable[..., Any]
    arguments: tuple
    per_call: tuple


class Replay(NamedTuple):
    """A recorded call: allocations and launches in FA4's order, and what it returns (templated
    like a launch's arguments)."""
    steps: tuple
    results: Any


def _is_cute_scalar(x: Any) -> bool:
    kind = type(x)
    return kind.__module__.startswith("cutlass") and any(c.__name__ == "Numeric" for c in kind.__mro__)


def _constant(x: Any) -> bool:
    if x is None or type(x) in (bool, int, float, str):
        return True
    if type(x) is tuple:
        return all(_constant(e) for e in x)
    return _is_cute_scalar(x)


def _identical(got: Optional[Sequence[Any]], own: Optional[Sequence[Any]]) -> bool:
    """Element-wise `is` (never `==`: tensors compare element-wise); None counts as empty."""
    got, own = tuple(got or ()), tuple(own or ())
    return len(got) == len(own) and all(x is y for x, y in zip(got, own))


class _Refused(Exception):
    """Raised while templating: the recording cannot be replayed (the message says why)."""


class _Log(TorchDispatchMode):
    """Logs the torch operations of one call on this thread: allocations with their outputs,
    fills of those buffers, views; anything else ends the recording's chances with its name.
    Operations inside a kernel launch (`in_kernel`) are the kernel's own: a replay repeats them."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: List[Any] = []          # ("alloc", tensor, fill) / ("fill", tensor, value) / ("launch", ...)
        self.other: Optional[str] = None
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.in_kernel:
            return result
        if func in _ALLOCATIONS:
            fill = _ALLOCATIONS[func]
            if type(fill) is tuple:
                fill = args[fill[1]] if len(args) > fill[1] else kwargs.get("fill_value")
            self.steps.append(("alloc", result, fill))
        elif func in _FILLS:
            self.steps.append(("fill", args[0], 0 if func is _aten.zero_.default else args[1]))
        elif func not in _VIEWS and self.other is None:
            self.other = str(func)
        return result


class _Watched:
    """One of FA4's compile caches while a call is recorded: lookups pass through, a store marks
    the call as compiling, each kernel handed out notes its launch (on the recording thread) in
    the log before running."""

    def __init__(self, cache: Any, log: _Log, thread: int, compiled: list) -> None:
        self.cache, self.log, self.thread, self.compiled = cache, log, thread, compiled

    def __contains__(self, key: Any) -> bool:
        return key in self.cache

    def __setitem__(self, key: Any, value: Any) -> None:
        self.compiled.append(key)
        self.cache[key] = value

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        kernel = self.cache[key]

        def noted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                return kernel(*args, **kwargs)
            self.log.steps.append(("launch", kernel, args, kwargs))
            self.log.in_kernel += 1
            try:
                return kernel(*args, **kwargs)
            finally:
                self.log.in_kernel -= 1

        return noted

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def _caches(interface: Any) -> List[Any]:
    """The interface's functions that launch kernels through a `compile_cache`."""
    return [fn for fn in vars(interface).values() if callable(fn) and hasattr(fn, "compile_cache")]


def record(run: Callable[[], Any], own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
           aux_scalars: Optional[tuple]) -> Tuple[Any, Union[Replay, Host, None]]:
    """Run `run()` (one call of FA4's `_flash_attn_fwd` / `_flash_attn_bwd` with these own
    tensors and aux data) watched: (what it returned, the `Replay` / a `Host` with the reason /
    None when a kernel was compiled during the call, so that nothing is concluded yet)."""
    interface = install.module()
    log, compiled = _Log(), []
    with install.cache_swap_lock():
        fns = _caches(interface)
        real = [fn.compile_cache for fn in fns]
        for fn, cache in zip(fns, real):
            fn.compile_cache = _Watched(cache, log, threading.get_ident(), compiled)
        try:
            with log:
                returned = run()
        finally:
            for fn, cache in zip(fns, real):
                fn.compile_cache = cache
    if compiled:
        return returned, None
    if log.other is not None:
        return returned, Host(f"FA4 ran {log.other} on its host path")
    try:
        return returned, _template(log.steps, returned, own, aux_tensors, aux_scalars, interface.utils.AuxData)
    except _Refused as why:
        return returned, Host(str(why))


class _Templating:
    """What templating one recording tracks: the call's own views, FA4's buffers (alive for the
    recording only) and which of them a kernel has used. A class, not closures: a recursive
    closure is a reference cycle, and a cycle would keep FA4's buffers (the gradients it returns
    among them) alive until the next garbage collection."""

    def __init__(self, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
                 aux_scalars: Optional[tuple], aux_kind: type) -> None:
        self.views = [None if t is None else _view(t) for t in own]
        self.buffers: List[torch.Tensor] = []   # FA4's allocations, in order
        self.launched: set = set()              # buffers handed to a kernel so far
        self.aux_tensors, self.aux_scalars, self.aux_kind = aux_tensors, aux_scalars, aux_kind

    def buffer_of(self, t: torch.Tensor) -> int:
        base = t.untyped_storage().data_ptr()
        for i in range(len(self.buffers) - 1, -1, -1):
            if self.buffers[i].untyped_storage().data_ptr() == base and self.buffers[i].device == t.device:
                return i
        raise _Refused(f"FA4 passed a tensor {tuple(t.shape)} {t.dtype} that is neither the "
                       "call's own nor allocated in the call")

    def argument(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            view = _view(a)
            if view in self.views:
                return _Own(self.views.index(view))
            i = self.buffer_of(a)
            self.launched.add(i)
            return _Buffer(i, tuple(a.shape), tuple(a.stride()), a.storage_offset(), view == _view(self.buffers[i]))
        if type(a) is self.aux_kind:
            if not (_identical(a.tensors, self.aux_tensors) and _identical(a.scalars, self.aux_scalars)):
                raise _Refused("FA4 launched with aux data that is not the call's own")
            return _Aux(self.aux_kind)
        if _constant(a):
            return a
        if isinstance(a, (tuple, list)):  # a tuple subclass is a named tuple: rebuilt from positions
            return _Container(type(a), tuple(self.argument(e) for e in a))
        raise _Refused(f"FA4 launched a kernel with a {type(a).__name__} argument")


def _template(steps: list, returned: Any, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
              aux_scalars: Optional[tuple], aux_kind: type) -> Replay:
    state = _Templating(own, aux_tensors, aux_scalars, aux_kind)
    buffers = state.buffers
    positions: List[int] = []          # where each buffer's allocation is in `out`
    out: List[Any] = []
    for step in steps:
        if step[0] == "alloc":
            t, fill = step[1], step[2]
            if not isinstance(t, torch.Tensor):
                raise _Refused("an allocation of FA4's returned no tensor")
            buffers.append(t)
            positions.append(len(out))
            out.append(_Alloc(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, fill))
        elif step[0] == "fill":
            i = state.buffer_of(step[1])
            if i in state.launched or _view(step[1]) != _view(buffers[i]):
                raise _Refused("FA4 filled a buffer after a kernel used it, or a part of one")
            out[positions[i]] = out[positions[i]]._replace(fill=step[2])
        else:
            _, kernel, args, kwargs = step
            if kwargs:
                raise _Refused(f"FA4 launched a kernel with keyword arguments {sorted(kwargs)}")
            arguments = tuple(state.argument(a) for a in args)
            per_call = tuple(i for i, a in enumerate(arguments) if type(a) in (_Own, _Buffer, _Aux, _Container))
            out.append(_Launch(kernel, arguments, per_call))
    if not any(type(step) is _Launch for step in out):
        raise _Refused("FA4 launched no kernel for this signature (an empty problem)")
    returned_items = returned if isinstance(returned, tuple) else (returned,)
    results = _Container(tuple, tuple(state.argument(r) for r in returned_items))
    for r in results.items:
        if type(r) is _Buffer and not r.whole:
            raise _Refused("FA4 returned a view of one of its buffers")
    return Replay(tuple(out), results)


def _rebuilt(a: Any, own: Sequence[Optional[torch.Tensor]], buffers: List[torch.Tensor],
             aux_tensors: Optional[list], aux_scalars: Optional[tuple]) -> Any:
    """A templated argument with this call's tensors and aux data (a module function, not a
    closure: see `_Templating`)."""
    kind = type(a)
    if kind is _Own:
        return own[a.index].detach()
    if kind is _Buffer:
        base = buffers[a.index]
        return base if a.whole else base.as_strided(a.shape, a.stride, a.offset)
    if kind is _Aux:
        return a.kind(aux_tensors, aux_scalars)
    if kind is _Container:
        items = [_rebuilt(e, own, buffers, aux_tensors, aux_scalars) for e in a.items]
        return a.kind(items) if a.kind in (tuple, list) else a.kind(*items)
    return a


def replay(entry: Replay, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
           aux_scalars: Optional[tuple]) -> tuple:
    """Allocate the recorded buffers and launch the recorded kernels with this call's own tensors
    and aux data (on the current stream, as FA4's function does); what FA4's function returns."""
    buffers: List[torch.Tensor] = []
    aux_scalars = tuple(aux_scalars) if aux_scalars else None
    for step in entry.steps:
        if type(step) is _Alloc:
            t = torch.empty_strided(step.shape, step.stride, dtype=step.dtype, device=step.device)
            if step.fill is not None:
                t.fill_(step.fill)
            buffers.append(t)
        else:
            args = list(step.arguments)
            for i in step.per_call:
                args[i] = _rebuilt(args[i], own, buffers, aux_tensors, aux_scalars)
            step.kernel(*args)
    return _rebuilt(entry.results, own, buffers, aux_tensors, aux_scalars)
