"""Learnable tables and biases: gradients through gathers at computed indices, the additive-bias
split for cuDNN's bias input, `trainable()`, and the materialization memo."""

import math

import pytest
import torch

import fused_attn
import score_mods as sm
from fused_attn import testing
from helpers.zoo import H, S, grid, t5_bucket, zoo
from score_mods import materialization

#: name -> (trained tensor parameters, oracle(params) -> plain-torch score_fn)
TABLES = {
    "t5_bias": (["table"], lambda p: lambda s, b, h, q, k: s + p["table"][h, t5_bucket(k - q)]),
    "sandwich": (["rel_bias", "head_scale"],
                 lambda p: lambda s, b, h, q, k: s + p["rel_bias"][q - k + S - 1] * p["head_scale"][h]),
    "graphormer": (["spatial"], lambda p: lambda s, b, h, q, k: s + p["spatial"][h, p["dist"][b, q, k]]),
    "bias_under_mask": (["table"], lambda p: lambda s, b, h, q, k: (
        20.0 * torch.tanh(s / 20.0) + p["table"][h, (k - q).clamp(-4, 4) + 4]).masked_fill(k > q, -math.inf)),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_table_gradients_match_float64_oracle(name):
    """Reference backend gradients w.r.t. the tables (torch autograd through the gathers: a
    scatter-add) == a float64 autograd oracle written in plain torch."""
    trained, oracle = TABLES[name]
    mod, _ = zoo()[name]
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, H, S, 16, generator=g, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, H, S, 16, generator=g, dtype=torch.float64)

    def leaves():
        return {n: t.detach().clone().requires_grad_(n in trained) for n, t in mod.tensors().items()}

    ours = leaves()
    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bhsd", score_mod=mod.bind(**ours), backend="reference")
    got = torch.autograd.grad(out, [ours[n] for n in trained], dout)
    theirs = leaves()
    ref, _ = testing.reference_attention(q, k, v, 1 / math.sqrt(16), score_fn=oracle(theirs))
    want = torch.autograd.grad(ref, [theirs[n] for n in trained], dout)
    for n, a, e in zip(trained, got, want):
        assert a.abs().sum() > 0, f"{n}: no gradient"
        testing.assert_close(a, e, testing.agreement_bound(e), what=f"d{n}")


