"""The FA4 engine on the GPU: every native feature and every lowered score_mod against the
library's float64 reference, forward and gradients, with the project's tolerance rule
(`fused_attn.testing.bound_from`: factor x the same-dtype error of the reference run in bf16).
Skipped where flash-attn-4 or a sm90 / sm100 GPU is missing."""

from __future__ import annotations

import pytest
import torch

import score_mods as sm

pytestmark = pytest.mark.gpu

fused_attn = pytest.importorskip("fused_attn")
from fused_attn import engines, testing  # noqa: E402
from fused_attn.layouts import logical_shape  # noqa: E402
from helpers.attention import cu_seqlens  # noqa: E402
from helpers.fa4_gpu_cases import dense_inputs, rand  # noqa: E402
from helpers.fa4_gpu_cases import run as _run  # noqa: E402

if not torch.cuda.is_available() or not engines.available("fa4"):
    pytest.skip("needs a CUDA GPU and flash-attn-4", allow_module_level=True)
if torch.cuda.get_device_capability()[0] not in (9, 10):
    pytest.skip("the FA4 engine runs on sm90 / sm100", allow_module_level=True)

DEV = torch.device("cuda")
DT = torch.bfloat16


def _rand(*shape, seed):
    return rand(DEV, *shape, seed=seed)


def check(name, q, k, v, dout, sinks=None, **kw):
    """fa4 vs the float64 reference, out (and lse) and every gradient, bounds from the bf16 reference.
    Two fa4 calls on other values compile the kernels and record the forward and the backward
    (`fused_attn.backends.fa4.replay`, which records on the call after the compiling one); the
    checked call replays both with its own tensors."""
    exact = _run("reference", torch.float64, q, k, v, dout, sinks, **kw)
    same = _run("reference", DT, q, k, v, dout, sinks, **kw)
    _run("fa4", DT, q.flip(-1), k, -v, dout, sinks, **kw)
    _run("fa4", DT, -q, v, k, dout, sinks, **kw)
    got = _run("fa4", DT, q, k, v, dout, sinks, **kw)
    testing.assert_close(got[0].float(), exact[0], testing.bound_from(same[0], exact[0], DT), f"{name} out")
    if kw.get("return_lse"):
        testing.assert_close(got[1].double(), exact[1], testing.bound_from(same[1], exact[1], DT), f"{name} lse")
    for what, g, e, s in zip(("dq", "dk", "dv", "dsinks"), got[2], exact[2], same[2]):
        assert g is not None and torch.isfinite(g).all(), f"{name} {what}: missing or non-finite"
        testing.assert_close(g.double(), e, testing.bound_from(s, e, DT), f"{name} {what}")


def _explained(**kw):
    q = torch.randn(1, 128, 4, 64, device=DEV, dtype=DT)
    return fused_attn.explain(q, q, q, **kw)


