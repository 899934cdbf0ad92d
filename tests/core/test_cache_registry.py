"""One cache mechanism: every process-wide cache of fused_attn and score_mods is in one registry
(`fused_attn.graph_cache.caches()`), `graph_cache.clear()` empties every one but the structural
templates compiled code refers to, memos holding tensors are bounded by bytes, and the exit hook
is that same clear."""

from __future__ import annotations

import ast
import os

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn import cache_registry, graph_cache, memo
from fused_attn.cache_registry import MemoInfo, tensor_bytes
from fused_attn.memo import BoundedMemo
from helpers.attention import cu_seqlens, rand

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _floats(n: int) -> torch.Tensor:
    return torch.randn(n)  # n * 4 bytes


def test_a_memo_with_max_bytes_evicts_by_bytes_and_counts_them():
    m = BoundedMemo(10, "t.bytes", max_bytes=100)
    m.put("a", _floats(10))
    m.put("b", (_floats(5), {"x": _floats(5)}))  # nested: 40 bytes
    assert m.info().nbytes == 80 and m.info().max_bytes == 100
    m.put("c", _floats(10))  # 120 > 100: the least recently used goes
    assert "a" not in m and m.info().nbytes == 80 and m.info().evictions == 1
    m.put("b", _floats(2))  # a replaced value is counted once
    assert m.info().nbytes == 48
    m.put("huge", _floats(30))  # larger than the bound: not kept, and nothing else either
    assert len(m) == 0 and m.info().nbytes == 0
    keep = _floats(1)
    m.put_identity("p", (keep,), _floats(5))
    assert m.info().nbytes == 20
    assert m.pop("p") is not None and m.info().nbytes == 0
    m.put("d", _floats(3))
    m.clear()
    assert m.info() == MemoInfo("t.bytes", 0, 0, 0, 0, 10, 0, 100)


def test_tensor_bytes_counts_real_tensors_only():
    assert tensor_bytes([torch.zeros(4, dtype=torch.float64), (torch.zeros(2, dtype=torch.int32),)]) == 40
    assert tensor_bytes(torch.empty(1000, device="meta")) == 0
    assert tensor_bytes({"a": 1, "b": "x"}) == 0


def test_register_clear_needs_a_clear_or_the_reason_to_keep():
    with pytest.raises(ValueError, match="give clear, or clear=None with the reason"):
        cache_registry.register_clear("t.none", None)
    with pytest.raises(ValueError, match="give clear, or clear=None with the reason"):
        sm.caches.register("t.none", lambda: None, None)


def _exercise(gen):
    """Calls that fill the library's CPU caches: specs, plans, score_mod lowering facts, varlen,
    documents, materialized biases. Returns what those entries are computed from (an entry never
    outlives its tensors: the caller keeps them alive while it looks)."""
    q, k, v = (rand(gen, 1, 12, 2, 8) for _ in range(3))
    bias = rand(gen, 1, 2, 12, 12)
    fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(5.0), backend="reference")
    fused_attn.dot_product_attention(q, k, v, score_mod=sm.post_scale_bias(bias), backend="reference")
    slopes = sm.alibi_slopes(2)
    sm.materialize(sm.alibi(slopes), (1, 2, 12, 12), device="cpu")
    cu = cu_seqlens([5, 7])
    packed = [rand(gen, 12, 2, 8) for _ in range(3)]
    fused_attn.varlen_attn(*packed, cu, cu, 7, 7, window_size=(-1, 0))
    fused_attn.doc_packed_attn(q, k, v, torch.tensor([[0, 5, 12]], dtype=torch.int32), is_causal=True)
    sm.lower_cudnn.plan_for(sm.softcap(3.0).root)
    return q, k, v, bias, slopes, cu, packed


def test_every_cache_is_listed_and_clear_empties_all_but_the_kept_ones(gen):
    alive = _exercise(gen)  # noqa: F841
    infos = {i.name: i for i in graph_cache.caches()}
    for name in ("spec.resolved", "plan.plans", "cache.graphs", "ops.specs", "varlen.calls", "doc_packed.offsets",
                 "score_mods.materialization", "score_mods.templates", "score_mods.lower_cudnn.plan_for",
                 "score_mods.expr.reads", "torch_flex.compiled"):
        assert name in infos, f"{name} is not in the registry"
    filled = [n for n, i in infos.items() if i.size]
    assert {"spec.resolved", "plan.plans", "score_mods.materialization", "score_mods.lower_cudnn.plan_for"} <= set(filled)
    kept = graph_cache.kept()
    assert set(kept) == {"ops.specs", "score_mods.templates"} and all(kept.values())
    graph_cache.clear()
    left = [i for i in graph_cache.caches() if (i.size or i.nbytes) and i.name not in kept]
    assert not left, f"caches graph_cache.clear() left filled: {left}"


def test_memos_holding_tensors_are_bounded_by_bytes(gen):
    alive = _exercise(gen)  # noqa: F841
    unbounded = []
    for m in list(cache_registry._ALL):
        values = [v.value if type(v) is memo._Pinned else v for v in list(m._data.values())]
        if any(tensor_bytes(v) for v in values) and m.info().max_bytes is None:
            unbounded.append(m.info().name)
    assert not unbounded, f"memos holding tensors without max_bytes: {unbounded}"
    from fused_attn.backends.cudnn import packed_dense

    assert packed_dense._BATCHES.info().max_bytes == packed_dense.MAX_BATCH_BYTES


def _module_sources():
    for pkg in ("fused_attn", "score_mods"):
        for folder, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    yield os.path.relpath(path, ROOT), open(path).read()


def _decorator_names(fn: ast.FunctionDef) -> list:
    out = []
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        out.append(ast.unparse(target))
    return out


def test_every_lru_cache_and_module_level_cache_is_registered():
    """Static: an lru_cache'd function carries register_lru; a module that keeps an OrderedDict
    (a hand-written LRU) at module level registers it."""
    missing = []
    for path, text in _module_sources():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                names = _decorator_names(node)
                if any(n.endswith("lru_cache") or n == "functools.cache" for n in names) and \
                        not any(n.endswith("register_lru") for n in names):
                    missing.append(f"{path}: {node.name} (lru_cache without register_lru)")
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("OrderedDict"):
                if "register_clear(" not in text and "caches.register(" not in text:
                    missing.append(f"{path}: module-level {ast.unparse(node)[:60]} (not registered)")
    assert not missing, "\n".join(missing)


def test_the_exit_hook_is_the_registry_clear(gen):
    alive = _exercise(gen)  # noqa: F841
    cache_registry._release_at_exit()
    kept = graph_cache.kept()
    assert not [i for i in graph_cache.caches() if (i.size or i.nbytes) and i.name not in kept]
