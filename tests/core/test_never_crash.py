"""Never crash (CPU): bad input gets a clear error naming the argument, and a module's
configuration is read once per call (an assignment from another thread never tears a result)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn.layouts import to_logical
from fused_attn.testing import assert_close, reference_attention, tolerance
from helpers.attention import rand


@pytest.mark.parametrize("window", [(10 ** 30, 10 ** 30), (4, 2 ** 31), (-2, 0)])
def test_window_size_out_of_range_is_named(window):
    q = torch.randn(1, 8, 2, 8)
    bad = next(v for v in window if not -1 <= v < 2 ** 31)
    side = "left" if bad == window[0] else "right"
    match = rf"window_size {side} must be .*got {bad}; accepted: ints in \[-1, 2147483647\]"
    with pytest.raises(ValueError, match=match):
        fused_attn.dot_product_attention(q, q, q, window_size=window)
    with pytest.raises(ValueError, match=match):
        fused_attn.DotProductAttention(2, 8, window_size=window)


def test_thd_on_meta_tensors_traces_without_reading_values():
    """Meta tensors (a meta-device model): the thd call returns its output's metadata through the
    ops' fake implementations and reads no cu_seqlens value."""
    t = torch.empty(32, 2, 64, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 32], dtype=torch.int32, device="meta")
    out = fused_attn.dot_product_attention(t, t, t, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                           max_seqlen_q=22, max_seqlen_kv=22)
    assert out.shape == (32, 2, 64) and out.device.type == "meta" and out.dtype == torch.bfloat16


def test_forward_override_with_a_bad_qkv_format_is_named():
    q = torch.randn(1, 8, 2, 8)
    attn = fused_attn.DotProductAttention(2, 8)
    with pytest.raises(ValueError, match=r"qkv_format='x' is not supported; accepted: 'bshd', 'sbhd', 'bhsd', 'thd'"):
        attn(q, q, q, qkv_format="x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without a usable CUDA device")
def test_warmup_without_cuda_says_so():
    from fused_attn import graph_cache

    before = graph_cache.cache_info().builds
    cfg = dict(batch=1, seqlen_q=16, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"configs\[0\]\['device'\] is 'cuda' \(the default\).*no usable CUDA"):
        graph_cache.warmup([cfg])
    assert graph_cache.cache_info().builds == before


def test_warmup_names_a_bad_qkv_format_before_building():
    from fused_attn import graph_cache

    cfg = dict(batch=1, seqlen_q=16, num_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"configs\[1\]\['qkv_format'\] must be one of .*got 'x'"):
        graph_cache.warmup([cfg, dict(cfg, qkv_format="x")])


# ----------------------------------------------------------------------------- one configuration per call


def _window_out(q, left: int, right: int) -> torch.Tensor:
    return fused_attn.dot_product_attention(q, q, q, score_mod=sm.sliding_window(left, right), backend="reference")


def test_assignment_during_a_call_does_not_reach_that_call(monkeypatch):
    """A score_mod assigned while a call runs (here: from inside it) leaves that call on the
    configuration it started with; the next call uses the new one."""
    from score_mods.trace import TracedMod

    gen = torch.Generator().manual_seed(0)
    q = rand(gen, 1, 24, 2, 8, dtype=torch.float64)
    attn = fused_attn.DotProductAttention(2, 8, score_mod=sm.sliding_window(3, 0), backend="reference")
    eager = TracedMod.eager
    fired = []

    def swap_then_eval(self, *args):
        if not fired:
            fired.append(True)
            attn.score_mod = sm.sliding_window(0, 3)
        return eager(self, *args)

    monkeypatch.setattr(TracedMod, "eager", swap_then_eval)
    out = attn(q, q, q)
    assert fired
    monkeypatch.setattr(TracedMod, "eager", eager)
    assert torch.equal(out, _window_out(q, 3, 0))
    assert torch.equal(attn(q, q, q), _window_out(q, 0, 3))
    ql = to_logical(q, "bshd")
    mask = torch.ones(24, 24, dtype=torch.bool).tril().triu(-3)
    exact, _ = reference_attention(ql, ql, ql, 8 ** -0.5, mask)
    assert_close(to_logical(out, "bshd"), exact, tolerance(ql, ql, ql, 8 ** -0.5, torch.float64, mask), "out")


@pytest.mark.parametrize("seconds", [1.0, pytest.param(3.0, marks=pytest.mark.slow)])
def test_threads_calling_while_the_score_mod_changes_see_whole_configurations(seconds):
    gen = torch.Generator().manual_seed(1)
    q = rand(gen, 1, 16, 1, 8, dtype=torch.float64)
    mods = [sm.sliding_window(3, 0), sm.sliding_window(0, 3)]
    expected = [_window_out(q, 3, 0), _window_out(q, 0, 3)]
    attn = fused_attn.DotProductAttention(1, 8, score_mod=mods[0], backend="reference")
    stop = time.monotonic() + seconds
    torn, calls = [], [0]

    def caller():
        while time.monotonic() < stop:
            out = attn(q, q, q)
            calls[0] += 1
            if not any(torch.equal(out, e) for e in expected):
                torn.append(out)

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    i = 0
    while time.monotonic() < stop:
        i += 1
        attn.score_mod = mods[i % 2]
    for t in threads:
        t.join(timeout=30)
    assert calls[0] > 20 and i > 20
    assert not torn, f"{len(torn)} of {calls[0]} calls mixed two configurations"
