"""Per-step costs a training loop feels: wall time per step, GPU time per step, kernels per step
and host synchronisations per step, for fused_attn and torch's varlen_attn in one run.

The step: fwd + bwd of varlen attention over a fresh packed batch (B sequences of random
lengths, multiples of 64 up to MAX) with H heads of dim D, bf16 — the configuration torch's
varlen_attn was introduced with. Lengths change every step; max_seqlen is passed (as a model
would pass its collator's value), so no call needs to read cu_seqlens on the host.

* wall ms / step: perf_counter over all steps, one synchronize at the end (what a user feels);
* GPU ms / step: the sum of device kernel durations in a torch.profiler trace, divided by steps;
* kernels / step: device kernels (memcpy/memset excluded) per step in that trace;
* host syncs / step: synchronising runtime calls and host reads of device values per step.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

import torch

from .host import FLOOR, EmptyAutogradFunction
from .runner import SuiteResult

N, MAX_LEN, H, D = 8, 2048, 16, 64
_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


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
    return {"gpu_ms_per_step": gpu_us / 1e3 / n, "kernels_per_step": kernels / n,
            "host_syncs_per_step": max(0, syncs - ours) / n}


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
        FLOOR: lambda q, k, v, *_: EmptyAutogradFunction.apply(q, k, v),
    }
    config = f"varlen step N{n} random lengths (x64) <= {max_len} H{h} D{d}" + (" causal" if causal else "")
    for name, fn in impls.items():
        step = _step_fn(fn, qb, kb, vb, bufs[3])
        for b in batches[:20]:  # warm up: every graph bucket of these lengths is built here
            step(b)
        torch.cuda.synchronize(device)
        builds0 = fused_attn.graph_cache.cache_info().builds
        start = time.perf_counter()
        for b in batches:
            step(b)
        host = (time.perf_counter() - start) / steps * 1e3
        torch.cuda.synchronize(device)
        wall = (time.perf_counter() - start) / steps * 1e3
        builds = fused_attn.graph_cache.cache_info().builds - builds0
        prof = profile_steps(step, batches[:20], device)
        result.rows.append({"suite": "varlen", "config": config, "mode": "train step", "impl": name,
                            "wall_ms_per_step": wall, "host_ms_per_step": host, **prof,
                            "builds": builds if name == "fused_attn" else None,
                            "note": ("no attention: slices, autograd and grad accumulation alone" if name == FLOOR
                                     else "warmed up; max_seqlen given; lengths new every step")})
    return result
