"""The FA4 engine without a GPU: the CuTe lowering's text for every mod, what the engine accepts
and refuses (from metadata), its "not installed" path, and backend="auto"'s choice from a
stub timing table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import score_mods as sm
from fused_attn import engine_speed, engines
from fused_attn.backends.fa4 import cute_source, install, support
from fused_attn.problem import Band
from fused_attn.spec import AttentionSpec
from fused_attn.static import StaticProblem
from helpers.stub_engines import StubEngineBase


def _problem(spec_kw=None, **kw) -> StaticProblem:
    spec = dict(qkv_format="bshd", attn_mask_type="no_mask", band=None, padding=False, softmax_scale=None,
                score_mod_key=None, return_lse=False, deterministic=False, backend="fa4")
    spec.update(spec_kw or {})
    if spec.get("score_mod") is not None:
        spec["score_mod_key"] = spec["score_mod"].cache_key
    base = dict(spec=AttentionSpec(**spec), batch=2, heads=8, kv_heads=8, seqlen_q=256, seqlen_kv=256, head_dim=64,
                head_dim_v=64, dtype=torch.bfloat16, device=torch.device("cuda", 0), q_strides=(1,), k_strides=(1,),
                v_strides=(1,), scale=0.125, needs_grad=True, aligned=True, same_lengths=True, q_offsets=False,
                kv_offsets=False, mod_tensors=(), sinks=False)
    base.update(kw)
    return StaticProblem(**base)


# ----------------------------------------------------------------------------------- the lowering text
def test_softcap_source_reads_its_cap_as_a_runtime_scalar():
    src = cute_source.source_for(sm.softcap(30.0))
    assert src.scalars == ("cap",) and src.tensors == ()
    assert "aux_scalars[0]" in src.text and "30.0" not in src.text
    assert "def score_mod(" in src.text and "def score_mod_bwd(grad, score," in src.text
    assert "cute.math.tanh" in src.text
    compile(src.text, "<softcap>", "exec")  # valid Python


def test_digest_is_structural():
    a, b = cute_source.source_for(sm.softcap(30.0)), cute_source.source_for(sm.softcap(5.0))
    c = cute_source.source_for(sm.alibi(sm.alibi_slopes(4)))
    assert a.digest == b.digest and a.text == b.text
    assert a.digest != c.digest


def test_table_gather_flattens_with_contiguous_strides():
    bias = torch.randn(2, 4, 16, 16)
    src = cute_source.source_for(sm.post_scale_bias(bias))
    assert src.tensors == ("bias",) and src.uses_aux_tensors
    # (B, H, Sq, Skv) contiguous strides 1024, 256, 16, 1 as constants of the linear index
    for stride in ("1024", "256", "16"):
        assert f"cute.full_like(q_idx, {stride})" in src.text
    assert "aux_tensors[0][" in src.text


def test_broadcast_dims_indexed_by_b_or_h_are_skipped():
    slopes = torch.rand(1, 4)

    @sm.score_mod
    def per_head(score, b, h, q_idx, kv_idx, t=sm.TensorParam("float")):
        return score + t[b, h]

    src = cute_source.source_for(per_head(t=slopes))
    body = src.text.split("def score_mod(")[1].split("def score_mod_bwd")[0].split("\n", 1)[1]
    assert "h_idx" in body and "b_idx" not in body  # size-1 batch dim: no b term


def test_integer_ops_keep_python_semantics():
    @sm.score_mod
    def blocks(score, b, h, q_idx, kv_idx):
        return sm.where((q_idx - kv_idx) // 4 % 3 == 0, score, -float("inf"))

    text = cute_source.source_for(blocks).text
    assert " // " in text  # Int32 floor division (floordivsi)
    assert "%" not in text  # remainder written as a - (a // b) * b: the sign of the divisor, as Python


def test_unsupported_ops_are_named():
    @sm.score_mod
    def shifty(score, b, h, q_idx, kv_idx):
        return sm.where((q_idx >> 1) == (kv_idx >> 1), score, -float("inf"))

    with pytest.raises(cute_source.Unsupported, match="rshift"):
        cute_source.source_for(shifty)


def test_every_zoo_mod_lowers_or_names_its_op():
    from helpers.zoo import zoo

    refused = {}
    for name, (mod, _) in zoo().items():
        try:
            src = cute_source.source_for(mod)
        except cute_source.Unsupported as exc:
            refused[name] = str(exc)
            continue
        compile(src.text, name, "exec")
        assert src.text.count("@cute.jit") == 2
    assert set(refused) == {"morton_natten", "power_mod"}, refused


# ----------------------------------------------------------------------------------- what FA4 runs
def test_native_features_plan():
    plan = support.decide(_problem({"band": Band(None, 0, False)}), 9)
    assert isinstance(plan, support.Plan) and plan.band == Band(None, 0, False) and plan.source is None
    assert support.window(plan.band) == (True, None, None)
    assert support.window(Band(128, 0, True)) == (False, 128, 0)
    soft = support.decide(_problem({"score_mod": sm.softcap(30.0)}), 9)
    assert soft.source is not None and soft.source.scalars == ("cap",)
    win = support.decide(_problem({"score_mod": sm.sliding_window(64, 0)}), 9)
    assert win.mod_band and win.band is None
    gen = support.decide(_problem({"score_mod": sm.alibi(sm.alibi_slopes(8))}), 9)
    assert gen.source is not None and gen.source.tensors == ("slopes",)


@pytest.mark.parametrize("what,problem_kw,match", [
    ("fp32", dict(dtype=torch.float32), "float16 or bfloat16"),
    ("head dim", dict(head_dim=264, head_dim_v=264), "multiples of 8 from 8 to 256"),
    ("dropout", dict(spec_kw={"dropout_p": 0.1}), "dropout"),
    ("padding", dict(spec_kw={"padding": True}), "padding mask"),
    ("top-left band, Sq != Skv", dict(spec_kw={"band": Band(None, 0, False)}, seqlen_q=128), "bottom-right"),
    ("cpu", dict(device=torch.device("cpu")), "CUDA tensors"),
    ("trained table", dict(spec_kw={"score_mod": sm.post_scale_bias(torch.randn(1, 1, 4, 4))},
                           mod_tensors=(("bias", (1, 1, 4, 4), (16, 16, 4, 1), torch.float32, None, True),)),
     "need a gradient"),
])
def test_refusals_name_the_reason(what, problem_kw, match):
    spec_kw = problem_kw.pop("spec_kw", None)
    got = support.decide(_problem(spec_kw, **problem_kw), 9)
    assert isinstance(got, str) and match in got, (what, got)


def test_sm100_head_dims():
    assert "sm100" in support.decide(_problem(head_dim=160, head_dim_v=160), 10)
    assert isinstance(support.decide(_problem(head_dim=160, head_dim_v=160), 9), support.Plan)


# ----------------------------------------------------------------------------------- not installed
def test_not_installed_path_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_fa4(name, *args, **kw):
        if name.startswith("flash_attn"):
            raise ImportError("No module named 'flash_attn'")
        return real(name, *args, **kw)

    monkeypatch.setattr(install, "_state", {})
    monkeypatch.setattr(builtins, "__import__", no_fa4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    why = install.unavailable()
    assert "flash-attn-4" in why and install.INSTALL_HINT in why


def test_forced_fa4_on_cpu_is_refused_with_the_reason():
    import fused_attn

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="fa4"):
        fused_attn.dot_product_attention(q, q, q, backend="fa4")


# ----------------------------------------------------------------------------------- choice by measurement
def test_family_and_rank_from_a_stub_table(monkeypatch):
    problem = _problem({"band": Band(None, 0, False), "backend": "auto"})
    fam = engine_speed.family(problem)
    assert fam == "dense/causal/none/vanilla/mha/d64"
    rows = {fam: [engine_speed.Measured(*r) for r in ((4096, "cudnn", 0.25, 1.0), (4096, "fa4", 0.23, 0.87),
                                                      (512, "cudnn", 0.05, 0.1), (512, "fa4", 0.06, 0.2))]}
    monkeypatch.setattr(engine_speed, "table", lambda arch: rows)
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")
    order, why = engine_speed.rank(problem, ["cudnn", "fa4", "reference"])
    assert order == ["cudnn", "fa4", "reference"]  # S=256 is nearest the 512 rows: cuDNN faster there
    long = dataclasses.replace(problem, seqlen_q=4096, seqlen_kv=4096)
    order, why = engine_speed.rank(long, ["cudnn", "fa4", "reference"])
    assert order == ["fa4", "cudnn", "reference"] and "fwd+bwd" in why and "fa4 0.870" in why
    inference = dataclasses.replace(long, needs_grad=False)
    assert engine_speed.rank(inference, ["cudnn", "fa4"])[0] == ["fa4", "cudnn"]
    other = _problem({"score_mod": sm.softcap(3.0), "backend": "auto"})
    order, why = engine_speed.rank(other, ["cudnn", "fa4"])
    assert order == ["cudnn", "fa4"] and "no measurement" in why


def test_gpu_time_breaks_a_tie_of_wall_times(monkeypatch):
    """Wall times within WALL_TIE of the fastest are a tie that GPU time breaks; outside it, or
    when a tied row has no GPU time, wall time alone decides."""
    problem = _problem({"band": Band(None, 0, False), "backend": "auto"}, seqlen_q=2048, seqlen_kv=2048)
    fam = engine_speed.family(problem)
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")

    def order(rows, p=problem):
        monkeypatch.setattr(engine_speed, "table", lambda arch: {fam: [engine_speed.Measured(*r) for r in rows]})
        return engine_speed.rank(p, ["cudnn", "fa4", "reference"])

    tie = 1 + engine_speed.WALL_TIE / 2
    got, why = order([(2048, "cudnn", 0.40, 0.968, 0.39, 0.917), (2048, "fa4", 0.40, 0.968 * tie, 0.21, 0.589)])
    assert got == ["fa4", "cudnn", "reference"] and "GPU time decides" in why and "(GPU 0.589)" in why
    apart = 1 + 2 * engine_speed.WALL_TIE
    got, why = order([(2048, "cudnn", 0.40, 0.968, 0.39, 0.917), (2048, "fa4", 0.40, 0.968 * apart, 0.21, 0.589)])
    assert got == ["cudnn", "fa4", "reference"] and "GPU time decides" not in why
    got, _ = order([(2048, "cudnn", 0.40, 0.968), (2048, "fa4", 0.40, 0.968 * tie)])  # a table without GPU times
    assert got == ["cudnn", "fa4", "reference"]
    inference = dataclasses.replace(problem, needs_grad=False)  # forward columns: fa4's wall is faster outright
    got, _ = order([(2048, "cudnn", 0.40, 0.968, 0.39, 0.917), (2048, "fa4", 0.30, 0.968 * tie, 0.45, 0.589)],
                   inference)
    assert got == ["fa4", "cudnn", "reference"]


def test_the_table_reads_rows_with_and_without_gpu_times(monkeypatch, tmp_path):
    path = tmp_path / "sm90.csv"
    path.write_text("family,seq,engine,fwd_ms,fwd_bwd_ms,fwd_gpu_ms,fwd_bwd_gpu_ms\n"
                    "dense/causal/none/vanilla/mha/d64,2048,cudnn,0.1,0.5,0.09,0.45\n"
                    "dense/causal/none/vanilla/mha/d64,2048,fa4,0.1,0.5,,\n"
                    "dense/causal/none/vanilla/mha/d64,oops,fa4,0.1,0.5,,\n")
    monkeypatch.setattr(engine_speed, "table_path", lambda arch: str(path))
    engine_speed.clear()
    try:
        rows = engine_speed.table("sm90")["dense/causal/none/vanilla/mha/d64"]
    finally:
        engine_speed.clear()
    assert rows == [engine_speed.Measured(2048, "cudnn", 0.1, 0.5, 0.09, 0.45),
                    engine_speed.Measured(2048, "fa4", 0.1, 0.5, None, None)]  # the malformed row is skipped


class _Stub(StubEngineBase):
    auto_devices = ("cuda",)

    def __init__(self, name):
        self.name = name

    def make_runner(self, problem):
        return f"runner of {self.name}"

    def traced_refusal(self, *args):
        return "stub"


def test_choose_follows_the_table(monkeypatch):
    problem = _problem({"backend": "auto"}, seqlen_q=4096, seqlen_kv=4096)
    fam = engine_speed.family(problem)
    monkeypatch.setattr(engine_speed, "table", lambda arch: {fam: [engine_speed.Measured(4096, "stub_a", 1.0, 3.0),
                                                                   engine_speed.Measured(4096, "stub_b", 1.1, 2.0)]})
    monkeypatch.setattr(engine_speed, "arch_of", lambda device: "sm90")
    engines.register(_Stub("stub_a"))
    engines.register(_Stub("stub_b"))
    try:
        name, reason, runner = engines.choose(problem)
        assert name == "stub_b" and runner == "runner of stub_b" and "measured on sm90" in reason
        name, _, _ = engines.choose(dataclasses.replace(problem, needs_grad=False))
        assert name == "stub_a"
    finally:
        engines.unregister("stub_a")
        engines.unregister("stub_b")
