"""The main job: `python -m fused_attn` self-check, `cache`, `bench` dispatch."""

from __future__ import annotations

import sys
import types

from fused_attn import __main__ as main_mod


def test_self_check_passes(capsys):
    assert main_mod.main([]) == 0
    text = capsys.readouterr().out
    assert "checks passed" in text and "FAIL" not in text
    assert "thd varlen causal" in text and "reference" in text


def test_self_check_reports_failure(monkeypatch, capsys):
    def broken(case, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(main_mod, "_run_case", broken)
    assert main_mod.main([]) == 1
    assert "RuntimeError: boom" in capsys.readouterr().out


def test_cache_command(capsys):
    assert main_mod.main(["cache"]) == 0
    assert "hits" in capsys.readouterr().out


def test_bench_dispatch(monkeypatch):
    seen = []
    fake = types.ModuleType("fused_attn.bench")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "fused_attn.bench", fake)
    import fused_attn

    monkeypatch.setattr(fused_attn, "bench", fake, raising=False)
    assert main_mod.main(["bench", "--suite", "dense"]) == 0
    assert seen == [["--suite", "dense"]]


def test_unknown_command(capsys):
    assert main_mod.main(["frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err
