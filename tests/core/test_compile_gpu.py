"""GPU: the custom ops on the cuDNN backend: opcheck, torch.compile, CUDA graph capture and replay."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from helpers.compile_cases import Block  # noqa: E402


def _softcap(cap):
    from score_mods.library import softcap

    return softcap(cap)


def _make(score_mod=None):
    """Block: causal DotProductAttention on the cuDNN backend (masks compose into the score_mod)."""
    torch.manual_seed(0)
    model = Block(dim=512, heads=4, score_mod=score_mod, backend="cudnn").cuda().to(torch.bfloat16)
    return model, torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)


def _fwd_bwd(fn, model, x):
    x = x.detach().requires_grad_()
    y = fn(x)
    y.float().square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return y.detach(), grads


def _close(a, b, rel=2e-2):
    return (a.float() - b.float()).abs().max().item() <= rel * b.float().abs().max().item() + 1e-2


@pytest.mark.parametrize("sm", [None, 20.0])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_cudnn_block_matches_eager(sm, backend):
    torch._dynamo.reset()
    model, x = _make(None if sm is None else _softcap(sm))
    y0, g0 = _fwd_bwd(model, model, x)
    y1, g1 = _fwd_bwd(torch.compile(model, backend=backend, fullgraph=True), model, x)
    assert _close(y1, y0)
    for a, b in zip(g1, g0):
        assert _close(a, b)


def test_cuda_graph_capture_and_replay_after_inputs_change():
    model, x = _make(_softcap(20.0))
    static_x = x.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: builds the cuDNN graphs outside capture
        for _ in range(2):
            model(static_x).float().sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    model.zero_grad()
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.float().square().sum().backward()
    new_x = torch.randn_like(x)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    ref_x = new_x.clone().requires_grad_()
    ref_y = model(ref_x)
    ref_y.float().square().sum().backward()
    assert _close(static_y, ref_y)
    assert _close(static_x.grad, ref_x.grad)


def test_compiled_bias_calls_follow_each_calls_shapes_on_cudnn():
    """The graph of each compiled post_scale_bias call is built for that call's bias shape (a
    registry template of the first call's shape gave the wrong graph; stub-tested on CPU)."""
    from helpers.compile_cases import check_compiled_bias_calls

    check_compiled_bias_calls("cuda", "cudnn", torch.bfloat16, 256)
