"""The engine contract, and the one place that chooses an engine (eager and compiled calls alike).

An engine runs attention problems (`static.StaticProblem`: a resolved spec plus the facts of the
call's tensors). Each one is an object with:

    name: str                                   "cudnn", "reference", ...
    auto_devices: tuple                         device types for which backend="auto" considers it
    unavailable() -> Optional[str]              why it cannot run on this machine at all, or None
    refusal(problem) -> Optional[str]           from metadata only: why it cannot run `problem`
    make_runner(problem) -> Runner              what a plan needs (may raise static.Refusal)
    saved_shape(make_problem, query_rows) -> tuple   the fp32 tensor its forward saves (fake tensors;
                                                make_problem() builds the StaticProblem if needed)
    op_saved(saved, query) -> Tensor            that tensor, from a runner's saved tensors (compiled op)
    traced_refusal(device_type, dtype, head_dim, head_dim_v) -> Optional[str]
                                                what torch.compile can know at trace time
    grad_param_names(spec) -> set               score_mod tensor parameters it differentiates
    route(spec, mod, q, k, v, sinks, sig)       optional: a call it serves other than through one
                                                plan (cuDNN: rectangles of a band), or None
    split_halves: tuple                         optional: the halves of a training call its runners
                                                serve for a pair of engines ("forward": they give
                                                `forward_lse`; "backward": their `backward_with_lse`
                                                gives the whole backward); none when absent

A runner (one per plan) is documented by `Runner`. Engines never import each other; the core
imports this module, never an engine's internals. `register` plugs in another engine.

For backend="auto", a training call runs its forward on one engine and its backward on another
where the measured table says that pair is faster than any one engine (`engine_speed.split`,
`split_runner.SplitRunner`); `explain()` names both.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from . import engine_speed, engine_table, planning
from .split_runner import SplitRunner
from .static import Refusal, StaticProblem

__all__ = ["Engine", "Runner", "choose", "traced_choice", "names", "get", "register", "unregister", "route",
           "available", "clear_memos"]


@runtime_checkable
class Runner(Protocol):
    """What a plan runs. Shapes: out in the query's format; lse fp32 (B, H, Sq) dense / (H, Tq)
    thd; `saved` the tensors its backward needs (through save_for_backward), `state` the rest."""

    backend: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: Any, mod: Any,
                sinks: Optional[torch.Tensor], rng: Any = None, extras: Sequence[torch.Tensor] = (),
                dest: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor], tuple, Any]: ...

    def backward(self, state: Any, saved: tuple, grad_out: torch.Tensor) -> tuple: ...

    def backward_call(self, q, k, v, out, saved, varlen, mod, sinks, grad_out, rng=None) -> tuple: ...

    def backward_with_lse(self, q, k, v, out, lse, varlen, mod, sinks, grad_out, dest=None) -> tuple: ...

    def grad_inputs(self, mod: Any, sinks: Optional[torch.Tensor]) -> tuple: ...

    # optional, for the forward half of a split (engines whose split_halves has "forward"):
    # def forward_lse(self, saved: tuple) -> torch.Tensor   the forward's fp32 lse, layout as above

    def op_grads(self, mod: Any, sinks: Optional[torch.Tensor], grads: tuple) -> list: ...


@runtime_checkable
class Engine(Protocol):
    name: str
    auto_devices: Tuple[str, ...]

    def unavailable(self) -> Optional[str]: ...

    def refusal(self, problem: StaticProblem) -> Optional[str]: ...

    def make_runner(self, problem: StaticProblem) -> Any: ...

    def saved_shape(self, make_problem: Any, query_rows: int) -> Tuple[int, ...]: ...

    def op_saved(self, saved: tuple, query: torch.Tensor) -> torch.Tensor: ...

    def traced_refusal(self, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> Optional[str]: ...

    def grad_param_names(self, spec: Any) -> set: ...


_lock = threading.Lock()
_loaded: Dict[str, Any] = {}
_broken: Dict[str, str] = {}
names = engine_table.names


def get(name: str) -> Any:
    """The engine called `name` (NotImplementedError when its module cannot be imported)."""
    engine = _loaded.get(name)
    if engine is not None:
        return engine
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _broken:
            raise NotImplementedError(_broken[name])
        where = engine_table.location(name)
        if not where:
            raise ValueError(f"backend={name!r} names no registered engine; accepted: {list(engine_table.names())}")
        module, _, attr = where.partition(":")
        try:
            engine = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            _broken[name] = f"the {name} engine cannot be imported ({exc})"
            raise NotImplementedError(_broken[name]) from None
        _loaded[name] = engine
        return engine


def register(engine: Any, before: Optional[str] = None) -> None:
    """Plug in `engine` (an object with the `Engine` attributes), tried by backend="auto" before
    the engine named `before` (default: before the reference, which runs everything)."""
    if not isinstance(engine, Engine):
        raise TypeError(f"register: {engine!r} lacks the Engine attributes (see fused_attn.engines.Engine)")
    name = engine.name
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register: an engine's name must be a non-empty str other than 'auto', got {name!r}")
    with _lock:
        engine_table.add(name, "reference" if before is None else before)
        _loaded[name] = engine
    _forget_plans()


def unregister(name: str) -> None:
    """Remove an engine `register` added (the built-in ones stay)."""
    with _lock:
        engine_table.remove(name)
        _loaded.pop(name, None)
        _broken.pop(name, None)
    _forget_plans()


def _forget_plans() -> None:
    """Plans made with the old set of engines must not be reused."""
    planning.clear_plans()


def clear_memos() -> None:
    """Ask every loaded engine to forget its own memoized decisions (`clear_memos`, optional)."""
    for engine in tuple(_loaded.values()):
        hook = getattr(engine, "clear_memos", None)
        if hook is not None:
            hook()


def available(name: str) -> bool:
    """Whether engine `name` imports and can run on this machine."""
    try:
        return get(name).unavailable() is None
    except NotImplementedError:
        return False


def _why_not(name: str, problem: StaticProblem) -> Optional[str]:
    try:
        engine = get(name)
    except NotImplementedError as exc:
        return str(exc)
    return engine.refusal(problem) or engine.unavailable()  # the problem's own reason first


def _build(name: str, problem: StaticProblem, build: bool) -> Tuple[Any, Optional[str]]:
    """(runner or True when not building, None) or (None, why)."""
    why = _why_not(name, problem)
    return (None, why) if why is not None else _make(name, problem, build)


def _make(name: str, problem: StaticProblem, build: bool) -> Tuple[Any, Optional[str]]:
    """`_build` for an engine whose `refusal` already passed this problem."""
    if not build:
        return True, None
    try:
        return get(name).make_runner(problem), None
    except Refusal as exc:
        return None, str(exc)


def choose(problem: StaticProblem, build: bool = True) -> Tuple[str, str, Any]:
    """(engine name, reason, runner) for `problem`; NotImplementedError when nothing can run it.
    build=False decides from metadata only and returns no runner (fake tensors, tracing)."""
    requested = problem.spec.backend
    if requested != "auto":
        runner, why = _build(requested, problem, build)
        if runner is None:
            way_out = "" if requested == "reference" else "; use backend='reference' (PyTorch math) or backend='auto'"
            raise NotImplementedError(f"backend={requested!r} cannot run this problem: {why}{way_out}")
        return requested, f"backend={requested!r} was requested", runner if build else None
    declined = []
    candidates = []
    for name in engine_table.engine_names():
        if problem.device.type not in _auto_devices(name):
            declined.append(f"{name}: not used by backend='auto' for {problem.device.type} tensors")
            continue
        why = _why_not(name, problem)
        if why is not None:
            declined.append(f"{name} cannot serve it: {why}")
            continue
        candidates.append(name)
    order, why_order = engine_speed.rank(problem, candidates)
    pair = _pair(problem, candidates)
    if pair is not None:
        got, why_not = _build_pair(problem, pair, build)
        if got is not None:
            return got
        declined.append(why_not)
    for name in order:
        runner, why = _make(name, problem, build)
        if runner is not None:
            notes = ([why_order] if why_order else []) + declined
            reason = f"{name} serves it" + (f" ({'; '.join(notes)})" if notes else "")
            return name, reason, runner if build else None
        declined.append(f"{name} cannot serve it: {why}")
    raise NotImplementedError("no engine can run this problem: " + "; ".join(declined))


def _halves(name: str) -> Tuple[str, ...]:
    try:
        return tuple(getattr(get(name), "split_halves", ()))
    except NotImplementedError:
        return ()


def _pair(problem: StaticProblem, candidates: List[str]) -> Optional[engine_speed.Split]:
    """The measured (forward engine, backward engine) pair for a training call whose whole
    backward is dq, dk, dv (no sinks, no score_mod tensor parameters, no dropout), or None."""
    spec = problem.spec
    if not problem.needs_grad or spec.has_sinks or problem.mod_tensors or spec.dropout_p or len(candidates) < 2:
        return None
    return engine_speed.split(problem, [c for c in candidates if "forward" in _halves(c)],
                              [c for c in candidates if "backward" in _halves(c)], candidates)


def _may_have_empty_rows(problem: StaticProblem) -> bool:
    """Whether a query row may attend no key (its lse -inf): a score_mod other than a library
    mask or softcap, a band that leaves out the diagonal or sits in a non-square problem, or thd
    with separate query and key lengths."""
    spec = problem.spec
    mod = spec.score_mod
    native = None if mod is None else mod.native_band
    if mod is not None and native is None and mod.base_name != "softcap":
        return True
    if spec.is_packed and not problem.same_lengths:
        return True
    bounds = [(b.left, b.right) for b in (spec.band,) if b is not None] + ([tuple(native[:2])] if native else [])
    square = spec.is_packed or problem.seqlen_q == problem.seqlen_kv
    return any(not square or any(x is not None and x < 0 for x in pair) for pair in bounds)


def _build_pair(problem: StaticProblem, pair: engine_speed.Split, build: bool) -> Tuple[Any, str]:
    """((engine, reason, runner), "") for the pair's split runner, or (None, why it was not used)."""
    reason = f"{pair.forward} serves the forward and {pair.backward} the backward ({pair.reason})"
    if not build:
        return (pair.forward, reason, None), ""
    forward, why = _make(pair.forward, problem, True)
    backward, why_b = _make(pair.backward, problem, True) if forward is not None else (None, None)
    if forward is None or backward is None:
        return None, f"the measured pair {pair.forward} + {pair.backward} was not built: {why or why_b}"
    if not hasattr(forward, "forward_lse") or not hasattr(backward, "backward_with_lse"):
        return None, f"the measured pair {pair.forward} + {pair.backward} lacks forward_lse / backward_with_lse"
    return (pair.forward, reason, SplitRunner(forward, backward, _may_have_empty_rows(problem))), ""


