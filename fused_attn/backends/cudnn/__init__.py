"""The cuDNN backend: call plans served by cuDNN frontend SDPA graphs.

    refusal(problem) -> Optional[str]     why cuDNN cannot serve a plan (metadata only), or None
    make_runner(problem) -> runner        DenseRunner / ThdRunner; builds the plan's graphs now
                                          (a graph the frontend declines raises plan.Refusal)
    keys_bounded=True (both)              an internal packed call whose band ends every query
                                          inside its sequence's keys (see _key_tail_refusal)
    saved_shape(problem, rows) -> tuple   shape of the fp32 Stats the runner saves (fake tensors)

The frontend (`cudnn`) is imported only when a graph is built or run.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ...problem import Band
from . import quirks, version

__all__ = ["refusal", "make_runner", "saved_shape"]

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


def refusal(problem: Any, keys_bounded: bool = False) -> Optional[str]:
    """None if cuDNN can serve `problem` (a StaticProblem), else the reason. keys_bounded: the
    caller guarantees that the call's top-left band ends every query row inside its sequence's
    keys (kv_len >= q_len + right for each sequence), which no key-length mask then needs to
    enforce (internal packed calls whose geometry the library builds, `band_ragged`)."""
    spec = problem.spec
    if problem.device.type != "cuda":
        return f"the cuDNN backend needs CUDA tensors, got tensors on {problem.device}"
    if problem.dtype not in _DTYPES:
        return f"the cuDNN backend takes float16 or bfloat16 query/key/value, got {problem.dtype}"
    for name, dim in (("query/key", problem.head_dim), ("value", problem.head_dim_v)):
        if dim % 8 != 0 or dim > _MAX_HEAD_DIM:
            return f"the cuDNN backend needs a {name} head dim that is a multiple of 8 and <= {_MAX_HEAD_DIM}, got {dim}"
    if problem.seqlen_kv == 0 or problem.seqlen_q == 0:
        return "cuDNN graphs need at least one query and one key position (Sq or Skv is 0)"
    ver = version.backend_version()
    if (problem.needs_grad and problem.seqlen_q == 1 and problem.seqlen_kv == 1 and not problem.is_packed
            and quirks.applies("sq1_skv1_backward", ver)):
        return quirks.QUIRKS["sq1_skv1_backward"].refusal(ver, "a training call with Sq = Skv = 1")
    band = spec.band
    if (band is not None and band.bottom_right and spec.padding and problem.seqlen_q > problem.seqlen_kv):
        return (f"cuDNN's bottom-right band needs Sq <= Skv with padded batches, got Sq={problem.seqlen_q} > "
                f"Skv={problem.seqlen_kv}")
    mod = spec.score_mod
    if mod is not None:
        why = _mod_refusal(problem, mod, keys_bounded, ver)
        if why is not None:
            return why
    return version.unavailable_reason()


def _mod_refusal(problem: Any, mod: Any, keys_bounded: bool = False, ver: Optional[int] = None) -> Optional[str]:
    ver = version.backend_version() if ver is None else ver
    why = None if mod is None else mod.cudnn_unsupported
    if why:
        return why
    if problem.needs_grad and not mod.has_backward:
        return f"score_mod {mod.name!r} has no cuDNN backward (a raw callback without score_mod_bprop)"
    if problem.needs_grad and mod.irregular_mask and quirks.applies("irregular_mask_backward", ver):
        return quirks.QUIRKS["irregular_mask_backward"].refusal(
            ver, f"score_mod {mod.name!r} with gradients required (its mask reads a graph input along the keys)")
    if mod.needs_host_lengths and problem.has_lengths:
        return (f"score_mod {mod.name!r} compares positions against per-sequence lengths "
                "(bottom-right alignment), which cuDNN computes wrongly on packed or padded batches")
    if problem.spec.band is not None and problem.spec.band.bottom_right and problem.spec.padding:
        native = None if mod is None else mod.native_band
        if native is None:
            return ("a bottom-right mask together with a score_mod on padded batches: cuDNN refuses its own band "
                    "next to a score_mod and computes per-sequence offsets wrongly (pass the batch packed, thd)")
    score_part, bias_part = _parts(problem, mod)
    if (problem.has_lengths and score_part is not None and not _runs_as_band(score_part, problem)
            and not keys_bounded):
        why = _key_tail_refusal(problem, ver)
        if why is not None:
            if not problem.is_packed:
                return None if _padded_as_thd(problem) else why  # its packed form bounds the keys
            from .packed_dense import refusal as dense_refusal

            why_dense = dense_refusal(problem, refusal)  # the padded dense batch checks the rest
            return None if why_dense is None else f"{why} (the padded dense form that serves such calls: {why_dense})"
    plan = None if score_part is None or score_part.root is None else score_part.plan  # a traced mod's lowering
    batch_only = () if plan is None else plan.batch_broadcast_operands
    if batch_only and quirks.applies("batch_broadcast_operand", ver):
        return quirks.QUIRKS["batch_broadcast_operand"].refusal(
            ver, f"score_mod {mod.name!r} reads {', '.join(batch_only)} inside the graph in a mask or product")
    if problem.needs_grad and score_part is not None and quirks.applies("kv_broadcast_operand_backward", ver):
        kv_only = () if plan is None else plan.kv_broadcast_operands
        if kv_only:
            return quirks.QUIRKS["kv_broadcast_operand_backward"].refusal(
                ver, f"score_mod {mod.name!r} reads {', '.join(kv_only)} inside the graph with gradients required")
    facts = mod.trainable()
    axes = _tensor_axes(mod)
    bias_names = set() if bias_part is None else set(_tensor_axes(bias_part))
    for name, shape, _stride, dtype, _device, requires_grad in problem.mod_tensors:
        if (problem.is_packed and "b" in axes.get(name, ()) and shape[0] != 1
                and quirks.applies("ragged_batch_operand", ver)):
            return quirks.QUIRKS["ragged_batch_operand"].refusal(
                ver, f"score_mod tensor parameter {name!r} is indexed by the batch (sequence) index on a packed "
                     "(thd) batch")
        if problem.is_packed and name in bias_names:
            return (f"score_mod tensor parameter {name!r} is an additive bias over query/key positions of a packed "
                    "(thd) batch; pass it through a dense (padded) batch or use backend='reference'")
        if not (requires_grad and problem.needs_grad):
            continue
        fact = facts.get(name)
        if name not in bias_names or (fact is not None and not fact.bias_only):
            return (f"score_mod tensor parameter {name!r} requires grad, but cuDNN gives gradients only to an "
                    "additive bias term (score_mod(score) + g(tables, positions), as post_scale_bias)")
        if (score_part is not None and not _runs_as_band(score_part, problem)
                and quirks.applies("dbias_next_to_score_mod", ver)):
            return quirks.QUIRKS["dbias_next_to_score_mod"].refusal(
                ver, f"score_mod tensor parameter {name!r} requires grad next to another score_mod term")
    return None


def _parts(problem: Any, mod: Any) -> Tuple[Any, Any]:
    """(score part, bias part) of `mod` as the lowering splits it for this problem (bias part
    None when the mod goes to the callback whole)."""
    from .lowering import bias_mode, split

    trained = frozenset(t[0] for t in problem.mod_tensors if t[-1] and problem.needs_grad)
    return split(mod) if bias_mode(mod, trained) is not None else (mod, None)


def runs_as_dense(problem: Any) -> bool:
    """A packed problem whose score_mod callback the ragged graphs cannot bound: it runs as a
    zero-padded dense batch (`packed_dense`)."""
    mod = problem.spec.score_mod
    if not problem.is_packed or mod is None:
        return False
    score_part = _parts(problem, mod)[0]
    return (score_part is not None and not _runs_as_band(score_part, problem)
            and _key_tail_refusal(problem) is not None)


def _key_tail_refusal(problem: Any, ver: Optional[int] = None) -> Optional[str]:
    """Why a score_mod callback on a packed or padded batch would reach keys past a sequence's
    length, or None (quirk `ragged_key_tail_next_to_score_mod`: no key-length mask next to a
    score_mod, and per-sequence graph inputs are read wrongly, so no mask in the callback can
    bound the keys either). A top-left band with right bound 0 keeps query i on keys j <= i,
    inside the sequence exactly when no sequence has more queries than keys: guaranteed when
    queries and keys share one cu_seqlens tensor (self-attention, documents)."""
    ver = version.backend_version() if ver is None else ver
    if not quirks.applies("ragged_key_tail_next_to_score_mod", ver):
        return None
    band = problem.spec.band
    if band is not None and band.right == 0 and not band.bottom_right and problem.same_lengths:
        return None
    got = "no mask" if band is None else f"{band}" + ("" if problem.same_lengths else " with separate query and key "
                                                      "cu_seqlens")
    return quirks.QUIRKS["ragged_key_tail_next_to_score_mod"].refusal(
        ver, f"a score_mod on a packed (thd) or padded batch with {got} (cuDNN serves it only under a top-left "
             "causal mask or causal window over queries and keys of one cu_seqlens tensor)")


def _runs_as_band(score_part: Any, problem: Any) -> bool:
    """The non-bias part is a causal mask the lowering runs as cuDNN's own band (no callback)."""
    native = None if score_part is None else score_part.native_band
    band = problem.spec.band
    return native is not None and not problem.spec.padding and (band is None or band == Band(*native))


