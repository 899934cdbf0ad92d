"""Recorded FA4 backwards (`fused_attn.backends.fa4.replay`) without a GPU: a stand-in for
FA4's interface whose `_flash_attn_bwd` does what FA4's does on the host (allocates buffers with
empty / zeros, launches a preprocess, a main and postprocess "kernels" through three compile
caches, one of them with a named tuple of tensors, and returns buffers it allocated) computing on
CPU tensors. Checked: a replay gives FA4's own answer on a later call's tensors and aux data
without FA4's host path, zero-filled buffers are zero-filled again, every kind of host work that
cannot be replayed keeps the signature on FA4's path with the reason, and a recording holds no
tensor. The GPU half (FA4's real kernels against the float64 reference) is in test_fa4_gpu.py."""

from __future__ import annotations

import gc
import types
import weakref
from typing import NamedTuple

import pytest
import torch

from fused_attn.backends.fa4 import install, recorded, replay
from helpers.fa4_stand_in import AuxData, tensors_in


class SinkTensors(NamedTuple):
    dpsum: object
    sink: object
    dsink: object


def _pre(out, dout, dpsum):
    dpsum.copy_((out * dout).sum(-1))


def _main(q, k, v, dout, dpsum, dq_acc, dk_acc, dv, scale, aux):
    """dq_acc = scale * q * dpsum; dk_acc += k * dout (accumulates: needs a zeroed buffer); dv = v - dout
    (+ the first aux scalar, + the sum of the first aux tensor)."""
    dq_acc.copy_(scale * q * dpsum.unsqueeze(-1))
    dk_acc.add_(k * dout)
    shift = (float(aux.scalars[0]) if aux.scalars else 0.0) + (float(aux.tensors[0].sum()) if aux.tensors else 0.0)
    dv.copy_(v - dout + shift)


def _post(acc, dq, sinks):
    dq.copy_(acc.view(dq.shape))
    if sinks is not None:
        sinks.dsink.copy_(sinks.sink * sinks.dpsum.sum())


class FakeFa4:
    """`_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, aux_tensors=, aux_scalars=,
    learnable_sink=)` as FA4's. `host_op`: runs a torch op that is not an allocation; `foreign`:
    passes a tensor made before the call; `late_fill`: zeroes a buffer after a kernel used it."""

    def __init__(self, host_op=False, foreign=False, late_fill=False):
        self.calls = 0
        self.host_op, self.foreign, self.late_fill = host_op, foreign, late_fill
        self.made_before = None  # foreign: a buffer the first call makes and later calls reuse
        iface = self

        def cached(fn, key, kernel):
            if key not in fn.compile_cache:
                fn.compile_cache[key] = kernel
            return fn.compile_cache[key]

        def _bwd_preprocess(out, dout, dpsum):
            cached(_bwd_preprocess, "pre", _pre)(out, dout, dpsum)

        def _bwd_postprocess_convert(acc, dq, sinks):
            cached(_bwd_postprocess_convert, "post", _post)(acc, dq, sinks)

        def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=1.0, aux_tensors=None, aux_scalars=None,
                            learnable_sink=None, deterministic=False, **_):
            iface.calls += 1
            aux_scalars = tuple(aux_scalars) if aux_scalars else None
            if iface.host_op:
                lse = lse.cumsum(-1)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            dpsum = torch.empty(q.shape[:-1])
            dq_acc = torch.empty(q.numel())
            dk_acc = torch.zeros_like(k)
            dsink = torch.empty_like(learnable_sink) if learnable_sink is not None else None
            _bwd_preprocess(out, dout, dpsum)
            cached(_flash_attn_bwd, "main", _main)(
                q.detach(), k.detach(), v.detach(), dout, dpsum, dq_acc.view(q.shape), dk_acc, dv,
                softmax_scale, AuxData(aux_tensors, aux_scalars))
            if iface.late_fill:
                dpsum.zero_()
            if iface.foreign:
                if iface.made_before is None:
                    iface.made_before = torch.zeros(q.numel())
                cached(_bwd_postprocess_convert, "post", _post)(iface.made_before, dq, None)
            sinks = SinkTensors(dpsum, learnable_sink, dsink) if learnable_sink is not None else None
            _bwd_postprocess_convert(dq_acc, dq, sinks)
            dk.copy_(dk_acc) if iface.host_op else cached(_bwd_postprocess_convert, "copy", _copy)(dk_acc, dk)
            return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)

        for fn in (_flash_attn_bwd, _bwd_preprocess, _bwd_postprocess_convert):
            fn.compile_cache = {}
        self._flash_attn_bwd = _flash_attn_bwd
        self._bwd_preprocess = _bwd_preprocess
        self._bwd_postprocess_convert = _bwd_postprocess_convert
        self.utils = types.SimpleNamespace(AuxData=AuxData)


