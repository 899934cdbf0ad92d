"""Never stale, never pinned (CPU): values a backend turns into structure are in the plan key,
and no cache keeps a caller's tensor alive after its call returns.

The cuDNN runner checks use the stub graph executor of `helpers.cudnn_stub` (real graph
construction, no GPU); numerical checks compare against the float64 reference.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn import plan as P
from fused_attn.layouts import to_logical
from fused_attn.plan import NO_VARLEN, call_signature, get_plan
from fused_attn.spec import resolve_spec
from fused_attn.testing import assert_close, reference_attention, tolerance
from helpers.attention import band_mask, rand
from helpers.cudnn_stub import bf16, stub  # noqa: F401  (the stub fixture)


# ----------------------------------------------------------------------------- item: structural values


def test_structural_values_hook_names_the_native_band():
    assert sm.sliding_window(2, 0).structural_values() == (2, 0, False)
    assert sm.sliding_window(64, -1, bottom_right=True).structural_values() == (64, None, True)
    assert sm.softcap(30.0).structural_values() == ()
    # the structural key stays value-free: one spec, two plan keys
    assert sm.sliding_window(2, 0).cache_key == sm.sliding_window(64, 0).cache_key


def test_plan_key_includes_the_window_values():
    q = torch.randn(1, 16, 2, 8)
    sigs = []
    for left in (2, 64):
        spec, mod = resolve_spec(score_mod=sm.sliding_window(left, 0))
        sigs.append(call_signature(spec, q, q, q, NO_VARLEN, mod, None))
    assert sigs[0][0] == sigs[1][0]  # the same spec (structure) ...
    assert sigs[0] != sigs[1]  # ... but another plan


def test_cudnn_runner_band_follows_a_new_window_functional(stub):  # noqa: F811
    q, k, v = (bf16(1, 128, 2, 64) for _ in range(3))
    bands = []
    for left in (2, 64):
        mod = sm.sliding_window(left, 0)
        fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="cudnn")
        spec, mod = resolve_spec(score_mod=mod, backend="cudnn")
        plan = get_plan(spec, mod, q, k, v, NO_VARLEN)
        assert plan.backend == "cudnn"
        bands.append(plan.runner.lowering.band)
    assert bands[0] != bands[1] and None not in bands


def test_cudnn_runner_band_follows_a_module_attribute_change(stub):  # noqa: F811
    q = bf16(1, 128, 2, 64)
    attn = fused_attn.DotProductAttention(2, 64, score_mod=sm.sliding_window(2, 0), backend="cudnn")
    attn(q, q, q)
    bands = []
    for left in (2, 64):
        attn.score_mod = sm.sliding_window(left, 0)
        attn(q, q, q)
        spec, _, mod = attn._specs
        bands.append(get_plan(spec, mod, q, q, q, NO_VARLEN).runner.lowering.band)
    assert bands[0] != bands[1]
    assert bands[0] == get_plan(*resolve_spec(score_mod=sm.sliding_window(2, 0), backend="cudnn"),
                                q, q, q, NO_VARLEN).runner.lowering.band


@pytest.mark.parametrize("via", ["module", "functional"])
def test_reference_window_change_matches_float64(via):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (rand(gen, 1, 40, 2, 8) for _ in range(3))
    attn = fused_attn.DotProductAttention(2, 8, score_mod=sm.sliding_window(2, 0), backend="reference")
    for left in (2, 30, 5):
        mod = sm.sliding_window(left, 0)
        if via == "module":
            attn.score_mod = mod
            out = attn(q, k, v)
        else:
            out = fused_attn.dot_product_attention(q, k, v, score_mod=mod, backend="reference")
        ql, kl, vl = (to_logical(t, "bshd") for t in (q, k, v))
        mask = band_mask(40, 40, left, 0)
        exact, _ = reference_attention(ql, kl, vl, 8 ** -0.5, mask)
        assert_close(to_logical(out, "bshd"), exact, tolerance(ql, kl, vl, 8 ** -0.5, q.dtype, mask), f"window {left}")


# ----------------------------------------------------------------------------- item: no cache pins a tensor


def _calls_with_fresh_biases(call, n: int, shape) -> list:
    gen = torch.Generator().manual_seed(0)
    refs = []
    for _ in range(n):
        bias = rand(gen, *shape)
        refs.append(weakref.ref(bias))
        call(sm.post_scale_bias(bias))
        del bias
    return refs


def _alive(refs) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("backend", ["reference", pytest.param("torch", marks=pytest.mark.slow)])  # torch: compiles flex
def test_fresh_biases_are_not_kept_alive(backend):
    """Calls with fresh biases (200 of 1 MiB through compiled flex, 10 of 256 KiB through the
    reference): at most one alive after the loop, none after clear()."""
    gen = torch.Generator().manual_seed(1)
    n, s = (200, 256) if backend == "torch" else (10, 128)
    q = rand(gen, 1, s, 4, 16)
    refs = _calls_with_fresh_biases(lambda mod: fused_attn.dot_product_attention(q, q, q, score_mod=mod,
                                                                                 backend=backend),
                                    n, (1, 4, s, s))
    assert _alive(refs) <= 1
    fused_attn.graph_cache.clear()
    assert _alive(refs) == 0


@pytest.mark.parametrize("backend", ["reference", pytest.param("auto", marks=pytest.mark.slow)])  # auto: torch flex
def test_module_with_fresh_biases_keeps_none_after_reset(backend):
    gen = torch.Generator().manual_seed(2)
    q = rand(gen, 1, 64, 2, 16)
    attn = fused_attn.DotProductAttention(2, 16, backend=backend)

    def call(mod):
        attn.score_mod = mod
        attn(q, q, q)

    refs = _calls_with_fresh_biases(call, 50 if backend == "auto" else 10, (1, 2, 64, 64))
    assert _alive(refs) <= 1  # the module's own current score_mod
    attn.score_mod = None
    fused_attn.graph_cache.clear()
    assert _alive(refs) == 0


def test_fresh_biases_are_not_kept_alive_by_cudnn_runners(stub):  # noqa: F811
    """The cuDNN runner path (plans, graphs' operand templates, split memo, bound operands)."""
    q = bf16(1, 128, 2, 64)
    refs = _calls_with_fresh_biases(
        lambda mod: fused_attn.dot_product_attention(q, q, q, score_mod=sm.compose(mod, sm.softcap(20.0)),
                                                     backend="cudnn"), 20, (1, 2, 128, 128))
    refs += _calls_with_fresh_biases(
        lambda mod: fused_attn.dot_product_attention(q, q, q, score_mod=mod, backend="cudnn"), 20, (1, 2, 128, 128))
    assert P.PLANS and _alive(refs) <= 1
    fused_attn.graph_cache.clear()
    assert _alive(refs) == 0 and len(P.PLANS) == 0


def test_graph_cache_clear_empties_every_registered_cache():
    from fused_attn import cache_registry, spec

    gen = torch.Generator().manual_seed(4)
    q = rand(gen, 1, 16, 2, 8)
    fused_attn.dot_product_attention(q, q, q, score_mod=sm.softcap(10.0), backend="reference")  # no flex compile
    assert len(P.PLANS) and len(spec._MEMO)
    fused_attn.graph_cache.clear()
    assert len(P.PLANS) == 0 and len(spec._MEMO) == 0
    assert all(len(m) == 0 for m in list(cache_registry._ALL))


# ----------------------------------------------------------------------------- item: the plan cache is an LRU


def _plan(i: int):
    return P.CallPlan(None, "reference", str(i), None)


def test_plan_cache_evicts_the_least_recently_used():
    cache = type(P.PLANS)(3, "test.plans")  # the plan cache's kind (a BoundedMemo), small
    for i in range(3):
        cache.put(("k", i), _plan(i))
    assert cache.get(("k", 0)).reason == "0"  # 0 is now the most recent
    cache.put(("k", 3), _plan(3))
    assert cache.get(("k", 1)) is None  # 1 was the least recently used
    assert [cache.get(("k", i)) is not None for i in (0, 2, 3)] == [True, True, True]
    assert cache.info().hits == 4 and cache.info().misses == 1 and len(cache) == 3


def test_plan_cache_is_thread_safe():
    cache = type(P.PLANS)(16, "test.plans")
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(2000):
                key = ("k", (seed * 7 + i) % 40)
                if cache.get(key) is None:
                    cache.put(key, _plan(i))
        except Exception as exc:  # pragma: no cover - the failure this test looks for
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(cache) <= 16
    assert cache.info().hits + cache.info().misses == 4 * 2000


def test_spec_memo_serves_the_same_spec_and_never_another_mods():
    """The spec memo (read lock-free on every call): a repeated configuration gets the very same
    spec; a fresh score_mod object of another value gets its own entry, never the earlier mod's."""
    from fused_attn import spec as S

    S.clear_spec_memo()
    plain = S.resolve_spec(attn_mask_type="causal")
    assert S.resolve_spec(attn_mask_type="causal")[0] is plain[0] and plain[1] is None
    a, b = sm.softcap(30.0), sm.softcap(5.0)
    got_a, got_b = S.resolve_spec(score_mod=a), S.resolve_spec(score_mod=b)
    assert got_a[1] is a and got_b[1] is b
    assert S.resolve_spec(score_mod=a)[1] is a and S.resolve_spec(score_mod=b)[1] is b
    assert S.resolve_spec(window_size=[4, 0])[0].band == S.resolve_spec(window_size=(4, 0))[0].band
