"""fused_attn on torch.distributed: DTensor sharding rules and context parallelism.

DTensor (batch / head sharding, no communication):
    dot_product_attention, varlen_attn, doc_packed_attn, module_forward   (see `dtensor`)
    the op strategies of fused_attn::attn_fwd / attn_bwd                  (see `sharding`)
Context parallelism (the sequence sharded over a process group):
    context_parallel_attention, ContextParallelAttention                 (see `context_parallel`)
    choose_cp_comm: what cp_comm="auto" picks                            (see `cp_strategy`)
    shard_sequence, unshard_sequence                                     (see `cp_shard`)

Importing this package registers the DTensor sharding rules (idempotent).
"""

from . import sharding
from .context_parallel import CP_COMMS, ContextParallelAttention, context_parallel_attention
from .cp_layout import LAYOUTS
from .cp_shard import shard_sequence, unshard_sequence
from .cp_strategy import choose_cp_comm
from .dtensor import doc_packed_attn, dot_product_attention, module_forward, varlen_attn

sharding.register()

__all__ = ["dot_product_attention", "varlen_attn", "doc_packed_attn", "module_forward", "context_parallel_attention",
           "ContextParallelAttention", "shard_sequence", "unshard_sequence", "CP_COMMS", "LAYOUTS", "sharding",
           "choose_cp_comm"]
