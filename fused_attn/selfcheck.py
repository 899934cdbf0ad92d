"""The self-check behind `python -m fused_attn` / `fused-attn check`: a table of configurations on the
present device (backend used, max error vs a float64 naive reference, time per forward call) and
the cuDNN library it loaded, or why none.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .progress import progress


@dataclass
class Case:
    """One self-check configuration; tensors are logical (B, H, S, D) before formatting."""

    name: str
    fmt: str = "bshd"
    mask: str = "no_mask"
    window: Optional[tuple] = None
    sq: Optional[int] = None  # defaults to the run's S
    hkv_div: int = 1
    dv: Optional[int] = None
    lengths: Optional[List[int]] = None  # thd or dense padding lengths
    softcap: Optional[float] = None
    extra: Dict[str, Any] = field(default_factory=dict)


def _cases(s: int) -> List[Case]:
    return [
        Case("bshd no_mask"),
        Case("sbhd causal", fmt="sbhd", mask="causal"),
        Case("bhsd causal_bottom_right Sq<Skv", fmt="bhsd", mask="causal_bottom_right", sq=s // 2),
        Case("bshd sliding window (64, 0)", window=(64, 0)),
        Case("bshd GQA 2:1 causal", mask="causal", hkv_div=2),
        Case("bshd Dv = D/2", dv=-1),
        Case("bshd padding_causal", mask="padding_causal", lengths=[s, s // 3]),
        Case("thd varlen causal", fmt="thd", mask="causal", lengths=[s // 2, 0, 1, s // 4 + 3]),
        Case("bshd softcap(20) + causal", mask="causal", softcap=20.0),
    ]


def _naive(q, k, v, scale: float, allowed, score_fn=None):
    """float64 softmax(score_fn(scale q k^T) masked) v on (B, H, S, D); masked rows -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = scale * q @ k.transpose(-1, -2)
    if score_fn is not None:
        s = score_fn(s)
    s = s.masked_fill(~allowed, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def _allowed(sq: int, skv: int, lq: int, lkv: int, mask: str, window, device) -> torch.Tensor:
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(skv, device=device)[None, :]
    ok = (i < lq) & (j < lkv)
    shift = lkv - lq if mask == "causal_bottom_right" else 0
    left, right = window if window is not None else (-1, -1)
    if mask in ("causal", "causal_bottom_right", "padding_causal"):
        right = 0
    if right != -1:
        ok &= j - (i + shift) <= right
    if left != -1:
        ok &= j - (i + shift) >= -left
    return ok


def _run_case(case: Case, device: torch.device, dtype: torch.dtype, b: int, h: int, s: int, d: int) -> Dict[str, Any]:
    import fused_attn
    from fused_attn.layouts import from_logical

    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
    sq, skv, hkv = case.sq or s, s, h // case.hkv_div
    dv = d // 2 if case.dv == -1 else d
    kwargs: Dict[str, Any] = dict(qkv_format=case.fmt, attn_mask_type=case.mask, window_size=case.window)
    score_fn = None
    if case.softcap is not None:
        import score_mods

        kwargs["score_mod"] = score_mods.softcap(case.softcap)
        score_fn = lambda x: case.softcap * torch.tanh(x / case.softcap)
    scale = 1.0 / math.sqrt(d)
    if case.fmt == "thd":
        lens = case.lengths
        cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
        t = int(cu[-1])
        args = (rnd(t, h, d), rnd(t, hkv, d), rnd(t, hkv, dv))
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        refs = []
        for i, n in enumerate(lens):
            sl = slice(sum(lens[:i]), sum(lens[:i]) + n)
            qb, kb, vb = (x[sl].transpose(0, 1)[None] for x in args)
            ok = _allowed(n, n, n, n, case.mask, case.window, device)
            refs.append(_naive(qb, kb, vb, scale, ok, score_fn)[0].transpose(0, 1))
        ref = torch.cat(refs)
    else:
        ql, kl, vl = rnd(b, h, sq, d), rnd(b, hkv, skv, d), rnd(b, hkv, skv, dv)
        args = tuple(from_logical(x, case.fmt).contiguous() for x in (ql, kl, vl))
        lens = case.lengths or [None] * b
        oks = [_allowed(sq, skv, n or sq, n or skv, case.mask, case.window, device) for n in lens]
        if case.lengths:
            cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(b)], dtype=torch.int32, device=device)
            kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        ref = from_logical(_naive(ql, kl, vl, scale, torch.stack(oks)[:, None], score_fn), case.fmt)
    backend = fused_attn.explain(*args, **kwargs).backend
    out = fused_attn.dot_product_attention(*args, **kwargs)
    reps = 3 if device.type == "cpu" else 20
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fused_attn.dot_product_attention(*args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / reps * 1e3
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    ok = math.isfinite(err) and err <= tol and bool(torch.isfinite(out).all())
    return {"name": case.name, "backend": backend, "err": err, "tol": tol, "ms": ms, "ok": ok}


def cudnn_status() -> str:
    """One line: the cuDNN library (and frontend) version this process loaded, or why none."""
    from .backends.cudnn import version

    if not torch.cuda.is_available():
        return (f"cuDNN: none loaded (torch {torch.__version__} sees no CUDA device); CPU calls run on the torch "
                "engine (torch's own kernels) where it is exact, else on the reference backend")
    reason = version.unavailable_reason()
    if reason is not None:
        return (f"cuDNN: not used ({reason}); calls run on the torch engine (CPU tensors) or the reference "
                "backend")
    import cudnn

    v = version.backend_version()
    return (f"cuDNN: library {v // 10000}.{v % 10000 // 100}.{v % 100} (frontend "
            f"{getattr(cudnn, '__version__', 'unknown')}, torch's own cuDNN {torch.backends.cudnn.version()})")


def engines_status() -> str:
    """One line: each registered engine, and why it cannot run here where it cannot (e.g. the
    FA4 engine without flash-attn-4 installed, with the command that adds it)."""
    from . import engine_table, engines

    parts = []
    for name in engine_table.engine_names():
        try:
            why = engines.get(name).unavailable()
        except NotImplementedError as exc:
            why = str(exc)
        parts.append(f"{name}: ready" if why is None else f"{name}: not available ({why})")
    return "engines: " + "; ".join(parts)


def self_check() -> int:
    """Run the configuration table on the present device; 0 if every check passes."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    b, h, s, d = (2, 8, 1024, 128) if cuda else (2, 4, 128, 64)
    print(f"fused_attn self-check on {torch.cuda.get_device_name() if cuda else 'CPU'}: {dtype}, "
          f"B={b} H={h} S={s} D={d}")
    try:
        import score_mods  # noqa: F401
        cases = _cases(s)
    except ImportError:
        cases = [c for c in _cases(s) if c.softcap is None]
    print(cudnn_status())
    print(engines_status())
    rows, failed = [], 0
    for case in progress(cases, desc="self-check"):
        try:
            r = _run_case(case, device, dtype, b, h, s, d)
        except Exception as exc:  # report every failure in the table, not only the first
            r = {"name": case.name, "backend": "-", "err": math.nan, "tol": math.nan, "ms": math.nan, "ok": False,
                 "error": f"{type(exc).__name__}: {exc}"}
        failed += not r["ok"]
        rows.append(r)
    width = max(len(r["name"]) for r in rows)
    print(f"{'configuration':<{width}}  {'backend':<9}  {'max err':>9}  {'tol':>7}  {'ms/call':>8}  check")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['backend']:<9}  {r['err']:>9.2e}  {r['tol']:>7.0e}  {r['ms']:>8.3f}  "
              f"{'ok' if r['ok'] else 'FAIL'}")
        if "error" in r:
            print(f"    {r['error']}")
    print(f"{len(rows) - failed}/{len(rows)} checks passed")
    return 1 if failed else 0
