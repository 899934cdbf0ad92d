"""fused_attn: attention for PyTorch on cuDNN frontend SDPA graphs, with score_mods written once.

The public names load on first use (PEP 562), so `import fused_attn` and `python -m fused_attn
--help` do not import torch; the first attribute access imports the whole API at once.
"""

from . import _wiring  # noqa: F401  (installs fused_attn.distributed's entry points as core hooks; no torch)
from ._version import __version__

__all__ = [
    "DotProductAttention",
    "dot_product_attention",
    "explain",
    "Explanation",
    "FallbackWarning",
    "varlen_attn",
    "varlen_attn_out",
    "AuxRequest",
    "doc_packed_attn",
    "graph_cache",
]


def _load() -> None:
    import importlib

    graph_cache = importlib.import_module(".graph_cache", __name__)
    from .functional import dot_product_attention, explain
    from .module import DotProductAttention
    from .plan import Explanation, FallbackWarning
    from .varlen import AuxRequest, doc_packed_attn, varlen_attn, varlen_attn_out

    globals().update({name: value for name, value in locals().items() if name in __all__})


def __getattr__(name: str):
    if name in __all__:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'fused_attn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
