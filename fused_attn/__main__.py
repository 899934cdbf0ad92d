"""`python -m fused_attn` (console script `fused-attn`): the command line.

    fused-attn [check]        self-check table on the present device (the default command)
    fused-attn bench ...      the benchmark suites, from a source checkout (needs a CUDA GPU; --cpu-smoke runs
                              the harness on CPU)
    fused-attn cache --dir D  the persistent graph cache directory: entries, sizes, versions
    fused-attn explain ...    which backend a problem would run on, and why (computes nothing)
    fused-attn help [CMD]     this help, or one command's

Imports stay lazy: `--help`, `--version` and `cache` never import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from typing import List, Optional, Sequence

from ._version import __version__

PROG = "fused-attn"
COMMANDS = ("check", "bench", "cache", "explain", "help")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="fused_attn: attention on cuDNN SDPA graphs, with score_mods.",
                                epilog="With no command, runs `check`. `python -m fused_attn` is the same command.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{check,bench,cache,explain,help}")
    sub.add_parser("check", help="self-check: each configuration against a float64 reference, and the cuDNN in use",
                   description="Run a table of configurations on the present device (backend used, max error vs a "
                               "float64 naive reference, time per call) and print the cuDNN library loaded, or why "
                               "none. Exit status 1 if any check fails.")
    sub.add_parser("bench", add_help=False, help="benchmark suites (`bench --help` lists the options; needs a GPU, "
                                                 "or --cpu-smoke)")
    c = sub.add_parser("cache", help="list a persistent graph cache directory",
                       description="List the graphs stored in a persistent cache directory (the one given to "
                                   "fused_attn.graph_cache.set_persistent_dir): entries, sizes and the versions "
                                   "each was built with. A fresh process has no in-memory graphs to show.")
    c.add_argument("--dir", dest="directory", help="the persistent cache directory to list")
    e = sub.add_parser("explain", help="which backend a problem runs on, and why",
                       description="Build empty tensors of the given problem and print fused_attn.explain(...): the "
                                   "backend a call would use and the reason. Nothing is computed.")
    e.add_argument("--format", default="bshd", choices=("bshd", "sbhd", "bhsd"), help="qkv_format (default bshd)")
    e.add_argument("--batch", type=int, default=2)
    e.add_argument("--seqlen", type=int, default=1024, help="query length (and key length unless --seqlen-kv)")
    e.add_argument("--seqlen-kv", type=int, default=None)
    e.add_argument("--heads", type=int, default=16)
    e.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default --heads)")
    e.add_argument("--head-dim", type=int, default=128)
    e.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32", "float64"))
    e.add_argument("--mask", default="no_mask", help="attn_mask_type (no_mask, causal, causal_bottom_right)")
    e.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"), help="window_size")
    e.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    e.add_argument("--backend", default="auto", choices=("auto", "cudnn", "torch", "reference"))
    h = sub.add_parser("help", help="show this help, or a command's")
    h.add_argument("topic", nargs="?", choices=COMMANDS)
    return p


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


BENCH_MISSING = ("the benchmark suites are not part of the installed package: they live in the `benchmarks` "
                 "folder of a source checkout. Run them there: git clone the repository, `pip install -e .` in it, "
                 "then `python -m fused_attn bench ...` (or `python -m benchmarks ...`) from the checkout")


def _benchmarks(root: Optional[str] = None):
    """The `benchmarks` package of the checkout `root` (default: the one this fused_attn runs from),
    or None where there is none (an installed wheel)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "benchmarks", "__init__.py")):
        return None
    if root not in (os.path.abspath(p or os.curdir) for p in sys.path):
        sys.path.insert(0, root)
    import importlib

    module = importlib.import_module("benchmarks")
    if os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))) != root:
        raise ImportError(f"`import benchmarks` found {module.__file__}, not the checkout's {root}/benchmarks")
    return module


def _bench(argv: List[str]) -> int:
    bench = _benchmarks()
    if bench is None:
        print(f"{PROG} bench: {BENCH_MISSING}", file=sys.stderr)
        return 2
    try:
        return int(bench.main(argv) or 0)
    except SystemExit as exc:  # the runner's argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 1


def _read_entry(path: str) -> dict:
    """The header of one stored graph file (format in fused_attn.graph_store), without importing torch."""
    with open(path, "rb") as f:
        prefix = f.read(16)
        if len(prefix) != 16:
            raise ValueError("truncated header")
        magic, fmt, hlen = struct.unpack("<8sII", prefix)
        if magic != b"FAGRAPH\0":
            raise ValueError("not a stored graph (bad magic)")
        header = json.loads(f.read(hlen).decode("utf-8"))
    header["format"] = fmt
    return header


def _cache(directory: Optional[str]) -> int:
    if directory is None:
        print("No persistent directory given. A graph cache lives in the process that builds graphs "
              "(fused_attn.graph_cache.cache_info() there); graphs outlive it only in a directory set with "
              "graph_cache.set_persistent_dir(path). List one with: fused-attn cache --dir PATH")
        return 0
    if not os.path.isdir(directory):
        print(f"cache --dir: {directory!r} is not a directory", file=sys.stderr)
        return 1
    names = sorted(n for n in os.listdir(directory) if n.endswith(".graph") and not n.startswith("."))
    total = 0
    print(f"persistent graph cache {os.path.abspath(directory)}: {len(names)} entries")
    for name in names:
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        total += size
        try:
            header = _read_entry(path)
        except (OSError, ValueError) as exc:
            print(f"  {name[:12]}  {size:>10,} B  unreadable: {exc}")
            continue
        env = header.get("env", {})
        versions = ", ".join(f"{k} {env[k]}" for k in ("cudnn", "cudnn_frontend", "torch", "arch") if k in env)
        key = str(header.get("key", ""))
        print(f"  {name[:12]}  {size:>10,} B  [{versions}]  {key[:90]}{'...' if len(key) > 90 else ''}")
    print(f"total {total:,} bytes")
    return 0


def _explain(args: argparse.Namespace) -> int:
    import torch

    import fused_attn

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    skv = args.seqlen_kv or args.seqlen
    hkv = args.kv_heads or args.heads
    order = {"bshd": lambda b, s, h, d: (b, s, h, d), "sbhd": lambda b, s, h, d: (s, b, h, d),
             "bhsd": lambda b, s, h, d: (b, h, s, d)}[args.format]
    dtype = getattr(torch, args.dtype)
    try:
        q = torch.empty(order(args.batch, args.seqlen, args.heads, args.head_dim), dtype=dtype, device=device)
        k = torch.empty(order(args.batch, skv, hkv, args.head_dim), dtype=dtype, device=device)
        ex = fused_attn.explain(q, k, k, qkv_format=args.format, attn_mask_type=args.mask,
                                window_size=tuple(args.window) if args.window else None, backend=args.backend)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        print(f"explain: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"backend: {ex.backend}\nreason:  {ex.reason}\nproblem: {ex.problem}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `python -m fused_attn` / `fused-attn`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the benchmark runner owns its options (and its --help)
        return _bench(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors: argparse's status (0 or 2)
        return int(exc.code or 0)
    if args.command in (None, "check"):
        from .selfcheck import self_check

        return self_check()
    if args.command == "cache":
        return _cache(args.directory)
    if args.command == "explain":
        return _explain(args)
    if args.command == "help":
        if args.topic == "bench":
            return _bench(["--help"])
        (_subparser(parser, args.topic) if args.topic else parser).print_help()
        return 0
    parser.print_help()  # pragma: no cover - every command is handled above
    return 2


if __name__ == "__main__":
    sys.exit(main())
