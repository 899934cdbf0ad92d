"""Error messages a newcomer meets first: each names the mistake and the fix."""

from __future__ import annotations

import pytest
import torch

import fused_attn
import score_mods as sm


def _bshd(*shape):
    return torch.randn(*shape)


def test_score_mod_factory_passed_uncalled():
    q = _bshd(1, 8, 2, 16)
    with pytest.raises(TypeError, match=r"score_mod=softcap is the factory; call it, e\.g\. score_mod=softcap\(30\.0\)"):
        fused_attn.dot_product_attention(q, q, q, score_mod=sm.softcap)
    with pytest.raises(TypeError, match=r"score_mod=causal is the factory; call it, e\.g\. score_mod=causal\(\)"):
        fused_attn.dot_product_attention(q, q, q, score_mod=sm.causal)
    with pytest.raises(TypeError, match=r"score_mod=alibi is the factory; call it, e\.g\. score_mod=alibi\(slopes\)"):
        fused_attn.DotProductAttention(2, 16)(q, q, q, score_mod=sm.alibi)


def test_own_function_is_still_traced():
    q = _bshd(1, 8, 2, 16)

    def plus_one(score, b, h, q_idx, kv_idx):
        return score + 1.0

    out = fused_attn.dot_product_attention(q, q, q, score_mod=plus_one, backend="reference")  # no flex compile
    assert out.shape == q.shape


def test_cu_seqlens_on_the_meta_device():
    t = torch.randn(16, 2, 16)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the query's device cpu, got meta"):
        fused_attn.dot_product_attention(t, t, t, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="must be on the query's device cpu, got meta"):
        fused_attn.varlen_attn(t, t, t, cu, cu, 8, 8)


def test_zero_heads():
    z = _bshd(2, 8, 0, 16)
    with pytest.raises(ValueError, match=r"need at least one head, got 0 query and 0 key/value heads"):
        fused_attn.dot_product_attention(z, z, z)


def test_int64_cu_seqlens_suggests_int():
    t = torch.randn(16, 2, 16)
    cu = torch.tensor([0, 8, 16])
    with pytest.raises(TypeError, match=r"got torch\.int64 \(convert it with cu_seqlens_q\.int\(\)\)"):
        fused_attn.dot_product_attention(t, t, t, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(TypeError, match=r"cu_seqlens_q\.int\(\)"):
        fused_attn.varlen_attn(t, t, t, cu, cu, 8, 8)
    rows = torch.randn(1, 16, 2, 16)
    with pytest.raises(TypeError, match=r"cu_seq\.int\(\)"):
        fused_attn.doc_packed_attn(rows, rows, rows, torch.tensor([[0, 8, 16]]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_warmup_without_a_gpu():
    cfg = dict(batch=1, seqlen_q=128, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"warmup: configs\[0\]\['device'\] is 'cuda'.*no usable CUDA device"):
        fused_attn.graph_cache.warmup([cfg])


def test_bhsd_tensors_under_the_default_format():
    attn = fused_attn.DotProductAttention(4, 16)
    q = torch.randn(2, 4, 32, 16)  # (B, H, S, D)
    with pytest.raises(ValueError, match=r"has 32 heads.*a bhsd tensor\? pass qkv_format='bhsd'"):
        attn(q, q, q)
    assert fused_attn.DotProductAttention(4, 16, qkv_format="bhsd")(q, q, q).shape == q.shape