def _random_check(mod, sq=S, skv=S, seeds=3):
    score_part, bias_part = mod.split_additive_bias()
    idx = grid(sq=sq, skv=skv)
    g = sm.materialize(bias_part, (1, H, sq, skv), device="cpu", dtype=torch.float64)
    assert g.shape == (1, H, sq, skv) and g.is_contiguous()
    for seed in range(seeds):
        s = torch.randn(1, H, sq, skv, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 4
        want = mod.eager(s, *idx, sq, skv)
        got = (s if score_part is None else score_part.eager(s, *idx, sq, skv)) + g
        assert torch.equal(torch.isfinite(got), torch.isfinite(want))
        fin = torch.isfinite(want)
        testing.assert_close(got[fin], want[fin], testing.agreement_bound(want[fin]), "score + bias")
        # and the bias part is itself the mod `score + g`
        assert torch.equal(bias_part.eager(s, *idx, sq, skv), s + g)
    return score_part, bias_part


@pytest.mark.parametrize("name", ["t5_bias", "sandwich", "graphormer", "gym_alibi", "bias_under_mask"])
def test_split_additive_bias_round_trip(name):
    mod, _ = zoo()[name]
    score_part, bias_part = _random_check(mod)
    assert bias_part is not None and bias_part.mask_condition() is None
    if name == "bias_under_mask":
        @sm.score_mod
        def capped_causal(score, b, h, q_idx, kv_idx, cap=1.0):
            return sm.where(kv_idx <= q_idx, cap * sm.tanh(score / cap), -math.inf)

        assert score_part.cache_key == capped_causal.cache_key and score_part.scalars() == {"cap": 20.0}
    elif name != "gym_alibi":
        assert score_part is None  # only the bias: cuDNN needs no score_mod at all


def test_split_additive_bias_shapes_of_the_dag():
    @sm.score_mod
    def several(score, b, h, q_idx, kv_idx, t=sm.TensorParam(), u=sm.TensorParam(), w=0.5):
        core = w * sm.tanh(score) - t[h, kv_idx - q_idx + S] + 1.0
        return sm.where(q_idx >= 2, sm.where(kv_idx <= q_idx, core - (u[q_idx] * -2.0), -math.inf), -math.inf)

    g = torch.Generator().manual_seed(3)
    mod = several(t=torch.randn(H, 2 * S, generator=g, dtype=torch.float64), u=torch.randn(S, dtype=torch.float64))
    score_part, bias_part = _random_check(mod)
    assert score_part.scalars() == {"w": 0.5} and set(score_part.specs) == {"w"}
    assert set(bias_part.specs) == {"t", "u"}
    assert mod.trainable() == {"t": sm.Trainable(True, True), "u": sm.Trainable(True, True)}
    capped = sm.softcap(2.0)
    assert capped.split_additive_bias() == (capped, None)  # nothing to split: the mod itself

    @sm.score_mod
    def table_in_score(score, b, h, q_idx, kv_idx, t=sm.TensorParam(), ids=sm.TensorParam("int")):
        return score * t[h] + t[h] + ids[q_idx]

    m = table_in_score(t=torch.ones(H), ids=torch.arange(S))
    assert m.trainable() == {"t": sm.Trainable(True, False), "ids": sm.Trainable(False, True)}


def test_materialized_bias_gets_gradients_and_the_memo_rebuilds_nothing():
    materialization.clear_cache()
    mod, _ = zoo()["t5_bias"]
    table = mod.tensors()["table"].detach().clone()
    _, bias_part = mod.bind(table=table).split_additive_bias()
    a = sm.materialize(bias_part, (1, H, S, S), device="cpu")
    b = sm.materialize(bias_part, (1, H, S, S), device="cpu")
    assert a is b and a.dtype == torch.float32
    info = materialization.cache_info()
    assert info["hits"] == 1 and info["misses"] == 1 and info["entries"] == 1
    with torch.no_grad():
        table.add_(1.0)  # an optimizer step: _version changes, the memo recomputes
    c = sm.materialize(bias_part, (1, H, S, S), device="cpu")
    torch.testing.assert_close(c, a + 1.0)
    leaf = table.clone().requires_grad_(True)
    _, trained = mod.bind(table=leaf).split_additive_bias()
    d = sm.materialize(trained, (1, H, S, S), device="cpu", dtype=torch.float64)
    assert d.requires_grad and materialization.cache_info()["uncached"] == 1
    dbias = torch.randn_like(d)
    d.backward(dbias)  # what the backend does with cuDNN's dBias
    want = torch.zeros_like(leaf)
    _, _, qi, ki = grid()
    idx = t5_bucket(ki - qi).expand(1, 1, S, S)[0, 0]
    for h in range(H):
        want[h].index_add_(0, idx.reshape(-1), dbias[0, h].reshape(-1))
    torch.testing.assert_close(leaf.grad, want)


def test_memo_is_bounded_and_keyed_by_values_not_only_structure(monkeypatch):
    materialization.clear_cache()
    monkeypatch.setattr(materialization, "MAX_ENTRIES", 3)

    @sm.mask_mod
    def blocks(b, h, q_idx, kv_idx, bs=2):  # bit shifts: materialized (not emitted in-graph)
        return q_idx >> bs == kv_idx >> bs

    for bs in (1, 2, 3, 4):
        ops = blocks(bs=bs).cudnn_operands((1, 1, 8, 8), device="cpu")
        torch.testing.assert_close(ops["mat0@q"].flatten(), (torch.arange(8) >> bs).float())
    assert materialization.cache_info()["entries"] == 3
    first = blocks(bs=4).cudnn_operands((1, 1, 8, 8), device="cpu")["mat0@q"]
    assert blocks(bs=4).cudnn_operands((1, 1, 8, 8), device="cpu")["mat0@q"] is first
    assert blocks(bs=4).cudnn_operands((1, 1, 8, 9), device="cpu")["mat1@k"].shape == (1, 1, 1, 9)  # dims key it
    # tensor values key it too (a new tensor, even at a freed one's address, never hits an old entry)
    materialization.clear_cache()

    @sm.mask_mod
    def gathered(b, h, q_idx, kv_idx, ids=sm.TensorParam("int")):
        return ids[q_idx // 2] == ids[kv_idx // 2]

    first = gathered(ids=torch.zeros(8, dtype=torch.int64)).cudnn_operands((1, 1, 8, 8), device="cpu")["mat0@q"]
    assert float(first.sum()) == 0.0
    again = gathered(ids=torch.ones(8, dtype=torch.int64)).cudnn_operands((1, 1, 8, 8), device="cpu")["mat0@q"]
    assert float(again.sum()) == 8.0


def test_materialization_is_thread_safe():
    import threading

    materialization.clear_cache()

    @sm.mask_mod
    def blocks(b, h, q_idx, kv_idx, bs=2):  # bit shifts: materialized
        return q_idx >> bs == kv_idx >> bs

    errors = []

    def work(seed):
        try:
            for i in range(30):
                bs = (seed + i) % 5
                ops = blocks(bs=bs).cudnn_operands((1, 1, 16, 16), device="cpu")
                assert torch.equal(ops["mat0@q"].flatten(), (torch.arange(16) >> bs).float())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert materialization.cache_info()["entries"] <= materialization.MAX_ENTRIES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_small_table_gradient_is_a_histogram_equal_to_index_put(dtype):
    """A small trained table read at broadcast (h, q, kv) indices, negative ones included: the
    histogram backward (table_gather, used for CUDA tables) gives index_put's accumulated gradient
    (same terms, another order) within the rule for the dtype, and its second derivative
    (create_graph) equals index_put's; a CPU table keeps `table[...]` (the other cases that keep
    it: the GPU test below)."""
    from score_mods import table_gather

    g = torch.Generator().manual_seed(3)
    table = torch.randn(4, 9, generator=g, dtype=torch.float64).to(dtype)
    h = torch.arange(4).view(1, 4, 1, 1)
    rel = (torch.arange(40).view(1, 1, 1, 40) - torch.arange(33).view(1, 1, 33, 1)).clamp(-4, 4)
    indices = [h, rel]  # -4..4: negative indices read from the end, as table[...] does
    grad = torch.randn(2, 4, 33, 40, generator=g, dtype=torch.float64).to(dtype)

    def grad_of(fn):
        leaf = table.detach().clone().requires_grad_()
        out = fn(leaf)
        assert out.shape == (1, 4, 33, 40)
        (got,) = torch.autograd.grad(out.expand_as(grad), leaf, grad)
        return out.detach(), got

    out, got = grad_of(lambda t: table_gather.histogram_gather(t, indices))
    want_out, want = grad_of(lambda t: t[tuple(indices)])
    assert torch.equal(out, want_out) and got.dtype == dtype
    exact_leaf = table.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(exact_leaf[tuple(indices)].expand_as(grad), exact_leaf, grad.double())
    bound = testing.bound_from(want, exact, dtype)  # index_put's own error in this dtype sets the rule
    testing.assert_close(got, exact, bound, f"histogram table gradient ({dtype})")

    # a second derivative through the table's gradient (create_graph) equals index_put's
    weight = torch.randn(1, 4, 33, 40, generator=g, dtype=torch.float64)

    def second_derivative(fn):
        leaf = table.detach().double().requires_grad_()
        (first,) = torch.autograd.grad((fn(leaf) ** 2 * weight).sum(), leaf, create_graph=True)
        return torch.autograd.grad(first.square().sum(), leaf)[0]

    torch.testing.assert_close(second_derivative(lambda t: table_gather.histogram_gather(t, indices)),
                               second_derivative(lambda t: t[tuple(indices)]), rtol=1e-12, atol=1e-12)
    assert not table_gather.histogram_backward_applies(table.detach().requires_grad_(), indices)  # CPU
    assert table_gather.gather(table.detach().requires_grad_(), indices).grad_fn.name() == "IndexBackward0"


@pytest.mark.gpu
def test_cuda_small_table_gradient_is_a_histogram():
    """On CUDA a small trained table takes the histogram backward (T5's (H, 32) read at every
    (h, q, kv)), equal to float64 within the fp32 rule; one past MAX_ENTRIES, one without grad,
    deterministic mode and a CUDA graph capture keep index_put."""
    from score_mods import table_gather

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(4)
    table = torch.randn(16, 32, device="cuda", generator=g, requires_grad=True)
    h = torch.arange(16, device="cuda").view(1, 16, 1, 1)
    i = torch.arange(512, device="cuda")
    rel = (i.view(1, 1, 1, -1) - i.view(1, 1, -1, 1)).abs().clamp(max=31)
    grad = torch.randn(2, 16, 512, 512, device="cuda", generator=g)
    out = table_gather.gather(table, [h, rel])
    assert out.grad_fn.name() != "IndexBackward0"
    (got,) = torch.autograd.grad(out.expand_as(grad), table, grad)
    exact_leaf = table.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(exact_leaf[h, rel].expand_as(grad), exact_leaf, grad.double())
    (same,) = torch.autograd.grad(table[h, rel].expand_as(grad), table, grad)  # index_put in fp32
    testing.assert_close(got, exact, testing.bound_from(same, exact, torch.float32), "CUDA histogram gradient")

    big = torch.zeros(table_gather.MAX_ENTRIES + 1, device="cuda", requires_grad=True)
    assert not table_gather.histogram_backward_applies(big, [torch.arange(3, device="cuda")])
    assert not table_gather.histogram_backward_applies(table.detach(), [h, rel])
    with torch.no_grad():
        assert not table_gather.histogram_backward_applies(table, [h, rel])
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not table_gather.histogram_backward_applies(table, [h, rel])
    finally:
        torch.use_deterministic_algorithms(previous)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # bincount sizes its output on the host: never inside a capture
        assert not table_gather.histogram_backward_applies(table, [h, rel])


def test_fake_and_meta_tables_keep_plain_indexing():
    """Tracing with fake CUDA tensors (no CUDA runtime needed) or meta tensors never reaches the
    histogram (its output size would depend on values) nor asks CUDA anything: shapes and a
    grad_fn come from plain indexing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from score_mods import table_gather

    meta = torch.zeros(4, 9, device="meta", requires_grad=True)
    idx = [torch.arange(4, device="meta").view(4, 1), torch.zeros(1, 7, dtype=torch.long, device="meta")]
    assert not table_gather.histogram_backward_applies(meta, idx)
    assert table_gather.gather(meta, idx).shape == (4, 7)
    with FakeTensorMode():
        for device in ("cuda", "cpu"):  # a fake CUDA table is ruled out before any CUDA call
            fake = torch.zeros(4, 9, device=device, requires_grad=True)
            fidx = [torch.arange(4, device=device).view(4, 1), torch.zeros(1, 7, dtype=torch.long, device=device)]
            assert not table_gather.histogram_backward_applies(fake, fidx)
        out = table_gather.gather(fake, fidx)  # CPU: indexing fake CUDA tensors needs a CUDA build
        assert out.shape == (4, 7) and out.grad_fn is not None


def test_gather_traces_under_dynamo_before_asking_anything_else(monkeypatch):
    """flex_attention runs a score_mod under torch.compile (its eager path too): the histogram's
    gate must say no before its functorch and CUDA questions, which dynamo cannot trace. A CPU
    table stands in for a CUDA one (the device test is the only one patched); fullgraph makes any
    untraceable call an error."""
    from score_mods import table_gather

    monkeypatch.setattr(table_gather, "_on_cuda", lambda t: True)
    table = torch.randn(4, 9, requires_grad=True)
    idx = (torch.arange(4).view(4, 1), torch.tensor([[0, 3, 8]]))

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t, i, j):
        return table_gather.gather(t, (i, j)) * 2.0

    got = traced(table, *idx)
    got.sum().backward()
    expected = torch.zeros(4, 9)
    expected[:, [0, 3, 8]] = 2.0
    assert torch.equal(got.detach(), table.detach()[idx] * 2.0) and torch.equal(table.grad, expected)
