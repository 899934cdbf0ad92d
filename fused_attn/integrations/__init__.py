"""Integrations of fused_attn with other libraries; each imports its library lazily.

    transformers: `fused_attn.integrations.transformers.register()` makes
                  `attn_implementation="fused_attn"` available to Hugging Face models.
"""

__all__ = ["transformers"]


def __getattr__(name: str):
    if name == "transformers":
        from . import transformers

        return transformers
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
