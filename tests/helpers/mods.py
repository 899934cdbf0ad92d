"""score_mods and ScoreMod subclasses that several test files exercise, and the cuDNN quirk lookup
GPU tests use to expect a refusal exactly where a quirk entry says."""

from __future__ import annotations

import torch

from score_mods.base import ScoreMod


class IndexMod(ScoreMod):
    """score * 0.9 + 0.1 h - 0.05 |q_idx - kv_idx| + 0.2 b: exercises every index argument."""

    name = "test_index_mod"
    cache_key = ("test_index_mod",)

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return score * 0.9 + 0.1 * h - 0.05 * (q_idx - kv_idx).abs() + 0.2 * b

    def lower_forward(self, graph, score, operands, memo):
        raise NotImplementedError


def quirk_applies(name: str) -> bool:
    """Whether the cuDNN quirk `name` applies on the cuDNN this process loaded (GPU tests: a
    refusal is expected exactly where its entry says)."""
    from fused_attn.backends.cudnn import quirks, version

    return quirks.applies(name, version.backend_version())


def axis_bias_mods(w: torch.Tensor):
    """(query_bias, key_bias): `score + w[q_idx]` and `score + w[kv_idx]` bound to the (S,) table w:
    the two sides of cuDNN 9.19's key-axis backward fault (tests of the refusal boundary)."""
    from score_mods import TensorParam, score_mod

    @score_mod(name="query_bias")
    def query_bias(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[q_idx]

    @score_mod(name="key_bias")
    def key_bias(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[kv_idx]

    return query_bias(w=w), key_bias(w=w)


def batch_table_mods(lens: torch.Tensor, w: torch.Tensor):
    """Mods reading per-sequence tables: {name: (mod, reads a (B, 1|H, 1, 1) operand outside an add)}.
    lens (B,) int32 key counts, w (B,) float; `mask_bkv` reads the same bound as a (B, S) table."""
    import math

    from score_mods import TensorParam, score_mod, where

    @score_mod(name="add_b")
    def add_b(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score + w[b]

    @score_mod(name="mul_b")
    def mul_b(score, b, h, q_idx, kv_idx, w=TensorParam("float")):
        return score * w[b]

    @score_mod(name="mask_b")
    def mask_b(score, b, h, q_idx, kv_idx, lens=TensorParam("int")):
        return where(kv_idx < lens[b], score, -math.inf)

    @score_mod(name="mask_bkv")
    def mask_bkv(score, b, h, q_idx, kv_idx, keep=TensorParam("int")):
        return where(keep[b, kv_idx] != 0, score, -math.inf)

    keep = (torch.arange(256, device=lens.device)[None, :] < lens[:, None]).to(torch.int32)
    return {"add_b": (add_b(w=w), False), "mul_b": (mul_b(w=w), True), "mask_b": (mask_b(lens=lens), True),
            "mask_bkv": (mask_bkv(keep=keep), False)}
