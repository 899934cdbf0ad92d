"""fused_attn on torch.distributed: DTensor sharding rules and context parallelism.

Importing this package registers the DTensor sharding rules of the custom ops
``fused_attn::attn_fwd`` / ``attn_bwd`` (see `sharding`).
"""

from . import sharding
from .dtensor import doc_packed_attn, dot_product_attention, module_forward, varlen_attn

sharding.register()

__all__ = ["dot_product_attention", "varlen_attn", "doc_packed_attn", "module_forward", "sharding"]
