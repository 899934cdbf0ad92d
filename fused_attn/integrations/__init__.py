"""Integrations of fused_attn with other libraries; each imports its library lazily.

    transformers: `fused_attn.integrations.transformers.register()` makes
                  `attn_implementation="fused_attn"` available to Hugging Face models.
"""

import importlib

__all__ = ["transformers"]


def __getattr__(name: str):
    # import_module, not `from . import name`: the latter asks this module for the attribute
    # first, which calls this function again (endless recursion before the submodule loads)
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
