"""Per-step costs a training loop feels: wall time per step, GPU time per step, kernels per step
and host synchronisations per step, for fused_attn and torch's varlen_attn in one run (and, where
flash-attn-4 is installed, FA4's own varlen call and fused_attn with its FA4 engine forced, each
checked against float64 first).

The step: fwd + bwd of varlen attention over a fresh packed batch (B sequences of random
lengths, multiples of 64 up to MAX) with H heads of dim D, bf16 — the configuration torch's
varlen_attn was introduced with. Lengths change every step; max_seqlen is passed (as a model
would pass its collator's value), so no call needs to read cu_seqlens on the host.

* wall ms / step: perf_counter over all steps, one synchronize at the end (what a user feels),
  best of ROUNDS rounds in which the implementations take turns;
* GPU ms / step: the sum of device kernel durations in a torch.profiler trace, divided by steps
  (the trace is taken after every timing of the process: `SuiteResult.profiled`);
* kernels / step: device kernels (memcpy/memset excluded) per step in that trace;
* host syncs / step: synchronising runtime calls and host reads of device values per step.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Sequence

import torch

from .common import check_tensor, reference_and_bounds
from .host import FLOOR
from .host_floors import EmptyAutogradFunction
from .packed import cu_seqlens, packed_tensors, reference_packed
from .runner import SuiteResult

N, MAX_LEN, H, D = 8, 2048, 16, 64
ROUNDS = 5
_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


BARE = "autograd.Function over bare cuDNN ragged graphs (no library code)"


class BareRaggedFunction(torch.autograd.Function):
    """apply(raw, q, k, v, cu): packed attention over one `RawRaggedSdpa` graph pair with only
    what a ragged call must do per step: the lengths and element offsets from cu_seqlens (three
    small kernels, no value checks), out and its statistics, dq / dk / dv. No library code: its
    step time is the floor of a Python-level varlen attention on cuDNN on this host."""

    @staticmethod
    def forward(ctx, raw, q, k, v, cu):
        _, h, _, d = raw.dims
        seq = (cu[1:] - cu[:-1]).view(-1, 1, 1, 1)
        off = (cu * (h * d)).view(-1, 1, 1, 1)
        stats_off = (cu * h).view(-1, 1, 1, 1)
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[0], h, 1), dtype=torch.float32, device=q.device)
        raw.run_fwd(q, k, v, out, lse, seq, off, stats_off)
        ctx.raw = raw
        ctx.save_for_backward(q, k, v, out, lse, seq, off, stats_off)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seq, off, stats_off = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.raw.run_bwd(q, k, v, out, grad.contiguous(), lse, dq, dk, dv, seq, off, stats_off)
        return None, dq, dk, dv, None


def check_bare(raw, device, causal: bool) -> None:
    """BareRaggedFunction vs the float64 reference on one small packed batch (raises if wrong)."""
    check_varlen_impl(BARE, lambda q, k, v, cq, *_: BareRaggedFunction.apply(raw, q, k, v, cq), raw.dims[1],
                      raw.dims[3], device, causal, lengths=[64, 320, 0, 128, 192, 64, 256, 448][:raw.dims[0]], seed=3)


def check_varlen_impl(name: str, fn: Callable, h: int, d: int, device, causal: bool,
                      lengths: Sequence[int] = (64, 320, 128, 192, 64, 256, 448, 64), seed: int = 4) -> None:
    """A varlen row's fn(q, k, v, cu_q, cu_k, max_q, max_k) vs the float64 reference on one small
    packed batch of `lengths`, output and gradients (raises if wrong)."""
    q, k, v, do = packed_tensors(sum(lengths), h, d, device, seed=seed)
    expected, bounds = reference_and_bounds(lambda dt: reference_packed(q, k, v, do, lengths, causal, dt), q.dtype)
    cu = cu_seqlens(lengths, device)
    out = fn(q, k, v, cu, cu, max(lengths), max(lengths))
    got = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), do)), out=out.detach())
    for key, want in expected.items():
        check_tensor(name, key, got[key], want, bounds[key])


FA4_DIRECT, FA4_OURS = "flash_attn_4 varlen (direct)", "fused_attn (fa4 engine)"


def fa4_varlen_impls(causal: bool, device) -> Dict[str, Callable]:
    """flash-attn-4's own varlen call (a peer) and fused_attn with its FA4 engine forced, where
    flash-attn-4 is installed and runs on this GPU; {} otherwise."""
    import fused_attn
    from fused_attn.backends.fa4 import install

    if install.unavailable() is not None or install.arch_refusal(device) is not None:
        return {}
    from flash_attn.cute.interface import flash_attn_varlen_func

    def direct(q, k, v, cq, ck, mq, mk):
        got = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
                                     causal=causal)
        return got[0] if isinstance(got, tuple) else got

    def ours(q, k, v, cq, ck, mq, mk):
        return fused_attn.dot_product_attention(q, k, v, qkv_format="thd", attn_mask_type="causal" if causal else
                                                "no_mask", cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=mq,
                                                max_seqlen_kv=mk, backend="fa4")

    return {FA4_OURS: ours, FA4_DIRECT: direct}


def _batches(steps: int, n: int, max_len: int, device, seed: int) -> List[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lens = (torch.randint(1, max_len // 64 + 1, (n,), generator=gen) * 64).tolist()
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).to(device)
        out.append((lens, cu))
    return out


def _step_fn(fn: Callable, qb, kb, vb, dob) -> Callable[[tuple], None]:
    def step(batch) -> None:
        lens, cu = batch
        t = sum(lens)
        q, k, v = qb[:t], kb[:t], vb[:t]
        out = fn(q, k, v, cu, cu, max(lens), max(lens))
        torch.autograd.backward(out, dob[:t])

    return step


PROFILE_COLUMNS = ("gpu_ms_per_step", "kernels_per_step", "host_syncs_per_step")


def _fill_profile(row: Dict[str, object], step: Callable[[tuple], None], batches: Sequence[tuple], device) -> None:
    """A deferred profiler pass (`SuiteResult.defer_profile`): the row's PROFILE_COLUMNS."""
    row.update(profile_steps(step, batches, device))


