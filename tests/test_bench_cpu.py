"""CPU smoke tests of the benchmark harness (fused_attn.bench): no GPU needed, a few seconds."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F

from fused_attn.bench import cpu_smoke, main
from fused_attn.bench.common import (Group, Impl, ImplWrongError, attn_flops, check_impl, gpu_slug,
                                     reference_attention, tolerances, varlen_flops)
from fused_attn.bench.runner import run_config
from fused_attn.bench.varlen import _doc_bounds, cu_seqlens, random_lengths


def _read_csv(path):
    with open(path) as f:
        header = f.readline()
        return header, list(csv.DictReader(f))


def test_cpu_smoke_checks_times_and_writes_csv(tmp_path):
    result = cpu_smoke(str(tmp_path))
    assert result.failures == []
    header, rows = _read_csv(tmp_path / "smoke_cpu.csv")
    assert header.startswith("# gpu cpu, torch " + torch.__version__)
    assert (tmp_path / "smoke_cpu.md").read_text().count("| config |") >= 3
    timed = [r for r in rows if r["ms"]]
    assert {r["suite"] for r in timed} == {"dense", "mods", "varlen"}
    for r in timed:
        assert float(r["ms"]) > 0 and float(r["tflops"]) > 0
        assert 0 <= float(r["max_err"]) < 0.05, r
    assert {r["impl"] for r in rows if r["suite"] == "dense"} == {"fused_attn", "torch_sdpa_math"}
    rebuild = [r for r in rows if r["mode"] == "rebuild"]
    assert len(rebuild) == 1 and rebuild[0]["builds_delta"] == "0"
    host = {(r["mode"], r["impl"]) for r in rows if r["suite"] == "host" and r.get("us_per_call")}
    assert host == {("fwd", "fused_attn functional"), ("fwd", "fused_attn module"), ("fwd", "fused_attn functional softcap"),
                    ("fwd", "fused_attn functional softcap + causal"), ("fwd+bwd", "fused_attn functional"),
                    ("fwd+bwd", "fused_attn module")}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_cuda_says_so_and_exits_zero(tmp_path, capsys):
    assert main(["bench", "dense", "--out", str(tmp_path)]) == 0
    assert "need a CUDA GPU" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_main_rejects_unknown_suite():
    with pytest.raises(SystemExit):
        main(["bench", "nope"])


def test_flops_formulas():
    full = 4.0 * 2 * 16 * 4096 * 4096 * 128
    assert attn_flops(2, 16, 4096, 4096, 128, causal=False, mode="fwd") == full
    assert attn_flops(2, 16, 4096, 4096, 128, causal=True, mode="fwd") == full / 2
    assert attn_flops(2, 16, 4096, 4096, 128, causal=False, mode="fwd_bwd") == 3.5 * full
    lengths = [64, 2048, 128]
    want = 4.0 * 16 * 64 * (64 ** 2 + 2048 ** 2 + 128 ** 2)
    assert varlen_flops(lengths, 16, 64, causal=False, mode="fwd") == want
    assert varlen_flops(lengths, 16, 64, causal=True, mode="fwd_bwd") == want / 2 * 3.5
    assert want < 4.0 * 16 * 64 * 3 * 2048 ** 2  # never B * max_S^2


def test_reference_attention_matches_torch_float64():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 33, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 33, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(33, 33, dtype=torch.bool).tril()
    got = reference_attention(q, k, v, scale=0.25, mask=mask, dtype=torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got, want)
    cap = 2.0
    got = reference_attention(q, k, v, scale=0.25, dtype=torch.float64,
                              score_fn=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.softmax(cap * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / cap), -1) @ vv
    torch.testing.assert_close(got, want)


def _ref_and_tol():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    ref32 = {"out": reference_attention(q, k, v, scale=0.25)}
    low = {"out": reference_attention(q, k, v, scale=0.25, dtype=torch.bfloat16)}
    return ref32, tolerances(ref32, low)


def test_check_impl_accepts_bf16_and_rejects_wrong_or_nan():
    ref32, tol = _ref_and_tol()
    out = ref32["out"]
    ok = Impl("ok", lambda: None, None, lambda: {"out": out.to(torch.bfloat16)})
    assert check_impl(ok, ref32, tol, lambda key, t: t)["out"] < tol["out"]
    wrong = Impl("wrong", lambda: None, None, lambda: {"out": out * 1.1})
    with pytest.raises(ImplWrongError, match="wrong: out rel max error"):
        check_impl(wrong, ref32, tol, lambda key, t: t)
    nan = out.clone()
    nan[0, 0, 3, 1] = float("nan")
    with pytest.raises(ImplWrongError, match="nan: out rel max error inf"):
        check_impl(Impl("nan", lambda: None, None, lambda: {"out": nan}), ref32, tol, lambda key, t: t)


def test_run_config_does_not_time_wrong_impls_and_reports_them():
    ref32, tol = _ref_and_tol()
    out = ref32["out"]

    def boom():
        raise NotImplementedError("no such kernel")

    impls = [Impl("good", lambda: out + 1, None, lambda: {"out": out.clone()}, required=True),
             Impl("bad", lambda: out + 1, None, lambda: {"out": -out}, required=False),
             Impl("peer_crash", boom, None, boom, required=False),
             Impl("own_crash", boom, None, boom, required=True)]
    res = run_config("t", "cfg", impls, ref32, tol, lambda key, t: t, {"fwd": 1e9}, torch.device("cpu"), modes=("fwd",))
    assert len(res.failures) == 2
    assert "bad: out rel max error" in res.failures[0] and "own_crash failed: NotImplementedError" in res.failures[1]
    by = {r["impl"]: r for r in res.rows}
    assert by["good"]["ms"] > 0 and by["good"]["x_vs_good"] == 1.0 and by["good"]["x_vs_bad"] is None
    assert by["bad"]["ms"] is None and by["bad"]["note"].startswith("WRONG")
    assert by["peer_crash"]["note"].startswith("unsupported: NotImplementedError")


def test_group_ratios_and_peak():
    g = Group("s", "c", "fwd", flops=798e9)
    g.add("a", 1.0, 0.0)
    g.add("b", 2.0, 0.0)
    rows = g.finish()
    assert rows[0]["x_vs_b"] == 2.0 and rows[1]["x_vs_a"] == 0.5
    assert math.isclose(rows[0]["tflops"], 798.0) and math.isclose(rows[0]["pct_peak"], 100.0)


def test_gpu_slug():
    assert gpu_slug({"gpu": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert gpu_slug({"gpu": "NVIDIA H200"}) == "h200"
    assert gpu_slug({"gpu": "cpu"}) == "cpu"


def test_lengths_and_document_bounds():
    lengths = random_lengths(8, 2048, 64, seed=0)
    assert lengths == random_lengths(8, 2048, 64, seed=0) and lengths != random_lengths(8, 2048, 64, seed=1)
    assert all(x % 64 == 0 and 64 <= x <= 2048 for x in lengths)
    assert cu_seqlens([3, 5], torch.device("cpu")).tolist() == [0, 3, 8]
    bounds = _doc_bounds(2, 8192, 16, seed=11)
    assert bounds.shape == (2, 17) and bounds.dtype == torch.int32
    assert (bounds[:, 0] == 0).all() and (bounds[:, -1] == 8192).all()
    assert (bounds[:, 1:] > bounds[:, :-1]).all() and (bounds % 64 == 0).all()
