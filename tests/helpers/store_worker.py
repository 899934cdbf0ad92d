"""Helpers for tests/core/test_graph_store.py that run in child processes (spawned workers, `python -c`).

`light_import()` imports `fused_attn.graph_store` and `fused_attn.cache` without running
`fused_attn/__init__.py` (which imports torch, ~2 s per process): neither module needs torch, and
spawned workers stay fast. In a process that already imported the package it changes nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import types
import warnings
from http import HTTPStatus
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def light_import():
    if "fused_attn" not in sys.modules:
        pkg = types.ModuleType("fused_attn")
        pkg.__path__ = [str(ROOT / "fused_attn")]
        sys.modules["fused_attn"] = pkg
    return importlib.import_module("fused_attn.graph_store"), importlib.import_module("fused_attn.cache")


def sample_key():
    """A GraphKey with nested tuples, a score_mod key with floats (-0.0, nan) and an enum."""
    _, cache = light_import()
    return cache.GraphKey(
        direction="bwd", dtype="bfloat16", q_dims=(2, 4, 128, 64), k_dims=(2, 2, 128, 64),
        v_dims=(2, 2, 128, 64), q_strides=(32768, 64, 256, 1), k_strides=(16384, 64, 128, 1),
        v_strides=(16384, 64, 128, 1), o_strides=(32768, 64, 256, 1), scale=0.125, band=(None, 0, True),
        score_mod=("traced", (("const", -0.0, "f32", ()), ("const", float("nan"), None, (0,))), HTTPStatus.OK),
        backend_version=91900,
    )


def print_sample_digest() -> None:
    """For `python -c`: print the sample key's text and digest."""
    store, _ = light_import()
    key = sample_key()
    print(store.stable_repr(key))
    print(store.key_digest(key))


ENV = {"cudnn_backend": "91900", "cudnn_frontend": "1.32.0", "torch": "2.11.0", "arch": "sm90", "format": "1"}


def make_payload(key_name: str, writer: str) -> bytes:
    """A self-describing payload of 1 to 300 KB: `check_payload` can tell it is intact."""
    head = f"{key_name}|{writer}|".encode()
    seed = hashlib.sha256(head).digest()
    size = 1000 + int.from_bytes(seed[:4], "little") % 300_000
    return head + (seed * (size // 32 + 1))[:size]


def check_payload(key_name: str, payload: bytes) -> bool:
    try:
        name, writer, _ = payload.split(b"|", 2)
    except ValueError:
        return False
    return name.decode() == key_name and payload == make_payload(key_name, writer.decode())


def worker(directory: str, wid: int, rounds: int, start, results) -> None:
    """After `start` (a Barrier) opens: save and load shared and private keys in a loop; put
    (wid, pid, [problems found]) on the `results` queue."""
    store_mod, _ = light_import()
    store = store_mod.GraphStore(directory)
    problems = []
    start.wait(60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r in range(rounds):
            for name in (f"shared{r % 4}", f"private{wid}_{r % 3}"):
                key = ("worker-test", name)
                got = store.load(key, ENV)
                if got is not None and not check_payload(name, got):
                    problems.append(f"worker {wid}: wrong payload for {name}")
                store.save(key, ENV, make_payload(name, f"w{wid}r{r}"))
    problems += [f"worker {wid}: warning {w.message}" for w in caught]
    leftovers = [n for n in os.listdir(directory) if n.endswith(".tmp") and f".{os.getpid()}." in n]
    problems += [f"worker {wid}: temp file left {n}" for n in leftovers]
    results.put((wid, os.getpid(), problems))
