"""GPU: score_mods at shifted positions (`score_mods.positions.at_positions`, what context
parallelism's blocks run) on cuDNN, against the float64 attention whose scores the unshifted mod
modifies at the global positions: out, lse and dq / dk / dv, with the project's tolerance rule
(`fused_attn.testing`). One process, one GPU: the blocks are those a 2- or 4-rank ring computes."""

import math

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.testing import assert_close, bound_from, grad_tolerances, reference_attention, tolerance
from score_mods.positions import at_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

B, H, D, L = 2, 4, 64, 1024
DT = torch.bfloat16


def _mods():
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(1, H, L, L, generator=g).cuda()
    return {
        "causal": sm.causal(),
        "alibi": sm.alibi(sm.alibi_slopes(H).cuda()),
        "window": sm.sliding_window(200, 0),
        "bottom_right": sm.causal_bottom_right(),
        "softcap_causal": sm.compose(sm.softcap(30.0), sm.causal()),
        "alibi_causal": sm.compose(sm.alibi(sm.alibi_slopes(H).cuda()), sm.causal()),
        "bias": sm.post_scale_bias(bias),
    }


# (q offset, q rows, kv offset, kv columns): diagonal, below-diagonal and partly-masked blocks
BLOCKS = [(256, 256, 256, 256), (768, 256, 0, 512), (128, 128, 192, 256)]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: "q{}+{}_kv{}+{}".format(*b))
@pytest.mark.parametrize("name", ["alibi", "alibi_causal", "bias", "bottom_right", "causal", "softcap_causal",
                                  "window"])
def test_blocks_at_global_positions_on_cudnn(name, block):
    mod = _mods()[name]
    qo, sq, ko, skv = block
    g = torch.Generator(device="cuda").manual_seed(sum(block) + len(name))
    q, k, v, do = (torch.randn(B, H, n, D, generator=g, device="cuda") for n in (sq, skv, skv, sq))
    glen = torch.tensor(L, device="cuda").view(1, 1, 1, 1)
    fn = lambda s, b, h, qi, ki: mod.eager(s, b, h, qi + qo, ki + ko, glen, glen)  # noqa: E731
    scale = 1 / math.sqrt(D)
    leaves = [t.to(DT).requires_grad_() for t in (q, k, v)]
    out, lse = fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", backend="cudnn", return_lse=True,
                                                score_mod=at_positions(mod, qo, ko, L, L))
    grads = torch.autograd.grad(out, leaves, do.to(DT))
    exact, exact_lse = reference_attention(q, k, v, scale, score_fn=fn)
    _, same_lse = reference_attention(q, k, v, scale, score_fn=fn, dtype=DT, softmax_dtype=torch.float32)
    assert_close(out, exact, tolerance(q, k, v, scale, DT, score_fn=fn), f"{name} out")
    assert_close(lse, exact_lse, bound_from(same_lse, exact_lse, DT), f"{name} lse")
    want, bounds = grad_tolerances(q, k, v, do, scale, DT, score_fn=fn)
    for n, got, w, bound in zip("qkv", grads, want, bounds):
        assert torch.isfinite(got).all(), f"{name} d{n}: non-finite values"
        assert_close(got, w, bound, f"{name} d{n}")


def test_blocks_share_one_graph_on_cudnn():
    """Every block of a position mod runs one cached graph: offsets are bound per call."""
    mod = sm.alibi(sm.alibi_slopes(H).cuda())
    q = torch.randn(1, H, 256, D, device="cuda", dtype=DT)
    run = lambda qo: fused_attn.dot_product_attention(q, q, q, qkv_format="bhsd", backend="cudnn",  # noqa: E731
                                                      score_mod=at_positions(mod, qo, 0, L, L))
    first = run(0)
    builds = fused_attn.graph_cache.cache_info().builds
    others = [run(qo) for qo in (256, 512)]
    assert fused_attn.graph_cache.cache_info().builds == builds
    assert not torch.equal(first, others[0]) and not torch.equal(others[0], others[1])
