"""Recorded FA4 forwards (`fused_attn.backends.fa4.replay`, `recorded`) without a GPU: a stand-in
for FA4's interface (a compile cache and a `_flash_attn_fwd` that launches "kernels" through it,
computing on CPU tensors) checks what is recorded, what is replayed with a later call's tensors
and scalars, what stays on FA4's own path and why, how signatures tell calls apart, and that a
recording keeps no tensor alive. The GPU half (the real kernels against the float64 reference)
is in test_fa4_gpu.py."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from fused_attn.backends.fa4 import install, recorded, replay
from helpers.fa4_stand_in import AuxData, tensors_in


def _kernel(q, k, v, out, lse, scale, cu_q, cu_k, window, aux):
    """A deterministic stand-in kernel: out = scale * q + k - v (+ the first aux scalar and the
    sum of the first aux tensor); lse = the row sums of out."""
    got = scale * q + k - v
    if aux.scalars:
        got = got + float(aux.scalars[0])
    if aux.tensors:
        got = got + aux.tensors[0].sum()
    out.copy_(got)
    lse.copy_(out.sum(-1).transpose(1, 2))


class FakeFa4:
    """`_flash_attn_fwd(q, k, v, out=, lse=, softmax_scale=, window_size_left=, aux_tensors=,
    aux_scalars=)` as FA4's: checks on the host, launches through `compile_cache`. `extra`: a
    zero-filled buffer of its own passed to the kernel; `launches`: how many times it launches;
    returns (out, lse) as FA4's does."""

    def __init__(self, extra=False, launches=1):
        self.calls = 0
        self.extra, self.launches = extra, launches
        iface = self

        def _flash_attn_fwd(q, k, v, out=None, lse=None, softmax_scale=1.0, window_size_left=None,
                            aux_tensors=None, aux_scalars=None, return_lse=True, **_):
            iface.calls += 1
            aux_scalars = tuple(aux_scalars) if aux_scalars else None
            key = (q.dtype, q.shape[-1], window_size_left is not None)
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = _kernel
            cu = torch.zeros(3, dtype=torch.int32) if iface.extra else None
            for _ in range(iface.launches):
                _flash_attn_fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out.detach(), lse,
                                                   softmax_scale, cu, None, window_size_left,
                                                   AuxData(aux_tensors, aux_scalars))
            return out, lse

        _flash_attn_fwd.compile_cache = {}
        self._flash_attn_fwd = _flash_attn_fwd
        self.utils = types.SimpleNamespace(AuxData=AuxData)


@pytest.fixture
def fake(monkeypatch):
    fa = FakeFa4()
    monkeypatch.setattr(install, "module", lambda: fa)
    return fa


def _tensors(seed, b=2, s=8, h=2, d=4):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    return q, k, v, torch.empty(b, s, h, d), torch.empty(b, h, s)


def _own(q, k, v, out, lse):
    return (q, k, v, out, lse, None, None, None)


def _call(fa, q, k, v, out, lse, scale=0.5, window=None, aux_tensors=None, aux_scalars=None):
    return lambda: fa._flash_attn_fwd(q, k, v, out=out, lse=lse, softmax_scale=scale, window_size_left=window,
                                      aux_tensors=aux_tensors, aux_scalars=aux_scalars)


def _expected(q, k, v, scale=0.5, aux_tensors=None, aux_scalars=None):
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1])
    _kernel(q, k, v, out, lse, scale, None, None, None, AuxData(aux_tensors, aux_scalars))
    return out, lse


def _recorded(fa, q, k, v, out, lse, aux_tensors=None, aux_scalars=None):
    """Record on a second call (the first one compiles the stand-in's kernel: nothing concluded)."""
    own = _own(q, k, v, out, lse)
    call = _call(fa, q, k, v, out, lse, aux_tensors=aux_tensors, aux_scalars=aux_scalars)
    assert replay.record(call, own, aux_tensors, aux_scalars)[1] is None
    return replay.record(call, own, aux_tensors, aux_scalars)[1]


def test_a_recorded_forward_runs_with_a_later_calls_tensors_and_scalars(fake):
    q, k, v, out, lse = _tensors(0)
    table = [torch.randn(5)]
    entry = _recorded(fake, q, k, v, out, lse, table, (1.5,))
    assert type(entry) is replay.Replay and fake.calls == 2
    exp_out, exp_lse = _expected(q, k, v, aux_tensors=table, aux_scalars=(1.5,))
    assert torch.equal(out, exp_out) and torch.equal(lse, exp_lse)  # the recording call ran as usual

    q2, k2, v2, out2, lse2 = _tensors(1)
    table2 = [torch.randn(5)]
    got = replay.replay(entry, _own(q2, k2, v2, out2, lse2), table2, (-2.0,))
    assert fake.calls == 2  # FA4's host path did not run again
    exp_out, exp_lse = _expected(q2, k2, v2, aux_tensors=table2, aux_scalars=(-2.0,))
    assert torch.equal(out2, exp_out) and torch.equal(lse2, exp_lse)
    assert got[0] is not None and torch.equal(got[0], out2) and torch.equal(got[1], lse2)  # FA4's (out, lse)


def test_a_recording_keeps_no_tensor_alive(fake):
    q, k, v, out, lse = _tensors(0)
    refs = [weakref.ref(t) for t in (q, k, v, out, lse)]
    entry = _recorded(fake, q, k, v, out, lse)
    assert type(entry) is replay.Replay
    del q, k, v, out, lse
    gc.collect()
    assert all(r() is None for r in refs)

    assert tensors_in(entry) == 0


