"""The command line: `python -m fused_attn` self-check, `check`, `cache`, `explain`, `bench` dispatch, help."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from fused_attn import __main__ as main_mod
from fused_attn import selfcheck

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_self_check_passes(capsys):
    assert main_mod.main([]) == 0
    text = capsys.readouterr().out
    assert "checks passed" in text and "FAIL" not in text
    assert "thd varlen causal" in text and "reference" in text
    assert "cuDNN: " in text  # the library loaded, or why none


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only status line")
def test_cudnn_status_on_cpu_names_the_engines_that_run():
    line = selfcheck.cudnn_status()
    assert "none loaded" in line and "torch engine" in line and "reference backend" in line


def test_engines_status_names_each_engine_and_why_it_cannot_run(monkeypatch):
    from fused_attn import engine_table, engines

    class Unready:  # the Engine attributes the status line reads
        name = "unready"

        def unavailable(self):
            return "needs a widget; pip install widget"

    monkeypatch.setattr(engine_table, "engine_names", lambda: ("unready", "reference"))
    real_get = engines.get
    monkeypatch.setattr(engines, "get", lambda n: Unready() if n == "unready" else real_get(n))
    line = selfcheck.engines_status()
    assert line == "engines: unready: not available (needs a widget; pip install widget); reference: ready"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only status line")
def test_engines_status_on_cpu_lists_the_registered_engines():
    line = selfcheck.engines_status()
    assert "torch: ready" in line and "reference: ready" in line
    assert "fa4: not available (the FA4 engine needs a CUDA GPU" in line and "auto" not in line


def test_check_command_and_failure(monkeypatch, capsys):
    def broken(case, *args):
        raise RuntimeError("boom")

    monkeypatch.setattr(selfcheck, "_run_case", broken)
    assert main_mod.main(["check"]) == 1
    assert "RuntimeError: boom" in capsys.readouterr().out


def test_cache_without_a_directory_says_how(capsys):
    assert main_mod.main(["cache"]) == 0
    assert "--dir" in capsys.readouterr().out


def test_cache_lists_a_persistent_directory(tmp_path, capsys):
    from fused_attn.graph_store import GraphStore

    GraphStore(tmp_path).save(("fwd", 1, 2), {"cudnn": "91900", "torch": "2.13"}, b"x" * 1000)
    (tmp_path / ("0" * 64 + ".graph")).write_bytes(b"junk")
    assert main_mod.main(["cache", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 entries" in out and "cudnn 91900" in out and "unreadable" in out and "fwd" in out
    assert main_mod.main(["cache", "--dir", str(tmp_path / "missing")]) == 1


def test_explain_command(capsys):
    assert main_mod.main(["explain", "--device", "cpu", "--dtype", "float32", "--seqlen", "64", "--heads", "2",
                          "--head-dim", "16", "--mask", "causal"]) == 0
    assert "backend: torch" in capsys.readouterr().out  # torch's CPU kernel serves a plain causal call
    assert main_mod.main(["explain", "--device", "cpu", "--heads", "3", "--kv-heads", "2"]) == 1
    assert "multiple of" in capsys.readouterr().err
    for backend in ("torch", "reference"):  # every backend can be named
        assert main_mod.main(["explain", "--device", "cpu", "--dtype", "float32", "--heads", "2", "--head-dim", "16",
                              "--seqlen", "8", "--backend", backend]) == 0
        assert f"backend: {backend}" in capsys.readouterr().out


def test_bench_dispatch(monkeypatch):
    """From a checkout, `bench` runs the checkout's benchmarks package with the remaining arguments."""
    seen = []
    fake = types.ModuleType("benchmarks")
    fake.__file__ = os.path.join(ROOT, "benchmarks", "__init__.py")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "benchmarks", fake)
    assert main_mod.main(["bench", "--suite", "dense"]) == 0
    assert seen == [["--suite", "dense"]]


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(monkeypatch, tmp_path, capsys):
    """An installed wheel has no benchmarks: the command says how to get them, exit status 2."""
    assert main_mod._benchmarks(str(tmp_path)) is None
    monkeypatch.setattr(main_mod, "_benchmarks", lambda: None)
    assert main_mod.main(["bench", "dense"]) == 2
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "source checkout" in err


def test_help_version_and_unknown(capsys):
    assert main_mod.main(["--help"]) == 0
    assert "cache" in capsys.readouterr().out
    assert main_mod.main(["help", "cache"]) == 0
    assert "--dir" in capsys.readouterr().out
    assert main_mod.main(["cache", "--help"]) == 0
    assert main_mod.main(["--version"]) == 0
    import fused_attn

    assert fused_attn.__version__ in capsys.readouterr().out
    assert main_mod.main(["frobnicate"]) == 2
    assert "usage" in capsys.readouterr().err


def test_help_imports_no_torch():
    code = ("import sys; from fused_attn.__main__ import main; main(['--help']); main(['cache']); "
            "print('TORCH', 'torch' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert "TORCH False" in out