def _copy(src, dst):
    dst.copy_(src)


def _fake(monkeypatch, **kw):
    fa = FakeFa4(**kw)
    monkeypatch.setattr(install, "module", lambda: fa)
    return fa


def _tensors(seed, b=2, s=8, h=2, d=4, sink=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, out, dout = (torch.randn(b, s, h, d, generator=g) for _ in range(5))
    lse = torch.randn(b, h, s, generator=g)
    sinks = torch.randn(h, generator=g) if sink else None
    return q, k, v, out, dout, lse, sinks


def _own(q, k, v, out, dout, lse, sinks):
    return (q, k, v, out, dout, lse, None, None, sinks)


def _run(fa, t, scale=0.5, aux_tensors=None, aux_scalars=None):
    q, k, v, out, dout, lse, sinks = t
    return lambda: fa._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, aux_tensors=aux_tensors,
                                      aux_scalars=aux_scalars, learnable_sink=sinks)


def _recorded(fa, t, aux_tensors=None, aux_scalars=None):
    """Record on a second call (the first one compiles, so it concludes nothing)."""
    first = replay.record(_run(fa, t, aux_tensors=aux_tensors, aux_scalars=aux_scalars), _own(*t),
                                   aux_tensors, aux_scalars)
    assert first[1] is None
    return replay.record(_run(fa, t, aux_tensors=aux_tensors, aux_scalars=aux_scalars), _own(*t),
                                  aux_tensors, aux_scalars)


@pytest.mark.parametrize("sink", [False, True])
def test_a_replay_gives_fa4s_own_gradients_for_a_later_calls_tensors_and_aux_data(monkeypatch, sink):
    fa = _fake(monkeypatch)
    table, scalars = [torch.randn(5)], (1.5,)
    t = _tensors(0, sink=sink)
    grads, entry = _recorded(fa, t, table, scalars)
    assert type(entry) is replay.Replay and fa.calls == 2
    assert all(torch.equal(a, b) for a, b in zip(grads, _run(fa, t, aux_tensors=table, aux_scalars=scalars)()))

    t2, table2, scalars2 = _tensors(1, sink=sink), [torch.randn(5)], (-2.0,)
    calls = fa.calls
    got = replay.replay(entry, _own(*t2), table2, scalars2)
    assert fa.calls == calls  # FA4's host path did not run
    expected = _run(fa, t2, aux_tensors=table2, aux_scalars=scalars2)()
    assert len(got) == len(expected) == (4 if sink else 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_zero_filled_buffer_is_zero_filled_on_replay(monkeypatch):
    fa = _fake(monkeypatch)
    _, entry = _recorded(fa, _tensors(0))
    allocs = [s for s in entry.steps if type(s) is replay._Alloc]
    assert [a.fill for a in allocs] == [None, None, None, None, None, 0]  # dq dk dv dpsum dq_acc | dk_acc
    # the stand-in's main kernel accumulates into dk_acc: garbage there would reach dk
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **kw: torch.full(a[0], 7.0, dtype=kw["dtype"]))
    t2 = _tensors(1)
    got = replay.replay(entry, _own(*t2), None, None)
    assert torch.equal(got[1], t2[1] * t2[4])


