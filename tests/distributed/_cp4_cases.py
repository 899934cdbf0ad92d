"""Context-parallel cases for 4 spawned gloo processes (CPU, float32 against float64; see _cp_compare).

Every rank runs every case in the same order (collectives stay in step) and records
{case: [ok, message]}; test_cp4.py looks each case up. Shapes are tiny (S = 32 or packed
sequences of 16 / 8 / 24 tokens): the cases check the algorithms, not the kernels.
"""

from __future__ import annotations

import itertools
import re
import traceback
from typing import Any, Callable, Dict, List

import torch

from _cp_compare import Ctx, compare
from helpers.dist_cases import expect_error

COMMS = ("ring", "all_gather", "all_to_all")


def _dense(ctx: Ctx, h: int = 8, hkv: int = 4, s: int = 32) -> List[torch.Tensor]:
    return [ctx.randn(2, s, h, 16), ctx.randn(2, s, hkv, 16), ctx.randn(2, s, hkv, 16)]


def _packed(ctx: Ctx, n: int):
    u = 2 * n  # load-balanced: each length a multiple of 2N
    lens = [2 * u, 0, u, 3 * u]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    t = int(cu[-1])
    inputs = [ctx.randn(t, 8, 16), ctx.randn(t, 4, 16), ctx.randn(t, 4, 16)]
    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    return inputs, cu, kw


def _mod(which: str, h: int, s: int, ctx: Ctx):
    """(kw, mod_leaf, make_mod) of a score_mod that reads positions."""
    import score_mods as sm

    if which == "alibi":  # slopes per head: cut to the local heads under all_to_all
        return dict(attn_mask_type="causal"), sm.alibi_slopes(h).double(), sm.alibi
    if which == "causal_mod":
        return dict(score_mod=sm.causal()), None, None
    # a trained (1, H, S, S) bias indexed by q_idx / kv_idx: its gradient is summed over the group
    return dict(attn_mask_type="causal"), ctx.randn(1, h, s, s), sm.post_scale_bias


def dense_case(comm: str, mask: str = "causal", softcap: bool = False, fmt: str = "bshd") -> Callable:
    def case(ctx: Ctx) -> None:
        from score_mods import softcap as sc

        inputs = _dense(ctx)
        if fmt != "bshd":
            inputs = [t.transpose(1, 2).contiguous() if fmt == "bhsd" else t.transpose(0, 1).contiguous()
                      for t in inputs]
        kw: Dict[str, Any] = dict(attn_mask_type=mask, qkv_format=fmt)
        if softcap:
            kw["score_mod"] = sc(3.0)
        compare(ctx, inputs, kw, comm, fmt=fmt)
    return case


def position_case(comm: str, which: str, fmt: str = "bshd") -> Callable:
    """Score_mods that read positions (reference backend: these CPU engines serve them)."""
    def case(ctx: Ctx) -> None:
        if fmt == "thd":
            inputs, cu, kw = _packed(ctx, ctx.world)
            s = kw["max_seqlen_q"]
        else:
            inputs, cu, kw, s = _dense(ctx), None, {}, 32
        more, leaf, make = _mod(which, 8, s, ctx)
        kw.update(more, backend="reference")
        compare(ctx, inputs, kw, comm, fmt=fmt, cu=cu, mod_leaf=leaf, make_mod=make)
    return case


def packed_case(comm: str, mask: str = "causal") -> Callable:
    def case(ctx: Ctx) -> None:
        inputs, cu, kw = _packed(ctx, ctx.world)
        compare(ctx, inputs, dict(kw, attn_mask_type=mask), comm, fmt="thd", cu=cu)
    return case


def window_all_to_all(ctx: Ctx) -> None:
    """Head-parallel serves sliding windows (its call sees the whole sequence)."""
    compare(ctx, _dense(ctx), dict(attn_mask_type="causal", window_size=(5, 0)), "all_to_all")


def contiguous_layout(ctx: Ctx) -> None:
    for comm in COMMS:
        compare(ctx, _dense(ctx), dict(attn_mask_type="causal"), comm, layout="contiguous")