def _tensor_axes(mod: Any) -> dict:
    """{tensor parameter name: the index axes its reads depend on} of a traced mod ({} otherwise)."""
    root = None if mod is None else mod.root
    if root is None:
        return {}
    from score_mods import expr

    out: dict = {}
    for n in expr.topo_order(root):
        if n.op == "gather":
            out.setdefault(n.attr, set()).update(expr.reads(n).axes)
    return out


def make_runner(problem: Any, into: Any = None, keys_bounded: bool = False) -> Any:
    """The runner serving `problem` on cuDNN (graphs built now). into: the layouts of
    caller-owned outputs (`dense.Into`; dense problems only: the rectangles of a band);
    keys_bounded: a packed problem whose band keeps every query inside its keys (see `refusal`)
    runs on its ragged graph as is."""
    backend_version = version.check()
    if keys_bounded and problem.is_packed:
        from .thd import ThdRunner

        return ThdRunner(problem, backend_version)
    if into is not None:
        from .dense import DenseRunner

        if problem.is_packed or _padded_as_thd(problem):
            raise ValueError("make_runner: into= serves dense problems only")  # pragma: no cover - internal
        return DenseRunner(problem, backend_version, into)
    if runs_as_dense(problem):
        from .packed_dense import PackedAsDenseRunner

        return PackedAsDenseRunner(problem, backend_version)
    if problem.is_packed:
        from .thd import ThdRunner

        return ThdRunner(problem, backend_version)
    if _padded_as_thd(problem):
        from .padded import PaddedAsThdRunner

        return PaddedAsThdRunner(problem, backend_version)
    from .dense import DenseRunner

    return DenseRunner(problem, backend_version)


def _padded_as_thd(problem: Any) -> bool:
    """Dense padded plans run as packed sequences whenever the packed path can serve them (a
    score_mod the packed ragged graph cannot bound then runs as `packed_dense`'s padded dense
    batch with the lengths in cuDNN's bias input)."""
    if not problem.spec.padding:
        return False
    from .padded import thd_problem

    return refusal(thd_problem(problem)) is None


def saved_shape(problem: Any, query_rows: int) -> Tuple[int, ...]:
    """The fp32 Stats shape a runner saves: (B, H, Sq, 1) for dense graphs, (Tq, H, 1) for packed
    ones (one row per query token; dense padded plans run as packed sequences of B * Sq rows).
    query_rows: the query's first dim (Tq of a packed call)."""
    rows = query_rows
    if _padded_as_thd(problem):
        from .padded import thd_problem

        rows = problem.batch * problem.seqlen_q
        problem = thd_problem(problem)
    if runs_as_dense(problem) or not problem.is_packed:  # the dense graph's Stats
        return (problem.batch, problem.heads, problem.seqlen_q, 1)
    return (rows, problem.heads, 1)