def profile_steps(step: Callable[[tuple], None], batches: Sequence[tuple], device) -> Dict[str, float]:
    """GPU ms, kernels and host syncs per step from one profiled pass over `batches`."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            step(b)
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as bare:
        torch.cuda.synchronize(device)
    ours = sum(1 for evt in bare.events() if evt.name in _SYNC_EVENTS)  # the loop's own final synchronize
    kernels, gpu_us, syncs = 0, 0.0, 0
    for evt in prof.events():
        name = evt.name
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith("Memcpy") or name.startswith("Memset") or "memcpy" in name or "memset" in name:
                continue
            kernels += 1
            gpu_us += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        elif name in _SYNC_EVENTS:
            syncs += 1
    n = len(batches)
    return dict(zip(PROFILE_COLUMNS, (gpu_us / 1e3 / n, kernels / n, max(0, syncs - ours) / n)))


_NOTES = {FLOOR: "no attention: slices, autograd and grad accumulation alone",
          BARE: "one prebuilt graph pair (the max_seqlen bucket), lengths and offsets by two torch ops, no value "
                "checks; checked vs float64"}


def run_varlen_step(device, quick: bool, *, n: int = N, max_len: int = MAX_LEN, h: int = H, d: int = D,
                    causal: bool = False) -> SuiteResult:
    """The varlen training step, fused_attn vs torch varlen_attn (see the module docstring)."""
    import fused_attn

    result = SuiteResult()
    if device.type != "cuda":
        return result
    from torch.nn.attention.varlen import varlen_attn as torch_varlen

    steps = 100 if quick else 400
    batches = _batches(steps, n, max_len, device, seed=17)
    gen = torch.Generator(device=device).manual_seed(5)
    bufs = [torch.randn(n * max_len, h, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
    qb, kb, vb = (t.requires_grad_() for t in bufs[:3])
    win = (-1, 0) if causal else (-1, -1)
    impls = {
        "fused_attn": lambda q, k, v, cq, ck, mq, mk: fused_attn.varlen_attn(q, k, v, cq, ck, mq, mk, window_size=win),
        "torch_varlen": lambda q, k, v, cq, ck, mq, mk: torch_varlen(q, k, v, cq, ck, mq, mk, window_size=win),
    }
    try:
        from .raw_cudnn import RawRaggedSdpa

        raw = RawRaggedSdpa(n, max_len, h, d, device, causal=causal)
        check_bare(raw, device, causal)
        impls[BARE] = lambda q, k, v, cq, *_: BareRaggedFunction.apply(raw, q, k, v, cq)
    except Exception as exc:  # noqa: BLE001 - the floor row is optional; say why it is missing
        result.failures.append(f"varlen step: {BARE}: {type(exc).__name__}: {exc}")
    for name, fn in fa4_varlen_impls(causal, device).items():
        try:
            check_varlen_impl(name, fn, h, d, device, causal)
            impls[name] = fn
        except Exception as exc:  # noqa: BLE001 - a row that is wrong or cannot run is reported, not timed
            result.failures.append(f"varlen step: {name}: {type(exc).__name__}: {exc}")
    impls[FLOOR] = lambda q, k, v, *_: EmptyAutogradFunction.apply(q, k, v)
    config = f"varlen step N{n} random lengths (x64) <= {max_len} H{h} D{d}" + (" causal" if causal else "")
    steps_by_impl = {name: _step_fn(fn, qb, kb, vb, bufs[3]) for name, fn in impls.items()}
    for step in steps_by_impl.values():
        for b in batches[:20]:  # warm up: every graph bucket of these lengths is built here
            step(b)
    torch.cuda.synchronize(device)
    builds0 = fused_attn.graph_cache.cache_info().builds
    wall = {name: float("inf") for name in impls}
    host = dict(wall)
    for _ in range(ROUNDS):  # interleaved rounds, best of each: a slow spell of the host hits every impl alike
        for name, step in steps_by_impl.items():
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for b in batches:
                step(b)
            host[name] = min(host[name], (time.perf_counter() - start) / steps * 1e3)
            torch.cuda.synchronize(device)
            wall[name] = min(wall[name], (time.perf_counter() - start) / steps * 1e3)
    builds = fused_attn.graph_cache.cache_info().builds - builds0
    for name, step in steps_by_impl.items():
        row = {"suite": "varlen", "config": config, "mode": "train step", "impl": name,
               "wall_ms_per_step": wall[name], "host_ms_per_step": host[name], **dict.fromkeys(PROFILE_COLUMNS),
               "builds": builds if name == "fused_attn" else None,
               "note": _NOTES.get(name, "warmed up; max_seqlen given; lengths new every step")}
        result.rows.append(row)
        result.defer_profile(f"{config} / {name}", functools.partial(_fill_profile, row, step, batches[:20], device))
    for peer in ("torch_varlen", FA4_DIRECT, FA4_OURS, BARE):
        if peer in wall:
            ours, theirs = wall["fused_attn"], wall[peer]
            result.notes.append(f"varlen train step wall: fused_attn / {peer} = {ours / theirs:.2f}x "
                                f"({ours:.3f} / {theirs:.3f} ms, best of {ROUNDS} interleaved rounds)")
    return result