def auto_choice(ctx: Ctx) -> None:
    """cp_comm='auto': all_to_all when both head counts divide by N, ring otherwise; it runs and is right."""
    fd = ctx.fd
    q, k = fd.shard_sequence(ctx.randn(2, 32, 8, 16)), fd.shard_sequence(ctx.randn(2, 32, 4, 16))
    assert fd.choose_cp_comm(q, k, attn_mask_type="causal")[0] == "all_to_all"
    k2 = fd.shard_sequence(ctx.randn(2, 32, 2, 16))
    comm, why = fd.choose_cp_comm(q, k2, attn_mask_type="causal")
    assert comm == "ring" and "2 key/value heads must both be multiples of 4" in why, why
    comm, why = fd.choose_cp_comm(q, k, score_mod=lambda s, b, h, qi, ki: s * (h + 1.0))
    assert comm == "ring" and "reads the head index arithmetically" in why, why
    compare(ctx, _dense(ctx), dict(attn_mask_type="causal"), "auto")
    compare(ctx, _dense(ctx, 8, 2), dict(attn_mask_type="causal"), "auto")  # GQA 8 / 2: the ring


def heads_errors(ctx: Ctx) -> None:
    fd = ctx.fd
    q, k = fd.shard_sequence(ctx.randn(2, 32, 6, 16)), fd.shard_sequence(ctx.randn(2, 32, 6, 16))
    expect_error(NotImplementedError, r"6 query heads and 6 key/value heads must both be multiples of 4",
                 lambda: fd.context_parallel_attention(q, k, k, None, "all_to_all"))
    q8, k8 = fd.shard_sequence(ctx.randn(2, 32, 8, 16)), fd.shard_sequence(ctx.randn(2, 32, 8, 16))
    expect_error(NotImplementedError, r"reads the head index arithmetically", lambda: fd.context_parallel_attention(
        q8, k8, k8, None, "all_to_all", score_mod=lambda s, b, h, qi, ki: s * (h + 1.0)))
    expect_error(ValueError, r"cp_comm='heads' is not supported; accepted: 'ring', 'all_gather', 'all_to_all', "
                 r"'auto'", lambda: fd.context_parallel_attention(q8, k8, k8, None, "heads"))
    expect_error(NotImplementedError, r"sliding windows.*\(cp_comm='all_to_all' does\)",
                 lambda: fd.context_parallel_attention(q8, k8, k8, None, "ring", window_size=(3, 0)))


def cases(world: int) -> Dict[str, Callable]:
    out: Dict[str, Callable] = {}
    for comm in COMMS:
        out[f"dense_{comm}_causal_gqa"] = dense_case(comm)
        out[f"dense_{comm}_no_mask_softcap"] = dense_case(comm, "no_mask", softcap=True)
        out[f"thd_{comm}_causal"] = packed_case(comm)
        out[f"dense_{comm}_alibi"] = position_case(comm, "alibi")
        out[f"thd_{comm}_alibi"] = position_case(comm, "alibi", "thd")
    out["thd_all_to_all_no_mask"] = packed_case("all_to_all", "no_mask")
    out["dense_all_to_all_sbhd"] = dense_case("all_to_all", fmt="sbhd")
    out["dense_all_to_all_bhsd"] = dense_case("all_to_all", fmt="bhsd")
    out["dense_ring_bhsd"] = dense_case("ring", fmt="bhsd")
    for comm in COMMS:
        out[f"dense_{comm}_causal_mod"] = position_case(comm, "causal_mod")
        out[f"dense_{comm}_bias_grad"] = position_case(comm, "bias_grad")
    out["window_all_to_all"] = window_all_to_all
    out["contiguous_layout"] = contiguous_layout
    out["auto_choice"] = auto_choice
    out["heads_errors"] = heads_errors
    return out


def run_cases(ctx: Ctx, table: Dict[str, Callable], barrier: Callable[[], None]) -> Dict[str, list]:
    results: Dict[str, list] = {}
    for name, fn in table.items():
        ctx.seed(name)
        try:
            fn(ctx)
            results[name] = [True, ""]
        except Exception as e:  # noqa: BLE001 - reported by the test
            results[name] = [False, f"rank {ctx.rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"]
        barrier()
    return results


def worker(rank: int, world: int, port: int, outdir: str, selection: str) -> None:
    """Spawned entry: run the cases whose names match `selection` (a regex)."""
    import warnings

    import torch.distributed as dist
    from _spawn import init_gloo, write_result

    warnings.simplefilter("ignore")
    init_gloo(rank, world, port)
    try:
        table = {k: v for k, v in cases(world).items() if re.search(selection, k)}
        write_result(outdir, rank, run_cases(Ctx(rank, world), table, dist.barrier))
    finally:
        dist.destroy_process_group()
