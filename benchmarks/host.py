"""Host overhead and graph build times of fused_attn at a tiny shape (B=1, H=1, S=128, D=64).

Per-call host microseconds on a cache hit (time.perf_counter over many calls, one synchronize
after the loop; best of 5 rounds that interleave the rows, so a slow spell of the host does not
land on one row) for the fused_attn functional and module forward, a raw cuDNN graph execute and
torch SDPA (cuDNN backend); the replay cost of a CUDA-graph-captured fused_attn forward; and the
time of a first call on new shapes (graph builds), first in the process and later.
"""

from __future__ import annotations

import math
import time
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .common import (ImplWrongError, check_tensor, host_us_per_call, host_us_rounds, naive_attention,
                     reference_and_bounds, synchronize)
from .host_floors import BareCudnnFunction, EmptyAutogradFunction
from .runner import SuiteResult

SHAPE = (1, 128, 1, 64)  # B, S, H, D (BSHD)


def _rand(shape, device, gen):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen)


def _expected(q, k, v, name: str = "") -> Tuple[torch.Tensor, float]:
    """(float64 output, bound) of a row's forward: plain, or with the row's softcap(30) / causal mask."""
    t = [x.detach().transpose(1, 2) for x in (q, k, v)]
    score_fn = (lambda s, *_: 30.0 * torch.tanh(s / 30.0)) if "softcap" in name else None
    mask = None
    if "causal" in name:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
    expected, bounds = reference_and_bounds(
        lambda dt: {"out": naive_attention(*t, scale=1 / math.sqrt(q.shape[-1]), dtype=dt, score_fn=score_fn,
                                           mask=mask)["out"].transpose(1, 2)}, q.dtype)
    return expected["out"], bounds["out"]


def _forwards(q, k, v, device) -> Dict[str, Callable[[], torch.Tensor]]:
    import fused_attn
    import score_mods

    backend = "cudnn" if device.type == "cuda" else "reference"
    module = fused_attn.DotProductAttention(q.shape[2], q.shape[3], qkv_format="bshd", backend=backend)
    cap = score_mods.softcap(30.0)
    fns = {
        "fused_attn functional": lambda: fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend=backend),
        "fused_attn module": lambda: module(q, k, v),
        "fused_attn functional softcap": lambda: fused_attn.dot_product_attention(
            q, k, v, qkv_format="bshd", score_mod=cap, backend=backend),
        "fused_attn functional softcap + causal": lambda: fused_attn.dot_product_attention(
            q, k, v, qkv_format="bshd", score_mod=cap, attn_mask_type="causal", backend=backend),
    }
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from .raw_cudnn import RawSdpa

        raw = RawSdpa(q, k, v, causal=False, backward=False)
        fns["raw_cudnn execute (tensor_uids)"] = raw.fwd_ordered
        fns["raw_cudnn execute (dict)"] = raw.fwd

        def torch_cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2)).transpose(1, 2)

        fns["torch_sdpa_cudnn"] = torch_cudnn
    return fns


BARE = "autograd.Function over the bare cuDNN graphs (no library code)"


def _fwd_bwds(device, gen) -> Tuple[Dict[str, Callable[[], object]], Tuple[torch.Tensor, ...]]:
    """fwd + backward of one call (grads accumulate into .grad, as in training); also returns
    (q, k, v, dO) for the gradient check."""
    import fused_attn

    backend = "cudnn" if device.type == "cuda" else "reference"
    q, k, v = [_rand(SHAPE, device, gen).requires_grad_() for _ in range(3)]
    do = _rand(SHAPE, device, gen)
    module = fused_attn.DotProductAttention(q.shape[2], q.shape[3], qkv_format="bshd", backend=backend)
    fns = {
        "fused_attn functional": lambda: fused_attn.dot_product_attention(
            q, k, v, qkv_format="bshd", backend=backend).backward(do),
        "fused_attn module": lambda: module(q, k, v).backward(do),
    }
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def torch_cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2)).transpose(1, 2).backward(do)

        fns["torch_sdpa_cudnn"] = torch_cudnn
        from .raw_cudnn import RawSdpa

        raw = RawSdpa(q.detach(), k.detach(), v.detach(), causal=False)
        fns[BARE] = lambda: BareCudnnFunction.apply(raw, q, k, v).backward(do)
    fns.update(_transformers_fns(q, k, v, do, backend))
    fns[FLOOR] = lambda: EmptyAutogradFunction.apply(q, k, v).backward(do)
    return fns, (q, k, v, do)


