"""A stub cuDNN for CPU tests: real graph construction (the frontend builds the operation graph
without a GPU), no planning, and an executor that checks every slot of the graph is bound, that each
bound buffer covers the extent the graph tensor addresses, and fills the outputs.

Use the `stub` fixture by importing it into a test module: `from helpers.cudnn_stub import stub`.
"""

from __future__ import annotations

import pytest
import torch

cudnn = pytest.importorskip("cudnn")

from fused_attn.backends import cudnn as backend  # noqa: E402
from fused_attn.backends.cudnn import common, graphs, runtime  # noqa: E402

_OUTPUTS = ("o", "stats", "dQ", "dK", "dV", "dBias", "dSink")
WRITTEN = {"dBias": 0.375, "dSink": -1.25}


@pytest.fixture
def stub(monkeypatch):
    """Stub cuDNN: real graph construction, no planning, an executor that checks bindings."""
    from fused_attn.backends.cudnn import version
    from fused_attn.cache import GRAPH_CACHE

    GRAPH_CACHE.clear()
    monkeypatch.setattr(version, "_result", (None, 91900))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _Null())
    refusal = backend.refusal

    def cpu_refusal(problem):  # CPU tensors stand in for CUDA ones here
        why = refusal(problem)
        return None if why is not None and "needs CUDA tensors" in why else why

    monkeypatch.setattr(backend, "refusal", cpu_refusal)
    executed = []

    def fake_build(key, mod, templates, handle):
        graph, named = graphs.construct(key, mod, templates)
        dims = {s: (list(t.dim), list(t.stride)) for s, t in named.items()}
        compiled = graphs.CompiledGraph(dims, tuple(named), [0] * len(named), 0, None)
        compiled.ragged = key.ragged
        return compiled

    def fake_execute(compiled, bind, device_index):
        missing = set(compiled.slots) - set(bind)
        assert not missing, f"unbound graph slots {sorted(missing)}"
        for slot in compiled.slots:
            dims, strides = compiled.graph[slot]
            t = bind[slot]
            if t.device.type == "cpu" and t.numel() == 1 and slot.startswith(("sm:", "attn_scale")):
                continue  # pass-by-value scalars
            if slot.startswith("roff_") or slot.startswith("seq_"):
                continue
            extent = 1 + sum((d - 1) * s for d, s in zip(dims, strides) if d > 0)
            if not slot.startswith(("q", "k", "v", "o", "dO", "dQ", "dK", "dV", "stats")) or not compiled.ragged:
                assert t.numel() >= extent or t.storage_offset() + extent <= t.untyped_storage().nbytes() // t.element_size(), \
                    f"slot {slot}: buffer of {t.numel()} elements under a graph tensor addressing {extent}"
        for slot in _OUTPUTS:
            if slot == "stats" and compiled.ragged and "stats" in bind:
                # like cuDNN: ragged Stats rows of real tokens only (rows between sequences keep their value)
                heads = compiled.graph["stats"][0][1]
                flat = bind["stats"].view(-1)
                for start, n in zip(bind[f"roff_q_{heads}"].view(-1).tolist(), bind["seq_q"].view(-1).tolist()):
                    flat[start:start + n * heads].normal_()
            elif slot in bind:
                bind[slot].normal_()
        for slot in ("dBias", "dSink"):  # known values, so a test can see they reach the caller
            if slot in bind:
                bind[slot].fill_(WRITTEN[slot])
        executed.append(tuple(sorted(compiled.slots)))

    monkeypatch.setattr(common, "build", fake_build)
    monkeypatch.setattr(runtime, "handle_for", lambda index: None)
    monkeypatch.setattr(runtime, "execute", fake_execute)
    scratch = {}
    monkeypatch.setattr(runtime, "scratch_for",
                        lambda index, numel: scratch.setdefault(numel, torch.empty(numel)))
    yield executed
    GRAPH_CACHE.clear()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def bf16(*shape, grad=False):
    return torch.randn(*shape).to(torch.bfloat16).requires_grad_(grad)
