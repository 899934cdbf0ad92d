"""Benchmarks of fused_attn against its peers: `python -m benchmarks [suite] [--quick] [--out DIR]`
from a source checkout (`python -m fused_attn bench ...` runs the same from one). Not part of the
installed package: the wheel ships `fused_attn` and `score_mods` only.

Suites: host (host overhead, build times), dense, mods (score_mods), varlen, models (training
Hugging Face models, needs transformers); `all` runs them in that order; `cpu` (not in `all`) compares
the CPU engines (fused_attn auto / torch SDPA / compiled flex / the reference, see bench/cpu.py) (host first, so its
first-build row is the process's first graph build). Every impl is
checked against a float64 reference before it is timed, within the project's bound
(`fused_attn.testing.bound_from`: 2 x the error of the naive bf16 torch computation + a floor);
a wrong result makes the exit status 1.
Results: a printed table per suite plus `<out>/<suite>_<gpu>.csv` and `.md` with the versions,
written when the suite finishes and again after the run's profiler passes, which come after every
suite's timings (torch's profiler leaves CUPTI attached: see `runner.SuiteResult`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import torch

from fused_attn.progress import progress
from .common import DEFAULT_OUT, environment, print_table, write_results
from .runner import SuiteResult

SUITES = ("host", "dense", "mods", "varlen", "models")

__all__ = ["main", "SUITES", "cpu_smoke"]


def _suite_runner(name: str) -> Callable[[bool, torch.device], SuiteResult]:
    if name == "host":
        from .host import run
    elif name == "dense":
        from .dense import run
    elif name == "mods":
        from .mods import run
    elif name == "models":
        from .models import run
    else:
        from .varlen import run
    return run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("suite", nargs="?", default="all", choices=SUITES + ("all", "cpu", "engines"),
                   help="cpu: the torch engine vs torch SDPA / compiled flex vs the reference on this CPU; "
                        "engines: fused_attn's engines (cuDNN, FA4) and the peers over problem families "
                        "(bench_engines.py)")
    p.add_argument("--write-table", action="store_true",
                   help="engines suite only: store the measured engine table backend='auto' chooses from "
                        "(fused_attn/speed/<arch>.csv)")
    p.add_argument("--quick", action="store_true", help="reduced grid (whole `all --quick` run: a few minutes)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--families", default=None,
                   help="models suite only: comma-separated model families (default: llama,gemma2,gpt_oss)")
    p.add_argument("--impls", default=None,
                   help="models suite only: comma-separated implementations (default: all that run here: "
                        "fused_attn, fused_attn_fa4, sdpa, flex_attention, eager, flash_attention_4)")
    p.add_argument("--only", default=None, help="cpu suite only: the configs whose label contains this text")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="without a CUDA GPU: run the harness at tiny shapes on CPU (reference backend)")
    return p


def _report(name: str, result: SuiteResult, env: Dict[str, str], out: str, show: bool = True) -> None:
    if show:
        print_table(name, result.rows, env)
    if result.rows:
        csv_path, md_path = write_results(name, result.rows, env, out, result.notes)
        if show:
            print(f"wrote {csv_path} and {md_path}")


def cpu_smoke(out: str) -> SuiteResult:
    """Tiny host, dense, score_mod, varlen and training-loop runs on CPU with the reference backend; writes smoke_cpu.csv/.md."""
    from . import dense, host, mods, varlen

    cpu = torch.device("cpu")
    result = SuiteResult(notes=["CPU smoke run of the harness (reference backend); timings are meaningless"])
    result.extend(dense.run_one(2, 64, 4, 4, 16, True, cpu, seed=0))
    result.extend(dense.run_one(1, 48, 4, 2, 16, False, cpu, seed=1))
    result.extend(mods.run(True, cpu, shape=(1, 2, 64, 16)))
    result.extend(varlen.run_varlen_config([17, 64, 5], 2, 16, False, cpu, True))
    result.extend(varlen.run_doc_packed(cpu, True, b=1, s=256, docs=3, h=2, d=16, causal=True))
    result.extend(varlen.run_training_loop(cpu, 3, n=2, max_len=40, h=2, d=16))
    result.extend(host.run(True, cpu))
    result.run_profiled()
    _report("smoke", result, environment(cpu), out)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark suites; returns the process exit status (1 if an impl was wrong or crashed)."""
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:
        args_list = args_list[1:]
    args = _parser().parse_args(args_list)
    families = None
    if args.families is not None:
        from .models import FAMILIES

        families = tuple(f.strip() for f in args.families.split(",") if f.strip())
        bad = [f for f in families if f not in FAMILIES]
        if bad or not families:
            print(f"--families: unknown model family {bad or args.families!r}; choose from {', '.join(FAMILIES)}")
            return 2
    impls = None
    if args.impls is not None:
        from .models import CUDNN_OURS, FA4_OURS, FA4_PEER, IMPLS

        known = IMPLS + (FA4_OURS, FA4_PEER, CUDNN_OURS)
        impls = tuple(i.strip() for i in args.impls.split(",") if i.strip())
        bad = [i for i in impls if i not in known]
        if bad or not impls:
            print(f"--impls: unknown implementation {bad or args.impls!r}; choose from {', '.join(known)}")
            return 2
    if args.suite == "engines":
        from .bench_engines import main as run_engines

        return run_engines(["--out", args.out] + (["--quick"] if args.quick else [])
                           + (["--write-table"] if args.write_table else []))
    if args.suite == "cpu":
        from .cpu import run as run_cpu

        rows = run_cpu(args.quick, args.out, only=args.only)
        wrong = [r for r in rows if not str(r.get("check", "")).startswith("ok")]
        for r in wrong:
            print("FAILED:", r["config"], r["impl"], r["check"])
        return 1 if wrong else 0
    if not torch.cuda.is_available():
        if not args.cpu_smoke:
            print("fused_attn benchmarks need a CUDA GPU, and torch sees none. To exercise the harness on CPU at "
                  "tiny shapes (timings meaningless): python -m benchmarks --cpu-smoke", file=sys.stderr)
            return 2
        print("fused_attn benchmarks need a CUDA GPU; none is available: running --cpu-smoke.")
        result = cpu_smoke(args.out)
        for f in result.failures:
            print("FAILED:", f)
        return 1 if result.failures else 0
    device = torch.device("cuda")
    env = environment(device)
    print("fused_attn benchmarks: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    failures: List[str] = []
    results: Dict[str, SuiteResult] = {}
    for name in progress(SUITES if args.suite == "all" else (args.suite,), desc="bench suites"):
        try:
            if name == "models":
                from .models import run as run_models

                results[name] = run_models(
                    args.quick, device, families=families, impls=impls,
                    after_family=lambda so_far: _report("models", so_far, env, args.out, show=False))
            else:
                results[name] = _suite_runner(name)(args.quick, device)
        except Exception as exc:  # a whole suite could not run: report, keep going, fail at the end
            traceback.print_exc()
            failures.append(f"{name}: suite crashed: {type(exc).__name__}: {exc}")
        else:  # on disk now (profiled columns still empty), should a later suite take the process down
            _report(name, results[name], env, args.out, show=False)
        torch.cuda.empty_cache()
    # every timing of the process is taken: now the profiler passes (see SuiteResult.profiled)
    for name, result in results.items():
        if result.profiled:
            print(f"{name}: {len(result.profiled)} profiler pass(es) ...", flush=True)
        result.run_profiled()
        _report(name, result, env, args.out)
        failures += result.failures
    if failures:
        print(f"\n{len(failures)} FAILURE(S):")
        for f in failures:
            print("  " + f)
        return 1
    print("\nall implementations matched the float64 reference within their bounds")
    return 0