NATIVE = {
    "plain": dict(),
    "causal": dict(attn_mask_type="causal"),
    "causal_bottom_right_sq_lt_skv": dict(attn_mask_type="causal_bottom_right", sq=96),
    "window_64_0": dict(window_size=(64, 0), attn_mask_type="causal"),
    "window_32_16": dict(window_size=(32, 16)),
    "gqa_causal": dict(attn_mask_type="causal", hkv=2),
    "mqa": dict(hkv=1),
    "softcap": dict(score_mod=sm.softcap(20.0), attn_mask_type="causal"),
    "sinks_learnable_window": dict(softmax_type="learnable", window_size=(32, 0), attn_mask_type="causal"),
    "sinks_off_by_one": dict(softmax_type="off-by-one"),
    "lse": dict(return_lse=True, attn_mask_type="causal"),
    "deterministic": dict(deterministic=True, attn_mask_type="causal"),
    "head_dim_128": dict(d=128),
    "mod_sliding_window": dict(score_mod=sm.sliding_window(48, 0)),
}


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
@pytest.mark.parametrize("case", list(NATIVE))
def test_native_feature_matches_reference(case, fmt):
    q, k, v, dout, kw = dense_inputs(DEV, NATIVE[case], fmt)
    sinks = _rand(logical_shape(q, fmt)[1], seed=5) if kw.get("softmax_type") == "learnable" else None
    check(f"{case} {fmt}", q, k, v, dout, sinks, qkv_format=fmt, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_thd_varlen_matches_reference(causal):
    lens = [5, 130, 64, 257]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    t, h, d = int(cu[-1]), 4, 64
    q, k, v, dout = (_rand(t, h, d, seed=s) for s in range(4))
    check(f"thd causal={causal}", q, k, v, dout, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
          max_seqlen_q=max(lens), max_seqlen_kv=max(lens), attn_mask_type="padding_causal" if causal else "padding")


def test_thd_softcap_gqa_matches_reference():
    lens = [100, 33, 200]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    t = int(cu[-1])
    q, dout = _rand(t, 8, 64, seed=1), _rand(t, 8, 64, seed=2)
    k, v = _rand(t, 2, 64, seed=3), _rand(t, 2, 64, seed=4)
    check("thd softcap gqa", q, k, v, dout, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
          max_seqlen_q=200, max_seqlen_kv=200, attn_mask_type="padding_causal", score_mod=sm.softcap(30.0))


from helpers.zoo import H as ZH, S as ZS, zoo  # noqa: E402

ZOO_REFUSED = {"morton_natten": "rshift", "power_mod": "pow"}


@pytest.mark.parametrize("name", list(zoo()))
def test_zoo_mod_lowered_to_cute_matches_reference(name):
    mod, _ = zoo(device=DEV, dtype=torch.float32)[name]
    q, k, v, dout = (_rand(1, ZH, ZS, 64, seed=s) for s in range(4))
    if name in ZOO_REFUSED:
        with pytest.raises(NotImplementedError, match=ZOO_REFUSED[name]):
            _run("fa4", DT, q, k, v, dout, qkv_format="bhsd", score_mod=mod)
        return
    trained = {n for n, t in mod.tensors().items() if t.requires_grad}
    if trained:  # FA4 has no gradient for tables: refused with the reason
        with pytest.raises(NotImplementedError, match="need a gradient"):
            _run("fa4", DT, q, k, v, dout, qkv_format="bhsd", score_mod=mod)
        return
    check(f"zoo {name}", q, k, v, dout, qkv_format="bhsd", score_mod=mod)


def test_window_value_change_reaches_the_kernel():
    """A module's sliding window changed between calls runs the new window (no frozen value)."""
    q = torch.randn(1, 256, 4, 64, device=DEV, dtype=DT)
    attn = fused_attn.DotProductAttention(4, 64, score_mod=sm.sliding_window(2, 0), backend="fa4")
    attn(q, q, q)
    attn.score_mod = sm.sliding_window(64, 0)
    got = attn(q, q, q)
    exact = fused_attn.dot_product_attention(q.double(), q.double(), q.double(), score_mod=sm.sliding_window(64, 0),
                                             backend="reference")
    same = fused_attn.dot_product_attention(q, q, q, score_mod=sm.sliding_window(64, 0), backend="reference")
    testing.assert_close(got.double(), exact, testing.bound_from(same, exact, DT), "window 64 after window 2")


def test_scalar_value_change_keeps_the_compiled_kernel():
    """A generated mod's float parameter is an aux scalar: a new value gives new outputs, right."""
    from score_mods import score_mod

    @score_mod
    def tilt(score, b, h, q_idx, kv_idx, slope=0.5):
        return score - slope * abs(q_idx - kv_idx)

    q = torch.randn(1, 128, 4, 64, device=DEV, dtype=DT)
    a = fused_attn.dot_product_attention(q, q, q, score_mod=tilt(slope=0.5), backend="fa4")
    b = fused_attn.dot_product_attention(q, q, q, score_mod=tilt(slope=0.01), backend="fa4")
    exact = fused_attn.dot_product_attention(q.double(), q.double(), q.double(), score_mod=tilt(slope=0.01),
                                             backend="reference")
    same = fused_attn.dot_product_attention(q, q, q, score_mod=tilt(slope=0.01), backend="reference")
    assert not torch.equal(a, b)
    testing.assert_close(b.double(), exact, testing.bound_from(same, exact, DT), "slope 0.01 after 0.5")


def _cu(lens):
    return cu_seqlens(lens).to(DEV)


#: cases of the recorded-call tests: shape of q (and of dout), hkv, then dot_product_attention keywords
REPLAYED = {
    "causal bshd deterministic": dict(shape=(2, 256, 4, 64), attn_mask_type="causal", deterministic=True),
    "gqa window sinks sbhd": dict(shape=(256, 2, 8, 64), hkv=2, qkv_format="sbhd", window_size=(32, 0),
                                  attn_mask_type="causal", softmax_type="learnable"),
    "softcap bhsd d128": dict(shape=(2, 4, 256, 128), qkv_format="bhsd", score_mod=sm.softcap(20.0)),
    "thd gqa causal": dict(shape=(389, 8, 64), hkv=2, qkv_format="thd", cu_seqlens_q=[5, 130, 254],
                           attn_mask_type="padding_causal"),
}


def _case(name):
    """(q, k, v, dout, sinks, keywords) of a REPLAYED case, on fresh random values."""
    kw = dict(REPLAYED[name])
    shape, hkv, fmt = kw.pop("shape"), kw.pop("hkv", None), kw.get("qkv_format", "bshd")
    head_axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[fmt]
    kv_shape = list(shape)
    if hkv is not None:
        kv_shape[head_axis] = hkv
    if fmt == "thd":
        lens = kw.pop("cu_seqlens_q")
        cu = _cu(lens)  # one tensor for both: FA4's causal mask needs equal lengths (bottom-right alignment)
        kw.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    q, dout = _rand(*shape, seed=1), _rand(*shape, seed=4)
    k, v = _rand(*kv_shape, seed=2), _rand(*kv_shape, seed=3)
    sinks = _rand(shape[head_axis], seed=5) if kw.get("softmax_type") == "learnable" else None
    return q, k, v, dout, sinks, kw


def _counting(monkeypatch):
    """Counts `replay.record` / `replay.replay` calls and keeps what each recording concluded
    (a Host says why a signature is not replayed)."""
    from fused_attn.backends.fa4 import replay

    calls = {"record": 0, "replay": 0, "recorded": []}

    def counted(name):
        real = getattr(replay, name)

        def wrapper(*a, **k):
            calls[name] += 1
            got = real(*a, **k)
            if name == "record":
                calls["recorded"].append("Replay" if type(got[1]) is replay.Replay else got[1])
            return got
        return wrapper

    monkeypatch.setattr(replay, "record", counted("record"))
    monkeypatch.setattr(replay, "replay", counted("replay"))
    return calls


def _on_fa4s_own_path(monkeypatch, run):
    """run() with every FA4 call on FA4's own function (each records), whatever earlier calls
    recorded."""
    from fused_attn.backends.fa4 import recorded

    with monkeypatch.context() as forced:
        forced.setattr(recorded, "lookup", lambda owner, sig: None)
        return run()


@pytest.mark.parametrize("case", list(REPLAYED))
def test_a_replayed_forward_is_fa4s_own_forward(case, monkeypatch):
    """A forward after FA4's own forward of a signature (recorded) replays it (thd included: its
    scheduler's buffers are allocated again): one replay and no recording on that call, and bit
    for bit FA4's own output and lse; self-attention (q is k is v) is a signature of its own."""
    q, k, v, _, sinks, kw = _case(case)
    q, k, v = (t.to(DT) for t in (q, k, v))
    kw.update(backend="fa4", return_lse=True, sinks=None if sinks is None else sinks.float())
    fused_attn.dot_product_attention(q.flip(-1), k, v, **kw)  # compiles (or finds) the kernel
    calls = _counting(monkeypatch)
    own = _on_fa4s_own_path(monkeypatch, lambda: fused_attn.dot_product_attention(q, k, v, **kw))
    before = dict(calls, recorded=list(calls["recorded"]))
    got = fused_attn.dot_product_attention(q, k, v, **kw)
    assert calls["replay"] == before["replay"] + 1 and calls["record"] == before["record"], (
        f"{case}: the forward was not replayed ({calls['recorded']})")
    assert torch.equal(got[0], own[0]) and torch.equal(got[1], own[1]), f"{case}: the replay differs from FA4's own"
    if kw.get("qkv_format") in ("bshd", "sbhd", "bhsd") and q.shape == k.shape:  # self-attention
        fused_attn.dot_product_attention(q, q, q, **kw)
        fused_attn.dot_product_attention(q, q, q, **kw)
        replayed = fused_attn.dot_product_attention(q, q, q, **kw)[0]
        ref_kw = {n: x for n, x in kw.items() if n not in ("backend", "return_lse")}
        exact = fused_attn.dot_product_attention(q.double(), q.double(), q.double(), backend="reference", **ref_kw)
        same = fused_attn.dot_product_attention(q, q, q, backend="reference", **ref_kw)
        testing.assert_close(replayed.double(), exact, testing.bound_from(same, exact, DT), f"{case} q is k is v")


@pytest.mark.parametrize("case", list(REPLAYED))
def test_a_replayed_backward_is_fa4s_own_backward(case, monkeypatch):
    """A fwd+bwd after FA4's own fwd+bwd of a signature (recorded) replays both (the backward's
    buffers allocated and its kernels launched without FA4's host path): no recording and two
    replays on that call, gradients (dsinks included) against the float64 reference, and bit for
    bit FA4's own backward where the backward is deterministic."""
    q, k, v, dout, sinks, kw = _case(case)
    _run("fa4", DT, q.flip(-1), k, -v, dout, sinks, **kw)  # compiles (or finds) the kernels
    calls = _counting(monkeypatch)
    own = _on_fa4s_own_path(monkeypatch, lambda: _run("fa4", DT, q, k, v, dout, sinks, **kw))
    before = dict(calls, recorded=list(calls["recorded"]))
    got = _run("fa4", DT, q, k, v, dout, sinks, **kw)
    assert calls["replay"] == before["replay"] + 2 and calls["record"] == before["record"], (
        f"{case}: the fwd+bwd was not replayed ({calls['recorded']})")
    exact = _run("reference", torch.float64, q, k, v, dout, sinks, **kw)
    same = _run("reference", DT, q, k, v, dout, sinks, **kw)
    for what, g, o, e, s in zip(("dq", "dk", "dv", "dsinks"), got[2], own[2], exact[2], same[2]):
        assert g is not None and torch.isfinite(g).all(), f"{case} {what}: missing or non-finite"
        testing.assert_close(g.double(), e, testing.bound_from(s, e, DT), f"{case} replayed {what}")
        if kw.get("deterministic"):
            assert torch.equal(g, o), f"{case} {what}: the replay differs from FA4's own deterministic backward"


def test_explain_names_fa4_and_refusals():
    assert _explained(backend="fa4").backend == "fa4"
    with pytest.raises(NotImplementedError, match="dropout"):
        _explained(backend="fa4", dropout_p=0.1)
    auto = _explained(attn_mask_type="causal")
    assert auto.backend in ("fa4", "cudnn") and auto.reason


def test_first_call_with_a_warm_kernel_directory(tmp_path):
    """A new process with the library's persistent directory set loads FA4's kernels from disk:
    its first call of a configuration another process compiled takes milliseconds, not seconds."""
    import subprocess
    import sys

    code = (
        "import sys, time, torch, fused_attn, score_mods as sm\n"
        f"fused_attn.graph_cache.set_persistent_dir({str(tmp_path)!r})\n"
        "q = torch.randn(2, 512, 4, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "fused_attn.dot_product_attention(q, q, q, score_mod=sm.softcap(7.0), backend='fa4')\n"
        "torch.cuda.synchronize()\n"
        "t0 = time.perf_counter()\n"
        "out = fused_attn.dot_product_attention(q, q, q, attn_mask_type='causal', score_mod=sm.softcap(9.0), "
        "backend='fa4')\n"
        "out.sum().backward(); torch.cuda.synchronize()\n"
        "print((time.perf_counter() - t0) * 1e3)\n"
    )
    cold = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                 .stdout.split()[-1])
    warm = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
                 .stdout.split()[-1])
    print(f"first causal softcap fwd+bwd: cold {cold:.1f} ms, warm directory {warm:.1f} ms")
    assert warm < cold / 4, (cold, warm)


