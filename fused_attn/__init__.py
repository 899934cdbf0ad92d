"""fused_attn: attention for PyTorch on cuDNN frontend SDPA graphs, with score_mods written once."""

from .functional import dot_product_attention, explain
from .module import DotProductAttention
from .plan import Explanation, FallbackWarning
from .varlen import AuxRequest, doc_packed_attn, varlen_attn, varlen_attn_out
from . import graph_cache
from . import _wiring  # noqa: F401  (installs fused_attn.distributed's entry points as core hooks)

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
__version__ = "0.1.0"
