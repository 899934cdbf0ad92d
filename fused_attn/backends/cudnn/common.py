"""Pieces shared by the dense and thd cuDNN runners: graphs of a plan, operand descriptions,
input copies for layouts cuDNN cannot take, grad_out layout, sink logits."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...cache import GRAPH_CACHE, GraphKey, Loaded, intern_key
from . import persist, runtime
from .graphs import CompiledGraph, build

__all__ = ["Graphs", "operand_description", "check_runtime_tensors", "grad_output", "sinks_view", "dropout_rng",
           "rng_views"]


def operand_description(operands: Dict[str, torch.Tensor]) -> tuple:
    """Structural description of graph operands for keys: names, shapes, strides, dtypes and
    which are CPU (pass-by-value); never values or ids."""
    return tuple(sorted((name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type == "cpu")
                        for name, t in operands.items() if name != "attn_scale"))


class Graphs:
    """The forward (and backward) graph keys of a plan; graphs live in the bounded GraphCache
    (looked up per call, so evicting a graph really frees it) and are rebuilt on a miss."""

    def __init__(self, fwd: GraphKey, bwd: Optional[GraphKey], lowering_mod: Any,
                 operand_templates: Dict[str, torch.Tensor], device_index: int,
                 bwd_lowering: Optional[Tuple[Any, Dict[str, torch.Tensor]]] = None) -> None:
        self.keys = {"fwd": intern_key(fwd), "bwd": None if bwd is None else intern_key(bwd)}
        fwd_parts = (lowering_mod, _templates(operand_templates))
        self.parts = {"fwd": fwd_parts,
                      "bwd": fwd_parts if bwd_lowering is None else (bwd_lowering[0], _templates(bwd_lowering[1]))}
        self.device_index = device_index
        self._builders = {d: self._builder(d, k) for d, k in self.keys.items() if k is not None}
        # variant key -> builder; bounded by its callers (one per power-of-two token bucket)
        self._variants: Dict[GraphKey, Callable[[], CompiledGraph]] = {}

    def _builder(self, direction: str, key: GraphKey) -> Callable[[], CompiledGraph]:
        mod, templates = self.parts[direction]

        def make() -> Any:
            with torch.cuda.device(key.device_index):
                handle = runtime.handle_for(key.device_index)
                store = GRAPH_CACHE.store
                if store is None:
                    return build(key, mod, templates, handle)
                compiled, loaded = persist.load_or_build(store, key, lambda: build(key, mod, templates, handle), handle)
                return Loaded(compiled) if loaded else compiled

        return make

    def get(self, direction: str) -> CompiledGraph:
        key = self.keys[direction]
        if key is None:
            raise RuntimeError("this call plan was made without gradients; no backward graph")  # pragma: no cover
        return GRAPH_CACHE.get_or_build(key, self._builders[direction])

    def build_all(self) -> None:
        """Build (or find) every graph of the plan now: a graph cuDNN declines refuses the plan."""
        from ...static import Refusal

        for direction, key in self.keys.items():
            if key is None:
                continue
            try:
                self.get(direction)
            except NotImplementedError as exc:
                raise Refusal(str(exc)) from None

    def run(self, direction: str, bind: Dict[str, Any]) -> None:
        runtime.execute(self.get(direction), bind, self.device_index)

    def run_variant(self, direction: str, key: GraphKey, bind: Dict[str, Any]) -> None:
        """Run `key`, a variant of the direction's key built from the same lowering (e.g. a
        backward sized for a token count). Raises NotImplementedError when cuDNN declines it."""
        builder = self._variants.get(key)
        if builder is None:
            builder = self._variants.setdefault(key, self._builder(direction, key))
        runtime.execute(GRAPH_CACHE.get_or_build(key, builder), bind, self.device_index)


def _templates(operands: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {n[3:]: t for n, t in operands.items() if n.startswith("sm:")}


def check_runtime_tensors(fmt: str, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """Fresh contiguous (format-order), 16-byte aligned copies: for the layouts cuDNN cannot take
    directly (a last dim with stride != 1, strides that are not multiples of 8 elements, a
    storage offset that breaks 16-byte alignment). The plan decides this once; see the runners."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t) for t in tensors)


def grad_output(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """grad_out in the output's strides (cuDNN's dO shares O's layout); a copy only if needed."""
    if grad_out.stride() == out.stride() and grad_out.data_ptr() % 16 == 0:
        return grad_out
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)


def sinks_view(problem: Any) -> Optional[Callable[[Optional[torch.Tensor]], torch.Tensor]]:
    """None without sinks; else a function giving this call's (1, H, 1, 1) fp32 sink logits
    (zeros for softmax_type="off-by-one", the given (H,) tensor for "learnable")."""
    if not problem.spec.has_sinks:
        return None
    h = problem.heads
    if problem.spec.softmax_type == "off-by-one":
        zeros = torch.zeros((1, h, 1, 1), dtype=torch.float32, device=problem.device)
        return lambda _sinks: zeros
    return lambda sinks: sinks.detach().to(torch.float32).contiguous().view(1, h, 1, 1)


def dropout_rng(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) (1, 1, 1, 1) int64 device tensors for cuDNN's Philox dropout, drawn from
    torch's RNG of `device` (reproducible with torch.manual_seed; capturable in CUDA graphs:
    a device-side draw, no host value)."""
    return rng_views(torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device))


def rng_views(rng: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(seed, offset) (1, 1, 1, 1) views of a (2,) int64 tensor."""
    return rng[0:1].view(1, 1, 1, 1), rng[1:2].view(1, 1, 1, 1)
