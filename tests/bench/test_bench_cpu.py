"""CPU smoke tests of the benchmark harness (the benchmarks package): no GPU needed, a few seconds."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks import cpu_smoke, dense, host, main
from benchmarks.common import (Group, Impl, ImplWrongError, attn_flops, check_impl, gpu_slug,
                                     host_us_launching, naive_attention, reference_and_bounds, varlen_flops)
from benchmarks.runner import run_config
from fused_attn.testing import agreement_bound, assert_close, bound_from, grad_tolerances, max_error, tolerance
from benchmarks.varlen import _doc_bounds, cu_seqlens, random_lengths


def _read_csv(path):
    with open(path) as f:
        header = f.readline()
        return header, list(csv.DictReader(f))


@pytest.mark.slow  # every benchmark suite at tiny shapes on CPU, models included
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
        # absolute error vs the float64 reference, within the bf16 bound, which is itself small
        assert 0 < float(r["max_err"]) <= float(r["bound"]) < 0.1, r
        assert r["worst"] == "out" if r["mode"] == "fwd" else r["worst"] in ("out", "dq", "dk", "dv", "dbias", "dtable"), r
    trained = {r["config"].split(" B")[0] for r in timed if "trained" in r["config"]}
    assert trained == {"post_scale_bias float32 trained", "post_scale_bias bfloat16 trained",
                       "T5 relative_position_bias trained"}
    assert {r["impl"] for r in rows if r["suite"] == "dense"} == {"fused_attn", "torch_sdpa_math"}
    rebuild = [r for r in rows if r["mode"] == "rebuild"]
    assert len(rebuild) == 1 and rebuild[0]["builds_delta"] == "0"
    assert 0 < float(rebuild[0]["max_err"]) <= float(rebuild[0]["bound"])
    host_fwd = [r for r in rows if r["suite"] == "host" and r["mode"] == "fwd"]
    assert host_fwd and all(0 < float(r["max_err"]) <= float(r["bound"]) < 0.1 for r in host_fwd)
    assert "float64 reference" in (tmp_path / "smoke_cpu.md").read_text()
    host = {(r["mode"], r["impl"]) for r in rows if r["suite"] == "host" and r.get("us_per_call")}
    through_transformers = {("fwd+bwd", "transformers fn: fused_attn")} if _has_transformers() else set()
    assert host == {("fwd", "fused_attn functional"), ("fwd", "fused_attn module"), ("fwd", "fused_attn functional softcap"),
                    ("fwd", "fused_attn functional softcap + causal"), ("fwd+bwd", "fused_attn functional"),
                    ("fwd+bwd", "fused_attn module"),
                    ("fwd+bwd", "floor: empty Python autograd.Function (no attention)")} | through_transformers
    # the attention fwd+bwd rows were checked (gradients against the float64 reference)
    checked = [r for r in rows if r["suite"] == "host" and r["mode"] == "fwd+bwd" and "fused_attn" in r["impl"]]
    assert len(checked) == 2 + len(through_transformers)
    assert checked and all(0 < float(r["worst_err_over_bound"]) <= 1 for r in checked)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_main_without_cuda_says_so_and_fails(tmp_path, capsys):
    assert main(["bench", "dense", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "need a CUDA GPU" in err and "--cpu-smoke" in err
    assert list(tmp_path.iterdir()) == []


def test_cpu_suite_grid_and_only(monkeypatch):
    """The cpu suite's grid: bf16 and fp32 rows for plain causal calls and for the softcap score_mod;
    --only reaches the grid."""
    from benchmarks import cpu

    labels = [c[0] for c in cpu.configs(quick=False)]
    for dtype in ("bf16", "fp32"):
        assert any("softcap" in x and dtype in x for x in labels) and any("README" in x and dtype in x for x in labels)
    assert [c[0] for c in cpu.configs(quick=True, only="softcap")] == [x for x in labels if "softcap" in x]
    seen = []
    monkeypatch.setattr(cpu, "run", lambda quick, out, only=None: seen.append((quick, only)) or [])
    assert main(["bench", "cpu", "--quick", "--only", "fp32"]) == 0 and seen == [(True, "fp32")]


def test_main_rejects_unknown_suite():
    with pytest.raises(SystemExit):
        main(["bench", "nope"])


def test_main_rejects_an_unknown_model_family(capsys):
    assert main(["bench", "models", "--families", "gemma2,nope"]) == 2
    out = capsys.readouterr().out
    assert "'nope'" in out and "gemma2" in out and "llama" in out


def test_main_rejects_an_unknown_model_implementation(capsys):
    assert main(["bench", "models", "--impls", "sdpa,nope"]) == 2
    out = capsys.readouterr().out
    assert "'nope'" in out and "fused_attn_fa4" in out and "flash_attention_4" in out and "fused_attn_cudnn" in out


def test_models_suite_passes_its_impls_and_reports_after_each_family(monkeypatch):
    pytest.importorskip("transformers")
    from benchmarks import models
    from benchmarks.runner import SuiteResult

    seen, reports = [], []

    def fake_run_model(family, quick, device, impls=None):
        seen.append((family, impls))
        return SuiteResult(rows=[{"family": family}])

    monkeypatch.setattr(models, "run_model", fake_run_model)
    got = models.run(True, torch.device("cpu"), families=("llama", "gemma2"), impls=("fused_attn", "sdpa"),
                     after_family=lambda so_far: reports.append(len(so_far.rows)))
    assert seen == [("llama", ("fused_attn", "sdpa")), ("gemma2", ("fused_attn", "sdpa"))]
    assert reports == [1, 2] and len(got.rows) == 2


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


def _bhsd(g, b, h, s, d, dtype=torch.float64):
    return torch.randn(b, h, s, d, generator=g, dtype=dtype)


@pytest.mark.slow
def test_naive_attention_matches_torch_float64_with_grads():
    g = torch.Generator().manual_seed(0)
    q, do = _bhsd(g, 2, 4, 33, 16), _bhsd(g, 2, 4, 33, 16)
    k, v = _bhsd(g, 2, 2, 33, 16), _bhsd(g, 2, 2, 33, 16)
    mask = torch.ones(33, 33, dtype=torch.bool).tril()
    got = naive_attention(q, k, v, scale=0.25, mask=mask, dtype=torch.float64, grad_out=do)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.25, enable_gqa=True)
    assert_close(got["out"], want, agreement_bound(want), "out")
    for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(want, leaves, do)):
        assert_close(got[name], grad, agreement_bound(grad), name)
    cap = 2.0
    got = naive_attention(q, k, v, scale=0.25, dtype=torch.float64,
                          score_fn=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = torch.softmax(cap * torch.tanh(q @ kk.transpose(-1, -2) * 0.25 / cap), -1) @ vv
    assert_close(got["out"], want, agreement_bound(want), "softcap out")
    assert set(got) == {"out"}


@pytest.mark.slow
def test_naive_attention_row_blocks_match_one_block():
    """The large-shape path (query-row blocks, dk/dv summed over blocks) against one block, with
    a mask, GQA and a score_fn that reads every index (offsets of the blocks)."""
    g = torch.Generator().manual_seed(3)
    q, do = _bhsd(g, 1, 4, 50, 8), _bhsd(g, 1, 4, 50, 8)
    k, v = _bhsd(g, 1, 2, 50, 8), _bhsd(g, 1, 2, 50, 8)
    mask = torch.ones(50, 50, dtype=torch.bool).tril()
    fn = lambda s, b, h, qi, ki: s + 0.1 * h - 0.05 * (qi - ki).abs() + 0.2 * b
    one = naive_attention(q, k, v, scale=0.3, dtype=torch.float64, mask=mask, score_fn=fn, grad_out=do)
    blocks = naive_attention(q, k, v, scale=0.3, dtype=torch.float64, mask=mask, score_fn=fn, grad_out=do,
                             block_scores=4 * 50 * 7)  # 7 rows a block: 8 blocks, the last one short
    for key in ("out", "dq", "dk", "dv"):
        assert_close(blocks[key], one[key], agreement_bound(one[key]), key)
    low = naive_attention(q, k, v, scale=0.3, dtype=torch.bfloat16, mask=mask, score_fn=fn, grad_out=do,
                          block_scores=4 * 50 * 7)
    assert all(t.dtype == torch.bfloat16 for t in low.values())
    bf16_bounds = [tolerance(q, k, v, 0.3, torch.bfloat16, mask, fn)]
    bf16_bounds += grad_tolerances(q, k, v, do, 0.3, torch.bfloat16, mask, fn)[1]
    for key, bound in zip(("out", "dq", "dk", "dv"), bf16_bounds):  # the bf16 computation stays a bf16-accurate one
        assert_close(low[key], one[key], bound, key)


def _ref_and_tol():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.bfloat16) for _ in range(3))
    return reference_and_bounds(lambda dt: naive_attention(q, k, v, scale=0.25, dtype=dt), torch.bfloat16)


@pytest.mark.slow
def test_reference_and_bounds_follow_the_shared_rule():
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.bfloat16) for _ in range(4))
    compute = lambda dt: naive_attention(q, k, v, scale=0.25, dtype=dt, grad_out=do)
    expected, bounds = reference_and_bounds(compute, torch.bfloat16)
    same = compute(torch.bfloat16)
    assert set(expected) == set(bounds) == {"out", "dq", "dk", "dv"}
    for key, want in expected.items():
        assert want.dtype == torch.float64
        assert bounds[key] == bound_from(same[key], want, torch.bfloat16)
        assert max_error(same[key], want) < bounds[key] < 0.1, key


def test_check_impl_accepts_bf16_and_rejects_wrong_or_nan():
    expected, bounds = _ref_and_tol()
    out = expected["out"]
    ok = Impl("ok", lambda: None, None, lambda: {"out": out.to(torch.bfloat16)})
    assert check_impl(ok, expected, bounds, lambda key, t: t)["out"] < bounds["out"]
    wrong = Impl("wrong", lambda: None, None, lambda: {"out": out * 1.1})
    with pytest.raises(ImplWrongError, match="wrong: out max abs error .* > bound .* float64 reference") as info:
        check_impl(wrong, expected, bounds, lambda key, t: t)
    assert info.value.key == "out" and info.value.err > info.value.bound == bounds["out"]
    nan = out.clone()
    nan[0, 0, 3, 1] = float("nan")
    with pytest.raises(ImplWrongError, match="nan: out max abs error nan .*1 non-finite entries"):
        check_impl(Impl("nan", lambda: None, None, lambda: {"out": nan}), expected, bounds, lambda key, t: t)
    with pytest.raises(ImplWrongError, match=r"shape: out shape \(1, 2, 40\) != expected \(1, 2, 40, 16\)"):
        check_impl(Impl("shape", lambda: None, None, lambda: {"out": out[..., 0]}), expected, bounds,
                   lambda key, t: t)


def test_run_config_does_not_time_wrong_impls_and_reports_them():
    expected, bounds = _ref_and_tol()
    out = expected["out"]

    def boom():
        raise NotImplementedError("no such kernel")

    impls = [Impl("good", lambda: out + 1, None, lambda: {"out": out.clone()}, required=True),
             Impl("bad", lambda: out + 1, None, lambda: {"out": -out}, required=False),
             Impl("peer_crash", boom, None, boom, required=False),
             Impl("own_crash", boom, None, boom, required=True)]
    res = run_config("t", "cfg", impls, expected, bounds, lambda key, t: t, {"fwd": 1e9}, torch.device("cpu"),
                     modes=("fwd",))
    assert expected == {}  # the reference is freed before timing
    assert len(res.failures) == 2
    assert "bad: out max abs error" in res.failures[0] and "own_crash failed: NotImplementedError" in res.failures[1]
    assert [r["impl"] for r in res.rows] == ["good", "bad", "peer_crash", "own_crash"]
    by = {r["impl"]: r for r in res.rows}
    assert by["good"]["ms"] > 0 and by["good"]["x_vs_good"] == 1.0 and by["good"]["x_vs_bad"] is None
    assert by["good"]["max_err"] == 0.0 and by["good"]["bound"] == bounds["out"] and by["good"]["worst"] == "out"
    assert by["bad"]["ms"] is None and by["bad"]["note"].startswith("WRONG")
    assert by["bad"]["max_err"] > by["bad"]["bound"] == bounds["out"]
    assert by["peer_crash"]["note"].startswith("unsupported: NotImplementedError")


@pytest.mark.slow
def test_dense_run_fails_on_a_subtly_wrong_fused_attn(monkeypatch):
    """The whole dense path (slice, float64 reference, bf16 bound, check): a fused_attn that
    gets the softmax scale 5% wrong is reported and not timed; the correct peer still is."""
    real_impls_for = dense.impls_for

    def impls_for(q, k, v, do, causal, device):
        good = real_impls_for(q, k, v, do, causal, device)[1]  # torch_sdpa_math
        d = q.shape[-1]

        def off(a, b, c):
            o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2),
                                               is_causal=causal, scale=1.05 / math.sqrt(d), enable_gqa=True)
            return o.transpose(1, 2)

        return [dense._autograd_impl("fused_attn", off, q, k, v, do, True), good]

    monkeypatch.setattr(dense, "impls_for", impls_for)
    res = dense.run_one(1, 64, 4, 2, 16, True, torch.device("cpu"), seed=0)
    assert len(res.failures) == 1 and "dense / B1 S64 H4/2 D16 causal: fused_attn: " in res.failures[0]
    assert "max abs error" in res.failures[0] and "> bound" in res.failures[0]
    by = {(r["impl"], r["mode"]): r for r in res.rows}
    for mode in ("fwd", "fwd_bwd"):
        assert by[("fused_attn", mode)]["ms"] is None and by[("fused_attn", mode)]["note"].startswith("WRONG")
        assert by[("torch_sdpa_math", mode)]["ms"] > 0
        assert by[("torch_sdpa_math", mode)]["max_err"] <= by[("torch_sdpa_math", mode)]["bound"]


@pytest.mark.slow
def test_host_run_fails_on_a_wrong_forward(monkeypatch):
    """A fused_attn forward 2% off is a failure of the host suite and its row is not timed."""
    real = host._forwards

    def forwards(q, k, v, device):
        fns = real(q, k, v, device)
        good = fns["fused_attn functional"]
        fns["fused_attn functional"] = lambda: good() * 1.02
        return fns

    monkeypatch.setattr(host, "_forwards", forwards)
    timed = []
    monkeypatch.setattr(host, "host_us_rounds",  # the check, not the timing
                        lambda fns, device, calls: timed.append(list(fns)) or {name: [1.0, 1.5] for name in fns})
    monkeypatch.setattr(host, "_build_rows", lambda device: [])
    res = host.run(True, torch.device("cpu"))
    assert len(res.failures) == 1 and res.failures[0].startswith("host / fused_attn functional: out max abs error")
    row = next(r for r in res.rows if r["mode"] == "fwd" and r["impl"] == "fused_attn functional")
    assert row["us_per_call"] is None and row["note"].startswith("WRONG") and row["max_err"] > row["bound"]
    assert "fused_attn functional" not in timed[0] and "fused_attn module" in timed[0]  # the forward rows


def test_host_ratio_notes_give_the_round_by_round_range():
    rows = [{"mode": "fwd", "impl": "fused_attn functional", "us_per_call": 22.0},
            {"mode": "fwd", "impl": "raw_cudnn execute (tensor_uids)", "us_per_call": 16.0}]
    rounds = {("fwd", "fused_attn functional"): [22.0, 30.0, 24.0],
              ("fwd", "raw_cudnn execute (tensor_uids)"): [16.0, 20.0, 24.0]}
    note = host._ratio_notes(rows, rounds)[0]
    assert note.startswith("fwd host, functional vs the frontend's bare ordered execute: 1.38x (22.0 / 16.0 us)")
    assert note.endswith("round by round 1.00x-1.50x")
    assert "round by round" not in host._ratio_notes(rows)[0]


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


@pytest.mark.slow
def test_mods_bench_checks_trained_gradients_over_the_whole_batch():
    """The trained rows (post_scale_bias, T5's table) time and check the trained leaf's gradient
    (summed over every batch row): a wrong gradient fails the check."""
    from benchmarks import mods as M
    from benchmarks.common import ImplWrongError, check_impl, reference_and_bounds

    dev, (b, h, s, d) = torch.device("cpu"), (2, 2, 64, 16)
    q, k, v, do = M._inputs(dev, b, h, s, d, seed=7)
    trained = [c for c in M.cases(dev, b, h, s) if c.trained]
    assert {c.name.split()[0] for c in trained} == {"post_scale_bias", "T5"}
    for case in trained:
        hs = M._checked_heads(case, b, h, s)
        impl = M._impl("fused", M._fused_fn(case.fused_kwargs()["fused_attn"], "reference"), q, k, v, do, True,
                       case.trained)
        expected, bounds = reference_and_bounds(lambda dt: M._reference(q, k, v, do, case, hs, dt), q.dtype)
        (name,) = case.trained
        shape = list(case.trained[name].shape)
        shape[case.trained_head_dim] = hs
        assert expected["d" + name].shape == tuple(shape)
        assert set(check_impl(impl, expected, bounds, M._select(case, hs))) == {"out", "dq", "dk", "dv", "d" + name}
        right = impl.outputs
        impl.outputs = lambda: {**right(), "d" + name: right()["d" + name] * 1.1}
        with pytest.raises(ImplWrongError, match="d" + name):
            check_impl(impl, expected, bounds, M._select(case, hs))


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def test_split_times_sit_next_to_ms_and_ratios_stay_on_ms():
    """gpu_ms / host_us (the split a suite may measure) follow ms; the peer ratios use ms alone."""
    g = Group("s", "c", "fwd", flops=2e9)
    g.add("a", 2.0, 1e-3, split={"gpu_ms": 1.5, "host_us": 40.0})
    g.add("b", 4.0, 1e-3, split={"gpu_ms": 1.0, "host_us": 900.0})
    rows = g.finish()
    assert list(rows[0])[:7] == ["suite", "config", "mode", "impl", "ms", "gpu_ms", "host_us"]
    assert rows[0]["x_vs_b"] == 2.0 and rows[1]["x_vs_a"] == 0.5
    assert rows[0]["tflops"] == pytest.approx(1.0)


def test_host_us_launching_times_the_calls_themselves():
    import time

    us = host_us_launching(lambda: time.sleep(0.002), torch.device("cpu"), calls=5, rounds=2)
    assert 2000.0 <= us < 50000.0


def test_profiler_passes_run_after_every_suite_is_timed(tmp_path, monkeypatch):
    """torch.profiler leaves CUPTI attached after a pass: main() runs the deferred passes only
    once every suite's timings are taken, then writes the rows they filled."""
    import benchmarks as bench
    from benchmarks.runner import SuiteResult

    events = []

    def suite(name):
        def run(quick, device):
            events.append(f"{name} timed")
            result = SuiteResult()
            row = {"suite": name, "config": "c", "impl": "fused_attn", "ms": 1.0, "gpu_ms": None}
            result.rows.append(row)

            def fill():
                events.append(f"{name} profiled")
                row["gpu_ms"] = 0.5

            result.defer_profile(f"{name} pass", fill)
            if name == "varlen":
                result.defer_profile("broken pass", lambda: 1 / 0)
            return result
        return run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda device: {"gpu": "NVIDIA H200", "torch": torch.__version__})
    monkeypatch.setattr(bench, "_suite_runner", suite)
    monkeypatch.setattr(bench, "SUITES", ("dense", "varlen"))
    written = []
    write = bench.write_results

    def spy(name, rows, *args):
        written.append((name, [r["gpu_ms"] for r in rows]))
        return write(name, rows, *args)

    monkeypatch.setattr(bench, "write_results", spy)
    assert main(["bench", "all", "--out", str(tmp_path)]) == 1  # the broken pass is a failure
    # each suite's rows reach the disk as soon as it is timed, and again once profiled
    assert written == [("dense", [None]), ("varlen", [None]), ("dense", [0.5]), ("varlen", [0.5])]
    assert events == ["dense timed", "varlen timed", "dense profiled", "varlen profiled"]
    for name in ("dense", "varlen"):
        _, rows = _read_csv(tmp_path / f"{name}_h200.csv")
        assert [r["gpu_ms"] for r in rows] == ["0.5"]