def _auto_devices(name: str) -> Tuple[str, ...]:
    try:
        return tuple(get(name).auto_devices)
    except NotImplementedError:
        return ()


def traced_choice(backend: str, device_type: str, dtype: torch.dtype, head_dim: int, head_dim_v: int) -> str:
    """The engine a compiled call of `backend` runs on, from what is known at trace time."""
    if backend != "auto":
        return backend
    for name in engine_table.engine_names():
        if device_type not in _auto_devices(name) or not available(name):
            continue
        if get(name).traced_refusal(device_type, dtype, head_dim, head_dim_v) is None:
            return name
    return "reference"


def route(name: str, spec: Any, mod: Any, query: Any, key: Any, value: Any, sinks: Optional[torch.Tensor],
          sig: tuple) -> Any:
    """Engine `name`'s own way to serve this dense call (cuDNN: rectangles of a band), as a
    callable `run(spec, mod, query, key, value, sinks)`, or a plan (`planning`), or None for the
    plain path. `name`: the engine that serves the call (`plan.routed_engine`: for
    backend='auto', the one `choose` picks)."""
    try:
        engine = get(name)
    except NotImplementedError:
        return None
    hook = getattr(engine, "route", None)
    if hook is None or engine.unavailable() is not None:
        return None
    return hook(spec, mod, query, key, value, sinks, sig)
