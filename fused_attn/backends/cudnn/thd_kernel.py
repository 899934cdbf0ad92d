"""A packed batch's preparation in one Triton kernel (the fast form of `varlen.prepare_unchecked`).

From cu_seqlens (B+1,) int32 on the GPU it writes, in one launch, what a ragged cuDNN graph
binds and the value checks read: the lengths seq_q / seq_kv (B_bucket,), the extended token
offsets (B_bucket+1,) when the batch is bucketed, the ragged element offsets token offset x
multiplier (B_bucket+1,) per multiplier, and one int32 flag, nonzero iff every value check holds
(each row starts at 0, is non-decreasing, ends at its token count, lengths <= max_seqlen). The
torch-op form of the same preparation takes eight small kernels: on H200 hosts (sync-isolated
host time per call, `benchmarks/varlen_step_profile.py`) 147-190 us against 64-69 us for this
form with its buffer, views and the caller's device assertion (the launch alone: 17 us).

It serves rows without padded offsets, at most three multipliers on the query side (q / o, and
the per-token Stats rows) and two on the key side, and batches up to
`MAX_BATCH_BUCKET`; anything else, CPU tensors, and a torch without Triton (torch's CUDA wheels
ship it) get None and use the torch-op form. Both forms give the same values bit for bit (GPU
test over the value-check cases and random batches).

Two costs of the call itself are cut (host us per call on H200, one run: the JIT launch 18, the
separate `torch._assert_async` 14.5): with ``check=True`` the kernel asserts the flag itself
(`tl.device_assert`, the same asynchronous device assertion, in the same launch), and once a
recipe's compiled kernel has been launched both through Triton's JIT entry and directly
(`CompiledKernel`'s own launcher, on the current torch stream) with equal results, later calls
use the direct launch, which skips the JIT's per-call argument binding and cache lookup. The
comparison runs outside CUDA graph capture (it reads the two results on the host once).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import torch

from ...cache_registry import register_lru

__all__ = ["prepare", "available", "MAX_BATCH_BUCKET"]

#: one program covers the whole row: batches whose bucket exceeds this use the torch-op form
MAX_BATCH_BUCKET = 4095
_MIN_BLOCK = 16
_CONSTEXPRS = ("BLOCK", "KV_ROW", "EXT", "NQ", "NKV", "CHECK")


@register_lru("cudnn.thd_kernel")
@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    """The jitted kernel, or None without Triton (imported on first use: it is slow to import)."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - absent or broken: the torch-op form gives the same values
        return None

    # runtime ints are not specialized: every token count and limit would otherwise be a new
    # compilation class (value 1, multiples of 16, the rest); debug=True keeps tl.device_assert
    # (compiled out otherwise)
    @triton.jit(debug=True, do_not_specialize=["batch", "bb", "tokens_q", "tokens_kv", "limit_q", "limit_kv", "mq0",
                                               "mq1", "mq2", "mkv0", "mkv1"])
    def prepare_rows(cu_q, cu_kv, out, batch, bb, tokens_q, tokens_kv, limit_q, limit_kv, mq0, mq1, mq2, mkv0, mkv1,
                     BLOCK: tl.constexpr, KV_ROW: tl.constexpr, EXT: tl.constexpr, NQ: tl.constexpr,
                     NKV: tl.constexpr, CHECK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        row = i <= bb  # the (bb + 1,) offsets
        seq = i < bb  # the (bb,) lengths
        here = tl.minimum(i, batch)  # bucket slots repeat the last offset: length 0
        after = tl.minimum(i + 1, batch)
        cq = tl.load(cu_q + here, mask=row, other=0)
        lq = tl.load(cu_q + after, mask=row, other=0) - cq
        bad = ((i < batch) & ((lq < 0) | (lq > limit_q))) | ((i == 0) & (cq != 0)) | ((i == batch) & (cq != tokens_q))
        tl.store(out + i, lq, mask=seq)
        p = bb
        if KV_ROW:
            ck = tl.load(cu_kv + here, mask=row, other=0)
            lk = tl.load(cu_kv + after, mask=row, other=0) - ck
            bad = bad | ((i < batch) & ((lk < 0) | (lk > limit_kv))) | ((i == 0) & (ck != 0))
            bad = bad | ((i == batch) & (ck != tokens_kv))
            tl.store(out + p + i, lk, mask=seq)
            p += bb
        else:  # one row serves both sides: it must end at both token counts
            ck = cq
            bad = bad | ((i == batch) & (cq != tokens_kv))
        if EXT:
            tl.store(out + p + i, cq, mask=row)
            p += bb + 1
        tl.store(out + p + i, cq * mq0, mask=row)
        p += bb + 1
        if NQ >= 2:
            tl.store(out + p + i, cq * mq1, mask=row)
            p += bb + 1
        if NQ == 3:
            tl.store(out + p + i, cq * mq2, mask=row)
            p += bb + 1
        if NKV >= 1:
            tl.store(out + p + i, ck * mkv0, mask=row)
            p += bb + 1
        if NKV == 2:
            tl.store(out + p + i, ck * mkv1, mask=row)
            p += bb + 1
        ok = tl.sum(bad.to(tl.int32), axis=0) == 0
        if CHECK:
            tl.device_assert(ok, "fused_attn: invalid cu_seqlens: each must start at 0, be non-decreasing, end at "
                                 "the token count, give lengths <= max_seqlen")
        tl.store(out + p, ok.to(tl.int32))

    return prepare_rows, triton.next_power_of_2


def available() -> bool:
    """Whether Triton is importable here (the kernel is then used for CUDA rows)."""
    return _kernel() is not None


class _Recipe:
    """What one (layout, shared row or not) needs per call: the launch's constant arguments,
    the outputs' order and sizes in the one int32 buffer, and (per check mode) the verified
    direct launcher of the compiled kernel."""

    __slots__ = ("size", "sizes", "names", "consts", "mults", "meta", "ext", "direct", "picks")

    def __init__(self, layout: Any, kv_row: bool, next_pow2: Any) -> None:
        bb = layout.batch_bucket
        self.ext = bb != layout.batch
        nq = len(layout.q_mults)
        # one row serving both sides: key offsets the query side writes are not written twice
        nkv = 0 if not kv_row and set(layout.kv_mults) <= set(layout.q_mults) else len(layout.kv_mults)
        self.consts = (layout.batch, bb)
        self.mults = (layout.q_mults + (0,) * (3 - nq)
                      + ((layout.kv_mults + (0,) * (2 - nkv)) if nkv else (0, 0)))
        self.meta = dict(BLOCK=max(_MIN_BLOCK, next_pow2(bb + 1)), KV_ROW=kv_row, EXT=self.ext, NQ=nq, NKV=nkv)
        # the kernel's write order: seq_q, [seq_kv], [tok_q], q offsets, kv offsets, ok
        names = ["seq_q"] + (["seq_kv"] if kv_row else []) + (["tok_q"] if self.ext else [])
        names += [("q", m) for m in layout.q_mults] + [("kv", m) for m in layout.kv_mults[:nkv]]
        self.names = tuple(names) + ("ok",)
        self.sizes = tuple(bb if n in ("seq_q", "seq_kv") else 1 if n == "ok" else bb + 1 for n in self.names)
        self.size = sum(self.sizes)
        self.direct: dict = {}  # check mode -> (launcher, constexpr values), once verified
        at = {n: i for i, n in enumerate(self.names)}
        offsets = []
        for side, mults in (("q", layout.q_mults), ("kv", layout.kv_mults)):
            for m in mults:
                offsets.append(((side, m), at[(side, m)] if (side, m) in at else at[("q", m)]))
        # (seq_q, seq_kv or None: seq_q's, tok_q or None: the caller's row, offsets, ok) positions
        self.picks = (at["seq_q"], at.get("seq_kv"), at.get("tok_q"), tuple(offsets), at["ok"])

    def meta_for(self, check: bool) -> dict:
        return dict(self.meta, CHECK=check)


def prepare(layout: Any, cu_q: torch.Tensor, cu_kv: torch.Tensor, tokens: Tuple[int, int],
            limits: Tuple[int, int], check: bool = False) -> Optional[tuple]:
    """(seq_q, seq_kv, tok_q, offsets, ok) as `varlen.prepare_unchecked` makes them, from one
    launch; None where this kernel does not serve (see the module docstring). check=True: the
    kernel also asserts the flag on the device (the caller needs no assertion of its own)."""
    if not cu_q.is_cuda or len(layout.q_mults) > 3 or len(layout.kv_mults) > 2 or layout.batch_bucket > MAX_BATCH_BUCKET:
        return None
    got = _kernel()
    if got is None:
        return None
    kernel, next_pow2 = got
    kv_row = cu_kv is not cu_q
    recipe = layout._kernel_recipes.get(kv_row)
    if recipe is None:
        recipe = layout._kernel_recipes[kv_row] = _Recipe(layout, kv_row, next_pow2)
    # (n, 1, 1, 1) parts: the shape cuDNN's lengths and offsets take, split off in one call
    out = torch.empty((recipe.size, 1, 1, 1), dtype=torch.int32, device=cu_q.device)
    limit_q, limit_kv = limits if kv_row else (min(limits), min(limits))
    args = (cu_q, cu_kv, out, *recipe.consts, tokens[0], tokens[1], limit_q, limit_kv, *recipe.mults)
    device = cu_q.device.index
    if device != torch._C._cuda_getDevice():
        with torch.cuda.device(device):
            _launch(kernel, recipe, args, check, device)
    else:
        _launch(kernel, recipe, args, check, device)
    parts = out.split_with_sizes(recipe.sizes)
    i_seq_q, i_seq_kv, i_tok, i_offsets, i_ok = recipe.picks
    seq_q = parts[i_seq_q]
    seq_kv = seq_q if i_seq_kv is None else parts[i_seq_kv]
    tok_q = cu_q if i_tok is None else parts[i_tok].view(-1)
    return seq_q, seq_kv, tok_q, {key: parts[i] for key, i in i_offsets}, parts[i_ok]


def _launch(kernel: Any, recipe: _Recipe, args: tuple, check: bool, device: int) -> None:
    """One launch on the current stream: the verified direct launcher, else the JIT entry (which
    then verifies the direct launcher outside capture, see the module docstring)."""
    direct = recipe.direct.get(check)
    if direct is not None:
        launcher, constexprs = direct
        launcher(*args, *constexprs, stream=torch._C._cuda_getCurrentRawStream(device))
        return
    meta = recipe.meta_for(check)
    compiled = kernel[(1,)](*args, **meta)
    if check not in recipe.direct and not torch.cuda.is_current_stream_capturing():
        recipe.direct[check] = _verified_launcher(compiled, args, meta, device)


def _verified_launcher(compiled: Any, args: tuple, meta: dict, device: int) -> Optional[tuple]:
    """(launcher, constexpr values) of `compiled` if launching through it writes what the JIT
    launch just wrote into args[2] (compared on the host once), else None (the JIT entry stays)."""
    try:
        constexprs = tuple(meta[k] for k in _CONSTEXPRS)
        launcher = compiled[(1, 1, 1)]
        again = torch.empty_like(args[2])
        launcher(*args[:2], again, *args[3:], *constexprs, stream=torch._C._cuda_getCurrentRawStream(device))
        if torch.equal(again, args[2]):
            return launcher, constexprs
    except Exception:  # noqa: BLE001 - a Triton whose compiled kernels launch differently: keep the JIT entry
        pass
    return None