def test_a_suite_result_merges_and_runs_its_profiler_passes_once():
    from benchmarks.runner import SuiteResult

    seen = []
    a, b = SuiteResult(), SuiteResult()
    a.defer_profile("a", lambda: seen.append("a"))
    b.defer_profile("b", lambda: seen.append("b"))
    a.extend(b)
    a.run_profiled()
    a.run_profiled()
    assert seen == ["a", "b"] and a.profiled == [] and a.failures == []


@pytest.mark.slow
def test_recompile_limit_reports_are_collected():
    """A torch.compile function past its recompile limit runs uncompiled: the models suite notes it."""
    from benchmarks.models import recompile_limit_hits

    torch._dynamo.reset()

    @torch.compile(backend="eager", dynamic=False)
    def add_one(x):
        return x + 1

    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            with recompile_limit_hits() as within:
                add_one(torch.ones(2))
            assert within == []
            with recompile_limit_hits() as hits:
                assert torch.equal(add_one(torch.ones(3)), torch.full((3,), 2.0))  # a new shape: one compile too many
    finally:
        torch._dynamo.reset()
    assert len(hits) == 1 and "recompile_limit" in hits[0]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_step_rows_are_checked_against_float64_before_timing(causal):
    """The gate the varlen step's flash-attn-4 rows pass before they are timed: a right varlen
    call passes; the other mask, or an output 10% off, is refused."""
    import fused_attn
    from benchmarks.steps import check_varlen_impl

    def call(window):
        return lambda q, k, v, cq, ck, mq, mk: fused_attn.varlen_attn(q, k, v, cq, ck, mq, mk, window_size=window)

    right, other = call((-1, 0)), call((-1, -1))
    if not causal:
        right, other = other, right
    cpu = torch.device("cpu")
    check_varlen_impl("right", right, 2, 16, cpu, causal)
    for wrong in (other, lambda *a: right(*a) * 1.1):
        with pytest.raises(ImplWrongError):
            check_varlen_impl("wrong", wrong, 2, 16, cpu, causal)


