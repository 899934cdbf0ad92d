"""GPU: packed calls captured in a CUDA graph follow new cu_seqlens / document tables at replay.

A graph records its kernels once and each replay reruns them on the captured tensors' current
contents, so whatever the library derives from cu_seqlens on the device (lengths, ragged
offsets, document offsets, the value checks; memoized per tensor for eager calls) must be
captured, not served from the warm-up's memo. Each test warms up on a side stream, captures
forward + backward, writes new lengths and new inputs into the static tensors, replays, and
compares every sequence with float64 (the project's tolerance rule).
"""

import gc
import math

import pytest
import torch

import fused_attn
from fused_attn.testing import assert_close, mask_band, packed_tolerances

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

H, D = 4, 64


def _inputs(shape, seed):
    """(generator, q, k, v, do): leaf q, k, v of `shape` in bf16 requiring grad and an upstream
    gradient, drawn from a CUDA generator seeded `seed` (it then draws the replay's inputs)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
               for _ in range(3))
    return gen, q, k, v, torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)


def _redraw(tensors, gen):
    """New values in place (the captured graph's static inputs), from `gen`."""
    for t in tensors:
        t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=gen))


def _capture(step, leaves):
    """Warm up `step` twice on a side stream, then capture it; returns (graph, its output).

    Garbage is collected first. A CUDA object reachable only through a reference cycle (an aborted
    capture's graph kept by pytest.raises' traceback, CuTe DSL executors from FA4's first calls) is
    otherwise freed by whichever collection pass runs during this capture, and destroying a graph
    or unloading a library then is a call a global-mode capture forbids, from any thread: the
    capture is invalidated. Measured on an H200, cuDNN 9.27: the whole file in order failed the
    thd capture, 3 runs of 3; with this collection all 6 tests passed. The user-facing half (FA4's
    first calls, then a capture) has its own test in tests/backends/fa4."""
    gc.collect()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _check_sequences(out, grads, q, k, v, do, spans, causal, label):
    """The (start, length) spans of the packed (T, H, D) tensors, one sequence each, against the packed
    float64 reference with the tolerance rule (tokens outside every span are not compared)."""
    starts = torch.tensor([s for s, _ in spans] + [sum(spans[-1])], dtype=torch.int32)
    cu = torch.tensor([0] + [n for _, n in spans]).cumsum(0).to(torch.int32)
    exact, bounds = packed_tolerances(q, k, v, do, cu, cu, 1 / math.sqrt(D), q.dtype,
                                      band=mask_band("causal" if causal else "no_mask"), cu_seqlens_q_padded=starts,
                                      cu_seqlens_kv_padded=starts)
    real = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(q.device)
    for name, got in zip(("out", "dq", "dk", "dv"), (out, *grads)):
        assert_close(got.detach()[real], exact[name][real], bounds[name], f"{label} {name}")


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attn_graph_replays_new_lengths(causal):
    tokens, limit = 512, 256
    gen, q, k, v, do = _inputs((tokens, H, D), seed=7)
    cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")
    window = (-1, 0) if causal else (-1, -1)

    def step():
        out = fused_attn.varlen_attn(q, k, v, cu, cu, limit, limit, window_size=window)
        out.backward(do)
        return out

    graph, out = _capture(step, (q, k, v))
    lengths = [200, 56, 256]  # new boundaries, same token count and max_seqlen bucket
    with torch.no_grad():
        cu.copy_(torch.tensor([0, 200, 256, 512], dtype=torch.int32))
        _redraw((q, k, v, do), gen)
    graph.replay()
    torch.cuda.synchronize()
    spans = [(0, 200), (200, 56), (256, 256)]
    assert [n for _, n in spans] == lengths
    _check_sequences(out, (q.grad, k.grad, v.grad), q, k, v, do, spans, causal, "replay")