def test_self_attention_replays_only_for_the_same_aliasing(fake):
    x, _, _, out, lse = _tensors(0)
    own = _own(x, x, x, out, lse)
    entry = _recorded(fake, x, x, x, out, lse)
    assert type(entry) is replay.Replay
    q, k, v, _, _ = _tensors(1)
    assert recorded.signature(own, None, None, ()) != recorded.signature(_own(q, k, v, out, lse), None, None, ())
    y, _, _, out2, lse2 = _tensors(2)
    assert recorded.signature(own, None, None, ()) == recorded.signature(_own(y, y, y, out2, lse2), None, None, ())
    replay.replay(entry, _own(y, y, y, out2, lse2), None, None)
    assert torch.equal(out2, _expected(y, y, y)[0])


def test_signature_tells_apart_what_fa4s_host_path_reads():
    q, k, v, out, lse = _tensors(0)
    base = recorded.signature(_own(q, k, v, out, lse), None, (1.0,), (0.5, False))
    assert base == recorded.signature(_own(*_tensors(3)), None, (7.0,), (0.5, False))  # new values, same kernel
    others = [
        recorded.signature(_own(*_tensors(0, s=16)), None, (1.0,), (0.5, False)),  # a shape
        recorded.signature(_own(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, lse), None, (1.0,),
                           (0.5, False)),  # strides
        recorded.signature(_own(q.half(), k, v, out, lse), None, (1.0,), (0.5, False)),  # a dtype
        recorded.signature(_own(torch.randn(q.numel() + 1)[1:].view(q.shape), k, v, out, lse), None, (1.0,),
                           (0.5, False)),  # 16-byte alignment
        recorded.signature(_own(q, k, v, out, lse), None, (1,), (0.5, False)),  # a scalar's type
        recorded.signature(_own(q, k, v, out, lse), [torch.zeros(3)], (1.0,), (0.5, False)),  # aux tensors
        recorded.signature(_own(q, k, v, out, lse), None, (1.0,), (0.5, True)),  # a constant (causal)
    ]
    assert all(o != base for o in others) and len(set(others)) == len(others)


def test_a_buffer_fa4_makes_for_the_call_is_made_again_on_replay(monkeypatch):
    """Varlen forwards launch with buffers FA4 allocates per call (its scheduler's tile sums): a
    replay allocates them again, zero-filled where FA4 zero-fills."""
    fa = FakeFa4(extra=True)
    monkeypatch.setattr(install, "module", lambda: fa)
    entry = _recorded(fa, *_tensors(0))
    assert type(entry) is replay.Replay
    assert [s.fill for s in entry.steps if type(s) is replay._Alloc] == [0]
    q, k, v, out, lse = _tensors(1)
    replay.replay(entry, _own(q, k, v, out, lse), None, None)
    assert torch.equal(out, _expected(q, k, v)[0])


def test_no_launch_keeps_the_signature_on_fa4s_path_and_several_launches_replay(monkeypatch):
    for launches in (0, 2):
        fa = FakeFa4(launches=launches)
        monkeypatch.setattr(install, "module", lambda: fa)
        q, k, v, out, lse = _tensors(0)
        replay.record(_call(fa, q, k, v, out, lse), _own(q, k, v, out, lse), None, None)  # compiles
        _, entry = replay.record(_call(fa, q, k, v, out, lse), _own(q, k, v, out, lse), None, None)
        if launches == 0:
            assert type(entry) is recorded.Host and "no kernel" in entry.why
        else:
            assert type(entry) is replay.Replay
            assert sum(type(s) is replay._Launch for s in entry.steps) == 2
            q2, k2, v2, out2, lse2 = _tensors(1)
            replay.replay(entry, _own(q2, k2, v2, out2, lse2), None, None)
            assert torch.equal(out2, _expected(q2, k2, v2)[0])


def test_the_compile_caches_are_restored_even_when_the_call_raises(fake):
    cache = fake._flash_attn_fwd.compile_cache
    q, k, v, out, lse = _tensors(0)

    def boom():
        raise RuntimeError("bad call")

    with pytest.raises(RuntimeError, match="bad call"):
        replay.record(boom, _own(q, k, v, out, lse), None, None)
    assert fake._flash_attn_fwd.compile_cache is cache


def test_lookup_keys_each_runner_apart():
    q, k, v, out, lse = _tensors(0)
    sig = recorded.signature(_own(q, k, v, out, lse), None, None, (0.5,))
    a, b = recorded.new_owner(), recorded.new_owner()
    recorded.store(a, sig, recorded.Host("test"))
    assert recorded.lookup(a, sig) == recorded.Host("test") and recorded.lookup(b, sig) is None


@pytest.mark.parametrize("which", ["tensors", "scalars"])
def test_aux_data_that_is_not_the_calls_own_keeps_the_signature_on_fa4s_path(fake, which):
    """The recording compares FA4's aux data with the call's by identity: an equal copy is not the
    call's own (a replay would pass the call's), so the signature stays on FA4's path."""
    q, k, v, out, lse = _tensors(0)
    table, scalars = [torch.randn(5)], (1.5,)
    copied = ([table[0].clone()], scalars) if which == "tensors" else (table, (torch.tensor(1.5).item(),))
    own = _own(q, k, v, out, lse)
    replay.record(_call(fake, q, k, v, out, lse, aux_tensors=table, aux_scalars=scalars), own, table, scalars)
    _, entry = replay.record(_call(fake, q, k, v, out, lse, aux_tensors=copied[0], aux_scalars=copied[1]),
                             own, table, scalars)
    assert type(entry) is recorded.Host and "aux data that is not the call's own" in entry.why
    _, entry = replay.record(_call(fake, q, k, v, out, lse, aux_tensors=table, aux_scalars=scalars), own, table,
                             scalars)
    assert type(entry) is replay.Replay