def test_fa4_rows_only_where_flash_attn_4_runs():
    """Without a GPU (or without flash-attn-4) the models and varlen-step suites keep their rows."""
    from benchmarks.models import IMPLS, default_impls
    from benchmarks.steps import fa4_varlen_impls

    assert default_impls(torch.device("cpu")) == IMPLS
    assert fa4_varlen_impls(False, torch.device("cpu")) == {}


def test_engine_wall_times_come_from_rounds_in_which_implementations_take_turns(monkeypatch):
    """bench engines' wall time: every step runs its n steps once per round, in turn with the
    others, and the reported time is the median over rounds with the rounds' spread."""
    from benchmarks import bench_engines

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    turns = [1.0, 2.0, 3.0, 2.0, 2.0, 2.0]  # seconds per turn: a, b, a, b, a, b
    stamps = iter(t for d in turns for t in (0.0, d))  # (start, end) of each turn
    monkeypatch.setattr(bench_engines.time, "perf_counter", lambda: next(stamps))
    calls = []
    steps = {("a", False): lambda: calls.append("a"), ("b", True): lambda: calls.append("b")}
    got = bench_engines.wall_rounds(steps, rounds=3, n=2)
    assert calls == ["a", "a", "b", "b"] * 3
    # a: 500, 1500, 1000 ms per step -> median 1000, spread (1500 - 500) / 1000; b: 1000 every round
    assert got == {("a", False): (1000.0, 1.0), ("b", True): (1000.0, 0.0)}