def test_doc_packed_graph_replays_new_documents():
    batch, seq = 2, 256
    gen, q, k, v, do = _inputs((batch, seq, H, D), seed=8)
    table = torch.tensor([[0, 64, 192, 256], [0, 128, 256, 256]], dtype=torch.int32, device="cuda")

    def step():
        out = fused_attn.doc_packed_attn(q, k, v, table, is_causal=True, max_doc_len=seq)
        out.backward(do)
        return out

    graph, out = _capture(step, (q, k, v))
    new = [[0, 10, 100, 256], [0, 30, 31, 256]]
    with torch.no_grad():
        table.copy_(torch.tensor(new, dtype=torch.int32))
        _redraw((q, k, v, do), gen)
    graph.replay()
    torch.cuda.synchronize()
    flat = lambda t: t.reshape(batch * seq, H, D)  # noqa: E731
    spans = [(row * seq + a, b - a) for row, bounds in enumerate(new) for a, b in zip(bounds, bounds[1:])]
    _check_sequences(flat(out), [flat(t.grad) for t in (q, k, v)], flat(q), flat(k), flat(v), flat(do), spans,
                     True, "replay")


def test_doc_packed_host_table_is_refused_inside_capture():
    """A CPU table is read on the host: a graph would replay its capture-time documents forever."""
    q = torch.randn(1, 128, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.tensor([[0, 64, 128]], dtype=torch.int32)
    fused_attn.doc_packed_attn(q, q, q, table)  # eager: fine
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(ValueError, match="CPU boundary table"):
        with torch.cuda.graph(graph):
            fused_attn.doc_packed_attn(q, q, q, table)
    # pytest.raises keeps this frame in a reference cycle (its traceback): destroy the aborted graph
    # now, not in some later garbage-collection pass that may run inside another test's capture
    del graph
    gc.collect()


def test_dense_padding_graph_replays_new_lengths():
    """bshd with attn_mask_type="padding": the cu_seqlens value check is captured with its bounds
    as kernel scalars (a captured host->device copy would read a buffer the graph does not own)."""
    batch, seq = 3, 128
    gen, q, k, v, do = _inputs((batch, seq, H, D), seed=9)
    cu = torch.tensor([0, 50, 178, 300], dtype=torch.int32, device="cuda")

    def step():
        out = fused_attn.dot_product_attention(q, k, v, attn_mask_type="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                               backend="cudnn")
        out.backward(do)
        return out

    graph, out = _capture(step, (q, k, v))
    lengths = [128, 7, 90]
    with torch.no_grad():
        cu.copy_(torch.tensor([0, 128, 135, 225], dtype=torch.int32))
        _redraw((q, k, v, do), gen)
    graph.replay()
    torch.cuda.synchronize()
    flat = lambda t: t.reshape(batch * seq, H, D)  # noqa: E731
    spans = [(b * seq, n) for b, n in enumerate(lengths)]
    _check_sequences(flat(out), [flat(t.grad) for t in (q, k, v)], flat(q), flat(k), flat(v), flat(do), spans,
                     False, "replay")
    for b, n in enumerate(lengths):  # rows past a length: output and gradients 0
        for name, t in (("out", out), ("dq", q.grad)):
            assert_close(t[b, n:].float(), torch.zeros_like(t[b, n:].float()), 0.0, f"{name} past length {b}")


def test_thd_with_padded_offsets_graph_replays_new_lengths():
    """thd with cu_seqlens_*_padded (the torch-op preparation, its general check) under capture."""
    tokens, limit = 300, 128
    gen, q, k, v, do = _inputs((tokens, H, D), seed=10)
    cu = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")
    pad = torch.tensor([0, 100, 200, 300], dtype=torch.int32, device="cuda")

    def step():
        out = fused_attn.dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                               cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad, max_seqlen_q=limit,
                                               max_seqlen_kv=limit, backend="cudnn")
        out.backward(do)
        return out

    graph, out = _capture(step, (q, k, v))
    with torch.no_grad():
        cu.copy_(torch.tensor([0, 60, 180, 300], dtype=torch.int32))
        pad.copy_(torch.tensor([0, 60, 180, 300], dtype=torch.int32))
        _redraw((q, k, v, do), gen)
    graph.replay()
    torch.cuda.synchronize()
    _check_sequences(out, (q.grad, k.grad, v.grad), q, k, v, do, [(0, 60), (60, 120), (180, 120)], False, "replay")