@pytest.mark.parametrize("kind, why", [
    ("host_op", "aten.cumsum"),
    ("foreign", "neither the call's own nor allocated in the call"),
    ("late_fill", "filled a buffer after a kernel used it"),
])
def test_host_work_that_cannot_be_replayed_keeps_the_signature_on_fa4s_path(monkeypatch, kind, why):
    fa = _fake(monkeypatch, **{kind: True})
    t = _tensors(0)
    grads, entry = _recorded(fa, t)
    assert type(entry) is recorded.Host and why in entry.why
    assert all(torch.equal(a, b) for a, b in zip(grads, _run(fa, t)()))  # the call itself ran as usual


def test_aux_data_that_is_not_the_calls_own_is_refused(monkeypatch):
    fa = _fake(monkeypatch)
    t, table = _tensors(0), [torch.randn(5)]
    replay.record(_run(fa, t, aux_tensors=table), _own(*t), table, None)
    _, entry = replay.record(_run(fa, t, aux_tensors=table), _own(*t), [table[0].clone()], None)
    assert type(entry) is recorded.Host and "aux data" in entry.why


def test_a_recording_keeps_no_tensor_alive_and_the_caches_come_back(monkeypatch):
    fa = _fake(monkeypatch)
    caches = [fa._flash_attn_bwd.compile_cache, fa._bwd_preprocess.compile_cache]
    t = _tensors(0)
    refs = [weakref.ref(x) for x in t if x is not None]
    grads, entry = _recorded(fa, t)
    assert type(entry) is replay.Replay
    assert [fa._flash_attn_bwd.compile_cache, fa._bwd_preprocess.compile_cache] == caches
    assert all(type(c) is dict for c in caches)
    del t, grads
    gc.collect()
    assert all(r() is None for r in refs)

    assert tensors_in(entry) == 0


def test_the_gradients_a_recording_or_a_replay_returns_are_the_callers_alone(monkeypatch):
    """No reference cycle keeps FA4's buffers: autograd takes a gradient as the parameter's .grad
    only when nothing else holds it, and copies it otherwise (one device copy of dq, dk and dv per
    step, measured on an H200 before this was fixed)."""
    fa = _fake(monkeypatch)
    t = _tensors(0)
    gc.disable()
    try:
        grads, entry = _recorded(fa, t)
        assert type(entry) is replay.Replay
        refs = [weakref.ref(g) for g in grads]
        del grads
        assert all(r() is None for r in refs)  # freed at once, without a garbage collection
        got = replay.replay(entry, _own(*_tensors(1)), None, None)
        refs = [weakref.ref(g) for g in got]
        del got
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_the_caches_come_back_when_the_call_raises(monkeypatch):
    fa = _fake(monkeypatch)
    cache = fa._flash_attn_bwd.compile_cache

    def boom():
        raise RuntimeError("bad call")

    with pytest.raises(RuntimeError, match="bad call"):
        replay.record(boom, _own(*_tensors(0)), None, None)
    assert fa._flash_attn_bwd.compile_cache is cache


@pytest.mark.parametrize("make", [
    lambda q: torch.full((3, 2), 2.5),
    lambda q: torch.full_like(q, 2.5),
    lambda q: q.new_full((3, 2), 2.5),
    lambda q: torch.zeros(3, 2),
    lambda q: torch.empty(3, 2).fill_(2.5),
])
def test_each_kind_of_allocation_is_logged_with_its_fill(make):
    log = replay._Log()
    q = torch.randn(2, 3)
    with log:
        made = make(q)
    allocs = [s for s in log.steps if s[0] == "alloc"]
    fills = [s[2] for s in log.steps if s[0] == "fill"]
    assert log.other is None and len(allocs) == 1 and allocs[0][1].data_ptr() == made.data_ptr()
    assert (fills[-1] if fills else allocs[0][2]) == (0 if torch.all(made == 0) else 2.5)
