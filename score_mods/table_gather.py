"""Reading a small trained table at computed indices, with its gradient as a weighted histogram.

A learned relative-position table (T5: (H, 32) entries) is read at every (b, h, q_idx, kv_idx) of a
materialized bias: B * H * Sq * Skv reads of a few hundred entries. The default backward of
advanced indexing (`index_put_` with accumulate) sorts the indices and then adds each entry's run
of repeats serially, which on CUDA makes a table's gradient cost far more than the attention
itself when the runs are long (hundreds of thousands of repeats per entry). `torch.bincount` with
weights sums the same terms per entry as a histogram (on CUDA, one privatized histogram per block
in shared memory for tables this small), the same sum in another order.

`gather(table, indices)` uses it where that cost arises and it is safe to: a CUDA table that
requires grad, with at most `MAX_ENTRIES` entries, every tensor a plain (or Parameter) tensor (not
fake, meta or functorch-wrapped), torch not compiling, no CUDA graph being captured (bincount
reads its output size on the host) and deterministic algorithms off (CUDA's weighted bincount is
not deterministic). Otherwise, and for reading alone, it is `table[indices]` (on CPU both
backwards add serially; measured there, the histogram's extra index pass made a T5 training step
slower). A second derivative (create_graph) sums with `index_add`, which has one.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["MAX_ENTRIES", "gather", "histogram_backward_applies", "histogram_gather"]

#: the largest table whose gradient is summed as a histogram (fp32 entries fit a block's shared memory)
MAX_ENTRIES = 8192

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    return (type(t) in _PLAIN and t.device.type != "meta"
            and not torch._C._functorch.is_functorch_wrapped_tensor(t))


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def histogram_backward_applies(table: torch.Tensor, indices: Sequence[torch.Tensor]) -> bool:
    """Whether `gather` sums `table`'s gradient as a histogram for these index tensors."""
    if not _on_cuda(table) or not (table.requires_grad and torch.is_grad_enabled()):
        return False
    # first, as dynamo traces this: under torch.compile (flex_attention's own, too) no question
    # about functorch or CUDA may be asked (dynamo cannot trace them), and plain indexing is kept
    if torch.compiler.is_compiling() or torch.are_deterministic_algorithms_enabled():
        return False
    # fake CUDA tensors exist without a CUDA runtime: rule them out before asking CUDA anything
    if table.numel() > MAX_ENTRIES or not (_plain(table) and all(_plain(i) for i in indices)):
        return False
    return not torch.cuda.is_current_stream_capturing()  # bincount reads its size on the host


def _linear_index(indices: Sequence[torch.Tensor], shape: Tuple[int, ...]) -> torch.Tensor:
    """The flat (row-major) entry index of every read, broadcast over the index tensors; negative
    indices count from the end, as in `table[indices]`."""
    flat = None
    stride = 1
    for idx, size in reversed(list(zip(indices, shape))):
        idx = torch.where(idx < 0, idx + size, idx)
        term = idx * stride if stride != 1 else idx
        flat = term if flat is None else flat + term
        stride *= size
    return flat


class _HistogramGather(torch.autograd.Function):
    """table[indices] forward; backward: d table = bincount(read positions, weights=grad)."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, *indices: torch.Tensor) -> torch.Tensor:
        ctx.table_shape, ctx.table_dtype, ctx.entries = tuple(table.shape), table.dtype, table.numel()
        ctx.save_for_backward(*indices)
        return table[indices]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        indices = ctx.saved_tensors
        shape = ctx.table_shape
        flat = _linear_index(indices, shape).expand(grad.shape).reshape(-1)
        weights = grad.reshape(-1)
        if weights.dtype not in (torch.float32, torch.float64):
            weights = weights.float()
        if torch.is_grad_enabled():  # create_graph: a differentiable sum (bincount has no derivative)
            summed = weights.new_zeros(ctx.entries).index_add(0, flat, weights)
        else:
            summed = torch.bincount(flat, weights=weights, minlength=ctx.entries)
        return (summed.view(shape).to(ctx.table_dtype),) + (None,) * len(indices)


def histogram_gather(table: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """table[indices] whose backward sums the table's gradient with torch.bincount, on any device."""
    return _HistogramGather.apply(table, *indices)


def gather(table: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """table[indices] (one index tensor per dim, broadcastable, on the table's device); a small
    trained CUDA table's gradient is summed as a histogram (module docstring)."""
    indices = tuple(indices)
    if histogram_backward_applies(table, indices):
        return histogram_gather(table, indices)
    return table[indices]
