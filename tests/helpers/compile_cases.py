"""A tiny transformer block whose attention is `fused_attn.DotProductAttention`, and the check of
compiled calls whose bias changes shape between calls: shared by tests/core/test_compile.py (reference
backend, CPU) and its GPU twin (cuDNN)."""

from __future__ import annotations

import math

import torch

import fused_attn
import score_mods as sm
from fused_attn import DotProductAttention


class Block(torch.nn.Module):
    """A tiny pre-norm causal transformer block whose attention is `fused_attn.DotProductAttention`
    (so masks compose into the score_mod exactly as users get them)."""

    def __init__(self, dim=32, heads=4, score_mod=None, backend="reference"):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.attn = DotProductAttention(heads, dim // heads, qkv_format="bshd", attn_mask_type="causal",
                                        score_mod=score_mod, backend=backend)

    def forward(self, x, cu=None, max_len=None):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        if cu is None:
            o = self.attn(q, k, v)
        else:
            flat = lambda t: t.reshape(b * s, self.heads, -1)
            o = self.attn(flat(q), flat(k), flat(v), qkv_format="thd", attn_mask_type="causal_bottom_right",
                          cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return x + self.proj(o.reshape(b, s, dim))


def check_compiled_bias_calls(device: str, backend: str, dtype: torch.dtype, s0: int) -> None:
    """A compiled function whose post_scale_bias changes shape between calls (another sequence
    length, a per-batch bias; built inside the function): out, dq, dk, dv and the bias gradient of
    each call against float64, with the project's rule. Shared with the GPU suite (cuDNN)."""
    from fused_attn.testing import assert_close, bound_from, reference_attention

    torch._dynamo.reset()
    gen = torch.Generator(device=device).manual_seed(s0)
    h, d = 4, 64
    for s, bb in ((s0, 1), (2 * s0, 1), (s0, 2)):
        q, k, v, do = (torch.randn(2, s, h, d, generator=gen, device=device) for _ in range(4))
        bias = torch.randn(bb, h, s, s, generator=gen, device=device)
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + [bias.clone().requires_grad_()]

        def f(a, b, c, bias=leaves[3]):
            return fused_attn.dot_product_attention(a, b, c, score_mod=sm.post_scale_bias(bias), backend=backend)

        out = torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves[:3])
        got = [out] + list(torch.autograd.grad(out, leaves, do.to(dtype)))

        def naive(dt):
            ts = [t.detach().to(dt).requires_grad_() for t in (q, k, v, bias)]
            o, _ = reference_attention(*(t.transpose(1, 2) for t in ts[:3]), 1 / math.sqrt(d),
                                       score_fn=lambda x, *_: x + ts[3].to(x.dtype), dtype=dt,
                                       softmax_dtype=torch.float64 if dt == torch.float64 else torch.float32)
            o = o.transpose(1, 2)
            return [o] + list(torch.autograd.grad(o, ts, do.to(dt)))

        exact, same = naive(torch.float64), naive(dtype)
        for name, g, e, n in zip(("out", "dq", "dk", "dv", "dbias"), got, exact, same):
            assert_close(g, e, bound_from(n, e, dtype), f"S={s} bias batch {bb}: {name}")
