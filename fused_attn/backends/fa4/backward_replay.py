"""Recorded backward passes of flash-attn-4: the same kernels on the same kind of buffers, without
FA4's host path on every call.

`_flash_attn_bwd` spends several hundred microseconds of host time per call choosing tiles,
building compile keys and allocating its buffers, and then launches a few compiled kernels
(preprocess, the main kernel, one to three postprocess conversions, with sinks a reduction).
Everything it decides is fixed by the call's signature (`launch.signature`: the tensors'
metadata and aliasing, the aux data's types, the other arguments). So the first call of a
signature runs FA4's function with every compile cache of its interface watched and the torch
operations it runs logged (`record`); later calls allocate the same buffers and launch the same
kernels with their own tensors and aux data (`replay`).

A recording is kept only where it repeats the very same work:
- every torch operation FA4 ran was an allocation (empty / zeros / full, `_like` or not), an
  in-place fill of a buffer it had just allocated and not yet handed to a kernel, or a view;
- every kernel launch was positional, through one of the interface's compile caches, and each
  tensor argument is one of the call's own (exactly: the same memory, shape, strides and dtype)
  or a view of a buffer FA4 allocated in this call; the aux data is the call's aux tensors and
  scalars; every other argument is an immutable constant;
- what FA4 returned are buffers it allocated in this call;
- no kernel was compiled during the call (a first call records again on the next one).
Anything else (a copy of a misaligned input, varlen tile sums computed on the host, ...) keeps
the signature on FA4's own path, with the reason (`launch.Host`). A stored recording holds no
tensor: allocations are kept as (shape, strides, dtype, device, fill).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import install
from .launch import Host, _constant, _identical, _view

__all__ = ["Replay", "OWN_NAMES", "record", "replay"]

#: positions of the call's own tensors in `own` (the order `record` / `replay` take them)
OWN_NAMES = ("q", "k", "v", "out", "dout", "lse", "cu_seqlens_q", "cu_seqlens_k", "learnable_sink")

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
    """A recorded backward: allocations and launches in FA4's order, and which buffers it returns."""
    steps: tuple
    results: tuple


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


def record(run: Callable[[], tuple], own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
           aux_scalars: Optional[tuple]) -> Tuple[tuple, Union[Replay, Host, None]]:
    """Run `run()` (one `_flash_attn_bwd` call with these own tensors and aux data) watched:
    (its gradients, the `Replay` / a `Host` with the reason / None when a kernel was compiled
    during the call, so that nothing is concluded yet)."""
    interface = install.module()
    log, compiled = _Log(), []
    with install.cache_swap_lock():
        fns = _caches(interface)
        real = [fn.compile_cache for fn in fns]
        for fn, cache in zip(fns, real):
            fn.compile_cache = _Watched(cache, log, threading.get_ident(), compiled)
        try:
            with log:
                grads = run()
        finally:
            for fn, cache in zip(fns, real):
                fn.compile_cache = cache
    if compiled:
        return grads, None
    if log.other is not None:
        return grads, Host(f"FA4's backward ran {log.other} on its host path")
    try:
        return grads, _template(log.steps, grads, own, aux_tensors, aux_scalars, interface.utils.AuxData)
    except _Refused as why:
        return grads, Host(str(why))


def _template(steps: list, grads: tuple, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
              aux_scalars: Optional[tuple], aux_kind: type) -> Replay:
    views = [None if t is None else _view(t) for t in own]
    buffers: List[torch.Tensor] = []   # FA4's allocations, in order (alive for the recording only)
    positions: List[int] = []          # where each buffer's allocation is in `out`
    launched: set = set()              # buffers handed to a kernel so far
    out: List[Any] = []

    def buffer_of(t: torch.Tensor) -> int:
        base = t.untyped_storage().data_ptr()
        for i in range(len(buffers) - 1, -1, -1):
            if buffers[i].untyped_storage().data_ptr() == base and buffers[i].device == t.device:
                return i
        raise _Refused(f"FA4's backward passed a tensor {tuple(t.shape)} {t.dtype} that is neither the "
                       "call's own nor allocated in the call")

    def argument(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            view = _view(a)
            if view in views:
                return _Own(views.index(view))
            i = buffer_of(a)
            launched.add(i)
            return _Buffer(i, tuple(a.shape), tuple(a.stride()), a.storage_offset(), view == _view(buffers[i]))
        if type(a) is aux_kind:
            if not (_identical(a.tensors, aux_tensors) and _identical(a.scalars, aux_scalars)):
                raise _Refused("FA4's backward launched with aux data that is not the call's own")
            return _Aux(aux_kind)
        if _constant(a):
            return a
        if isinstance(a, (tuple, list)):  # a tuple subclass is a named tuple: rebuilt from positions
            return _Container(type(a), tuple(argument(e) for e in a))
        raise _Refused(f"FA4's backward launched a kernel with a {type(a).__name__} argument")

    for step in steps:
        if step[0] == "alloc":
            t, fill = step[1], step[2]
            if not isinstance(t, torch.Tensor):
                raise _Refused("an allocation of FA4's backward returned no tensor")
            buffers.append(t)
            positions.append(len(out))
            out.append(_Alloc(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, fill))
        elif step[0] == "fill":
            i = buffer_of(step[1])
            if i in launched or _view(step[1]) != _view(buffers[i]):
                raise _Refused("FA4's backward filled a buffer after a kernel used it, or a part of one")
            out[positions[i]] = out[positions[i]]._replace(fill=step[2])
        else:
            _, kernel, args, kwargs = step
            if kwargs:
                raise _Refused(f"FA4's backward launched a kernel with keyword arguments {sorted(kwargs)}")
            arguments = tuple(argument(a) for a in args)
            per_call = tuple(i for i, a in enumerate(arguments) if type(a) in (_Own, _Buffer, _Aux, _Container))
            out.append(_Launch(kernel, arguments, per_call))
    results = []
    for g in grads:
        i = buffer_of(g) if isinstance(g, torch.Tensor) else -1
        if i < 0 or _view(g) != _view(buffers[i]):
            raise _Refused("FA4's backward returned something other than buffers it allocated")
        results.append(i)
    return Replay(tuple(out), tuple(results))


def replay(entry: Replay, own: Sequence[Optional[torch.Tensor]], aux_tensors: Optional[list],
           aux_scalars: Optional[tuple]) -> tuple:
    """Allocate the recorded buffers and launch the recorded kernels with this call's own tensors
    and aux data (on the current stream, as FA4's function does); the gradients it returns."""
    buffers: List[torch.Tensor] = []
    aux_scalars = tuple(aux_scalars) if aux_scalars else None

    def argument(a: Any) -> Any:
        kind = type(a)
        if kind is _Own:
            return own[a.index].detach()
        if kind is _Buffer:
            base = buffers[a.index]
            return base if a.whole else base.as_strided(a.shape, a.stride, a.offset)
        if kind is _Aux:
            return a.kind(aux_tensors, aux_scalars)
        if kind is _Container:
            items = [argument(e) for e in a.items]
            return a.kind(items) if a.kind in (tuple, list) else a.kind(*items)
        return a

    for step in entry.steps:
        if type(step) is _Alloc:
            t = torch.empty_strided(step.shape, step.stride, dtype=step.dtype, device=step.device)
            if step.fill is not None:
                t.fill_(step.fill)
            buffers.append(t)
        else:
            args = list(step.arguments)
            for i in step.per_call:
                args[i] = argument(args[i])
            step.kernel(*args)
    return tuple(buffers[i] for i in entry.results)
