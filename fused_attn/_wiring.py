"""Installs `fused_attn.distributed`'s entry points into the core's extension hooks
(`fused_attn.extensions`) and tells `fused_attn.planning` how to load the planner; neither the
distributed package nor the planner is imported before first use."""

from __future__ import annotations

from typing import Any

from . import extensions, planning

__all__: list = []


def _dtensor_call(*args: Any, **kwargs: Any) -> Any:
    from .distributed import dtensor

    return dtensor.dtensor_call(*args, **kwargs)


def _dtensor_module_forward(*args: Any, **kwargs: Any) -> Any:
    from .distributed import dtensor

    return dtensor.module_forward(*args, **kwargs)


def _dtensor_doc_packed(*args: Any, **kwargs: Any) -> Any:
    from .distributed import dtensor

    return dtensor.doc_packed_attn(*args, **kwargs)


def _module_context_parallel(*args: Any, **kwargs: Any) -> Any:
    from .distributed.context_parallel import module_context_parallel

    return module_context_parallel(*args, **kwargs)


def _cp_choices() -> tuple:
    """(the cp_comm values, the cp_layout values) context parallelism accepts."""
    from .distributed.context_parallel import CP_COMMS
    from .distributed.cp_layout import LAYOUTS

    return CP_COMMS, LAYOUTS


for _name, _fn in (("dtensor_call", _dtensor_call), ("dtensor_module_forward", _dtensor_module_forward),
                   ("dtensor_doc_packed", _dtensor_doc_packed), ("module_context_parallel", _module_context_parallel),
                   ("cp_choices", _cp_choices)):
    extensions.provide(_name, _fn)


def _load_planner() -> None:
    from . import plan  # noqa: F401  (installs itself into fused_attn.planning)


planning.load_with(_load_planner)