def test_a_capture_after_fa4s_first_calls_survives_a_garbage_collection():
    """FA4's first calls compile kernels (CuTe DSL), whose executors unload their CUDA libraries
    when they are freed, and a library unload is a call a global-mode CUDA graph capture forbids,
    from any thread. Whatever those first calls leave in reference cycles is freed by some later
    garbage-collection pass, which may run inside a user's capture: the capture must survive one.
    In a fresh process (the first calls and a context that may break stay there): thd and dense
    fwd+bwd on FA4, then a cuDNN forward captured with a collection inside, replayed, and compared
    with the same forward run eagerly."""
    import subprocess
    import sys

    code = (
        "import gc, torch, fused_attn\n"
        "q = torch.randn(512, 4, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device='cuda')\n"
        "fused_attn.dot_product_attention(q, q, q, qkv_format='thd', cu_seqlens_q=cu, cu_seqlens_kv=cu, "
        "max_seqlen_q=256, max_seqlen_kv=256, backend='fa4').sum().backward()\n"
        "x = torch.randn(2, 256, 4, 64, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "fused_attn.dot_product_attention(x, x, x, attn_mask_type='causal', backend='fa4').sum().backward()\n"
        "torch.cuda.synchronize()\n"
        "y = torch.randn(2, 256, 4, 64, device='cuda', dtype=torch.bfloat16)\n"
        "step = lambda: fused_attn.dot_product_attention(y, y, y, backend='cudnn')\n"
        "side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(side):\n"
        "    eager = step(); step()\n"
        "torch.cuda.current_stream().wait_stream(side)\n"
        "graph = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(graph):\n"
        "    out = step()\n"
        "    gc.collect()\n"
        "graph.replay(); torch.cuda.synchronize()\n"
        "print('replay equal', torch.equal(out, eager))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-4:])
    assert proc.returncode == 0, f"the capture did not survive a collection after FA4's first calls: {tail[:600]}"
    assert proc.stdout.split()[-1] == "True", f"the replayed forward differs from the eager one: {tail[:300]}"


def test_backward_with_a_given_lse_matches_the_reference():
    """attention_backward (a context-parallel piece's backward) on FA4 with a given output and lse,
    rows that see no key at all (lse -inf) included: Sq 256 > Skv 128 under a bottom-right causal
    mask leaves the first 128 query rows without keys."""
    from fused_attn.functional import attention_backward

    q, dout = _rand(1, 256, 4, 64, seed=1).to(DT), _rand(1, 256, 4, 64, seed=4).to(DT)
    k, v = _rand(1, 128, 4, 64, seed=2).to(DT), _rand(1, 128, 4, 64, seed=3).to(DT)
    kw = dict(attn_mask_type="causal_bottom_right")
    out, lse = fused_attn.dot_product_attention(q, k, v, return_lse=True, backend="reference", **kw)
    assert torch.isneginf(lse[:, :, :128]).all()
    got = attention_backward(q, k, v, out, lse, dout, backend="fa4", **kw)
    same = attention_backward(q, k, v, out, lse, dout, backend="reference", **kw)
    exact = attention_backward(*(t.double() for t in (q, k, v, out)), lse.double(), dout.double(),
                               backend="reference", **kw)
    for what, g, r, e in zip(("dq", "dk", "dv"), got, same, exact):
        assert torch.isfinite(g).all(), what
        testing.assert_close(g.double(), e, testing.bound_from(r, e, DT), f"given-lse {what}")