def _transformers_fns(q, k, v, do, backend: str) -> Dict[str, Callable[[], object]]:
    """fwd + backward through transformers' attention functions as a model's layer calls them
    (query / key / value (B, H, S, D) views, out (B, S, H, D)): fused_attn's and, on CUDA, sdpa's.
    Empty without transformers."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from fused_attn.integrations.transformers import make_attention_forward
    except ImportError:
        return {}
    layer = types.SimpleNamespace(is_causal=False, training=True)  # what the functions read of a layer
    heads_first = [x.transpose(1, 2) for x in (q, k, v)]
    ours = make_attention_forward(backend)
    fns = {"transformers fn: fused_attn": lambda: ours(layer, *heads_first, None)[0].backward(do)}
    if q.device.type == "cuda":
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        fns["transformers fn: sdpa"] = lambda: sdpa(layer, *heads_first, None)[0].backward(do)
    return fns


FLOOR = "floor: empty Python autograd.Function (no attention)"


def _check_grads(name: str, fn: Callable[[], object], q, k, v, do) -> float:
    """One fwd+bwd from zero grads against the float64 reference; the worst error/bound ratio."""
    t = [x.detach().transpose(1, 2) for x in (q, k, v)]
    expected, bounds = reference_and_bounds(
        lambda dt: naive_attention(*t, scale=1 / math.sqrt(q.shape[-1]), dtype=dt,
                                   grad_out=do.transpose(1, 2)), q.dtype)
    for x in (q, k, v):
        x.grad = None
    fn()
    worst = 0.0
    for key, x in (("dq", q), ("dk", k), ("dv", v)):
        err = check_tensor(name, key, x.grad.transpose(1, 2), expected[key], bounds[key])
        worst = max(worst, err / bounds[key])
    return worst


def _ratio_notes(rows: List[Dict[str, object]], rounds: Optional[Dict[tuple, List[float]]] = None) -> List[str]:
    """The summary ratios of the best times; with `rounds` ((mode, impl) -> us per round), each
    also gets the range of the ratio taken round by round (the interleaved rounds pair calls
    timed close together: the run's own noise, to judge a change against)."""
    us = {(r.get("mode"), r.get("impl")): r.get("us_per_call") for r in rows if r.get("us_per_call")}
    rounds = rounds or {}
    notes = []

    def ratio(label, a, b):
        if us.get(a) and us.get(b):
            text = f"{label}: {us[a] / us[b]:.2f}x ({us[a]:.1f} / {us[b]:.1f} us)"
            if rounds.get(a) and rounds.get(b):
                each = [x / y for x, y in zip(rounds[a], rounds[b])]
                text += f"; round by round {min(each):.2f}x-{max(each):.2f}x"
            notes.append(text)

    ratio("fwd host, functional vs the frontend's bare ordered execute", ("fwd", "fused_attn functional"),
          ("fwd", "raw_cudnn execute (tensor_uids)"))
    ratio("fwd+bwd host through transformers' attention function, fused_attn vs sdpa",
          ("fwd+bwd", "transformers fn: fused_attn"), ("fwd+bwd", "transformers fn: sdpa"))
    ratio("fwd host, softcap + causal vs softcap alone", ("fwd", "fused_attn functional softcap + causal"),
          ("fwd", "fused_attn functional softcap"))
    ratio("fwd+bwd host, functional vs torch SDPA (cuDNN)", ("fwd+bwd", "fused_attn functional"),
          ("fwd+bwd", "torch_sdpa_cudnn"))
    ratio("fwd+bwd host, module vs torch SDPA (cuDNN)", ("fwd+bwd", "fused_attn module"),
          ("fwd+bwd", "torch_sdpa_cudnn"))
    ratio("fwd+bwd host, empty Python autograd.Function vs torch SDPA (cuDNN)", ("fwd+bwd", FLOOR),
          ("fwd+bwd", "torch_sdpa_cudnn"))
    ratio("fwd+bwd host, autograd.Function over the bare cuDNN graphs vs torch SDPA (cuDNN)", ("fwd+bwd", BARE),
          ("fwd+bwd", "torch_sdpa_cudnn"))
    ratio("fwd+bwd host, functional vs the autograd.Function over the bare cuDNN graphs",
          ("fwd+bwd", "fused_attn functional"), ("fwd+bwd", BARE))
    if us.get(("fwd", "fused_attn module")) and us.get(("fwd", "fused_attn functional")):
        notes.append(f"fwd host, module minus functional: "
                     f"{us[('fwd', 'fused_attn module')] - us[('fwd', 'fused_attn functional')]:+.1f} us")
    return notes


def _cuda_graph_row(q, k, v, fn: Callable[[], torch.Tensor], calls: int) -> Dict[str, object]:
    """Capture `fn` once, change the inputs in place, replay: check (ImplWrongError when wrong), then
    time replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    gen = torch.Generator(device=q.device).manual_seed(99)
    for t in (q, k, v):
        t.copy_(_rand(t.shape, q.device, gen))
    graph.replay()
    torch.cuda.synchronize()
    expected, bound = _expected(q, k, v)
    err = check_tensor("fused_attn CUDA graph replay (inputs changed in place)", "out", out, expected, bound)
    del expected
    us = host_us_per_call(graph.replay, q.device, calls)
    return {"impl": "fused_attn functional, CUDA graph replay", "us_per_call": us, "max_err": err, "bound": bound}


def _time_first_call(fn: Callable[[], object], device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _build_rows(device) -> List[Dict[str, object]]:
    """Clear the cache, then time first calls on new shapes: forward, another forward, fwd+bwd."""
    import fused_attn

    backend = "cudnn" if device.type == "cuda" else "reference"
    gen = torch.Generator(device=device).manual_seed(3)
    rows = []
    fused_attn.graph_cache.clear()
    steps = [("first fwd call, new shape (first build after clear)", (1, 256, 2, 64), False),
             ("first fwd call, second new shape", (1, 384, 2, 64), False),
             ("first fwd+bwd call, third new shape", (1, 512, 2, 64), True)]
    for label, shape, backward in steps:
        q, k, v = [_rand(shape, device, gen).requires_grad_(backward) for _ in range(3)]

        def call():
            out = fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend=backend)
            if backward:
                torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

        before = fused_attn.graph_cache.cache_info()
        ms = _time_first_call(call, device)
        after = fused_attn.graph_cache.cache_info()
        hit_ms = _time_first_call(call, device)
        rows.append({"impl": "fused_attn " + label, "config": "x".join(map(str, shape)) + " (BSHD)",
                     "first_call_ms": ms, "cached_call_ms": hit_ms, "builds": after.builds - before.builds,
                     "build_seconds": after.build_seconds - before.build_seconds})
    if device.type == "cuda":
        rows.extend(_persistent_rows(device, gen))
    return rows


def _persistent_rows(device, gen) -> List[Dict[str, object]]:
    """First fwd+bwd call of a new shape with a persistent directory: built and stored, then
    loaded after graph_cache.clear() (what a restarted process finds; a new process also pays
    its own handle creation, see tests/backends/cudnn/test_plan_gpu.py::test_persistent_cache_*)."""
    import tempfile

    import fused_attn

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        fused_attn.graph_cache.set_persistent_dir(directory)
        try:
            for label in ("built and stored", "loaded from the directory"):
                fused_attn.graph_cache.clear()
                shape = (1, 640, 2, 64)
                q, k, v = [_rand(shape, device, gen).requires_grad_(True) for _ in range(3)]

                def call():
                    out = fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend="cudnn")
                    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

                ms = _time_first_call(call, device)
                info = fused_attn.graph_cache.cache_info()
                rows.append({"impl": f"fused_attn first fwd+bwd call, persistent dir: {label}",
                             "config": "x".join(map(str, shape)) + " (BSHD)", "first_call_ms": ms,
                             "builds": info.builds, "loads": info.loads, "build_seconds": info.build_seconds})
        finally:
            fused_attn.graph_cache.set_persistent_dir(None)
            fused_attn.graph_cache.clear()
    return rows


def _time_rows(timed: Dict[str, Callable[[], object]], rows: Dict[str, Dict[str, object]], mode: str,
               device: torch.device, calls: int, rounds: Dict[tuple, List[float]]) -> None:
    """Time `timed` in interleaved rounds: each row gets its best (us_per_call) and every round
    (us_rounds); `rounds[(mode, name)]` keeps the numbers for the ratio notes."""
    for name, times in host_us_rounds(timed, device, calls).items():
        rows[name].update(us_per_call=min(times), us_rounds=" ".join(f"{t:.1f}" for t in times))
        rounds[(mode, name)] = times


def run(quick: bool, device: torch.device) -> SuiteResult:
    """Host overhead rows and build-time rows (order matters: run this suite first in a process)."""
    result = SuiteResult(notes=["us_per_call: host time, perf_counter over N back-to-back calls, one sync after; "
                                "best of 5 rounds that interleave the rows (us_rounds: each round's)",
                                "build rows: first call on a new shape after graph_cache.clear(); "
                                "'first' is the first build of the process only when this suite runs first"])
    calls = 500 if quick else 2000
    build_rows = _build_rows(device)  # first: measures the process's first graph build
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = [_rand(SHAPE, device, gen) for _ in range(3)]
    config = "x".join(map(str, SHAPE)) + " (BSHD) bf16"
    timed: Dict[str, Callable[[], object]] = {}
    fwd_rows: Dict[str, Dict[str, object]] = {}
    for name, fn in _forwards(q, k, v, device).items():
        expected, bound = _expected(q, k, v, name)
        row = {"suite": "host", "config": config, "mode": "fwd", "impl": name, "us_per_call": None, "max_err": None,
               "bound": bound, "note": ""}
        result.rows.append(row)
        try:
            row["max_err"] = check_tensor(name, "out", fn(), expected, bound)
        except ImplWrongError as exc:  # not timed
            result.failures.append(f"host / {exc}")
            row.update(max_err=exc.err, note="WRONG: " + str(exc))
            continue
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            if name.startswith("fused_attn") or name.startswith("raw"):
                result.failures.append(f"host / {name}: {msg}")
            row["note"] = "FAILED: " + msg
            continue
        del expected
        timed[name], fwd_rows[name] = fn, row
    rounds: Dict[tuple, List[float]] = {}
    _time_rows(timed, fwd_rows, "fwd", device, calls, rounds)
    fwd_bwds, (qg, kg, vg, do) = _fwd_bwds(device, gen)
    timed, bwd_rows = {}, {}
    for name, fn in fwd_bwds.items():
        row = {"suite": "host", "config": config, "mode": "fwd+bwd", "impl": name,
               "note": "no attention: autograd's own cost" if name == FLOOR else "grads checked"}
        result.rows.append(row)
        try:
            if name != FLOOR:
                row["worst_err_over_bound"] = _check_grads(name, fn, qg, kg, vg, do)
        except ImplWrongError as exc:  # not timed
            result.failures.append(f"host / fwd+bwd {exc}")
            row["note"] = "WRONG: " + str(exc)
            continue
        except Exception as exc:
            if "fused_attn" in name:
                result.failures.append(f"host / fwd+bwd {name}: {type(exc).__name__}: {exc}")
            row["note"] = f"FAILED: {type(exc).__name__}: {exc}"
            continue
        timed[name], bwd_rows[name] = fn, row
    _time_rows(timed, bwd_rows, "fwd+bwd", device, calls // 2, rounds)
    result.notes.extend(_ratio_notes(result.rows, rounds))
    if device.type == "cuda":
        import fused_attn

        fn = lambda: fused_attn.dot_product_attention(q, k, v, qkv_format="bshd", backend="cudnn")
        row = {"suite": "host", "config": config, "mode": "fwd"}
        try:
            row.update(_cuda_graph_row(q, k, v, fn, calls))
        except ImplWrongError as exc:  # not timed
            result.failures.append(f"host / {exc}")
            row.update({"impl": "fused_attn functional, CUDA graph replay", "max_err": exc.err, "bound": exc.bound,
                        "note": "WRONG: " + str(exc)})
        except Exception as exc:
            result.failures.append(f"host / CUDA graph capture of fused_attn: {type(exc).__name__}: {exc}")
            row.update({"impl": "fused_attn functional, CUDA graph replay", "note": f"FAILED: {exc}"})
        result.rows.append(row)
    for r in build_rows:
        result.rows.append({"suite": "host", "mode": "build", **r})
    return result