def test_the_engine_table_keeps_a_split_as_a_pair_row(monkeypatch, tmp_path):
    """--write-table: the forced-engine rows, and auto's row where auto split the training call
    as the pair's own row ("fa4+cudnn"); a pair row this run did not re-measure is kept, and
    engine_speed.split then prices the pair by it."""
    from benchmarks import bench_engines
    from fused_attn import engine_speed

    path = tmp_path / "sm90.csv"
    fam = "dense/causal/softcap/vanilla/gqa/d64"
    path.write_text("family,seq,engine,fwd_ms,fwd_bwd_ms,fwd_gpu_ms,fwd_bwd_gpu_ms\n"
                    f"{fam},2048,cudnn,0.3,0.9,0.3,0.8\n{fam},2048,fa4+cudnn,0.2,0.95,0.1,0.6\n"
                    "thd/none/none/vanilla/mha/d64,1931,fa4+cudnn,0.2,0.6,0.1,0.5\n")
    monkeypatch.setattr(engine_speed, "table_path", lambda arch: str(path))

    def row(impl, auto_engine, fwd, fwd_bwd, family=fam):
        return dict(impl=impl, family=family, seq=2048, auto_engine=auto_engine, fwd_wall_ms=fwd,
                    fwd_bwd_wall_ms=fwd_bwd, fwd_gpu_ms=fwd, fwd_bwd_gpu_ms=fwd_bwd)

    try:
        bench_engines.write_table([row("fused_attn cudnn", "fa4+cudnn", 0.32, 0.87),
                                   row("fused_attn fa4", "fa4+cudnn", 0.24, 1.15),
                                   row("fused_attn auto", "fa4+cudnn", 0.24, 0.79),
                                   row("sdpa cudnn", "fa4+cudnn", 0.3, 0.8)], "sm90")
        got = {(r["family"], r["engine"]): r["fwd_bwd_ms"] for r in csv.DictReader(open(path))}
        assert got == {(fam, "cudnn"): "0.8700", (fam, "fa4"): "1.1500", (fam, "fa4+cudnn"): "0.7900",
                       ("thd/none/none/vanilla/mha/d64", "fa4+cudnn"): "0.6"}
        bench_engines.write_table([row("fused_attn cudnn", "cudnn", 0.32, 0.87),
                                   row("fused_attn auto", "cudnn", 0.32, 0.87)], "sm90")
        got = {(r["family"], r["engine"]) for r in csv.DictReader(open(path))}
        assert (fam, "fa4+cudnn") in got and (fam, "fa4") not in got  # the pair row stays until re-measured
    finally:
        engine_speed.clear()
