"""How the benchmark suites time a call: median per call (`time_ms`), host time per call
(back-to-back, launching ahead of the GPU, interleaved rounds) and device time per call.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, Hashable, List

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _event_loop_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median of per-call CUDA-event timings after `warmup_ms` of warm-up calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 3, 1e-3)
    n_warm, n_rep = max(1, int(warmup_ms / est)), max(5, min(1000, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
    for s, e in events:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0,
            rep_ms: float = 100.0) -> float:
    """Median milliseconds per call of `fn` (which must not synchronize).

    CUDA: `triton.testing.do_bench` when importable, else a CUDA-event loop. CPU (smoke runs
    only): wall-clock median of a few calls.
    """
    if device.type != "cuda":
        fn()
        samples = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    try:
        from triton.testing import do_bench
    except ImportError:
        return _event_loop_ms(fn, warmup_ms, rep_ms)
    try:
        return float(do_bench(fn, warmup=int(warmup_ms), rep=int(rep_ms), return_mode="median"))
    except TypeError:  # an old triton without return_mode
        return _event_loop_ms(fn, warmup_ms, rep_ms)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 2000, warmup: int = 20) -> float:
    """Host microseconds per call: `calls` back-to-back calls, one synchronize after the loop
    (after `warmup` untimed calls): the wall time per call of back-to-back calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / calls * 1e6


def host_us_launching(fn: Callable[[], object], device: torch.device, calls: int = 40, rounds: int = 3) -> float:
    """Host microseconds per call while the GPU works behind it: `calls` back-to-back calls timed
    up to the return of the last one (before synchronizing), best of `rounds`; few enough calls
    that their launches do not fill the device queue (which would make the host wait)."""
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
        synchronize(device)
    return best


def device_ms_per_call(fn: Callable[[], object], device: torch.device, host_us: float, calls: int = 20,
                       rounds: int = 3) -> float:
    """Device milliseconds per call with the host ahead of the GPU: a sleep kernel holds the
    stream while `calls` calls are queued behind it, and CUDA events around the queued calls time
    the GPU alone (the call's kernels, copies and fills and the gaps between them), best of
    `rounds`. host_us: the call's host time (sizes the sleep). No profiler: torch's profiler
    leaves CUPTI attached to the process after a pass (pytorch/pytorch#144455), and in one H200
    run the rows timed after such passes ran up to 2x slower on the host."""
    cycles_per_ms = _sleep_cycles_per_ms()
    best = float("inf")
    for _ in range(rounds):
        fn()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(cycles_per_ms * (2.0 * calls * host_us / 1e3 + 2.0)))
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        synchronize(device)
        best = min(best, start.elapsed_time(end) / calls)
    return best


def _sleep_cycles_per_ms() -> float:
    """Cycles of `torch.cuda._sleep` per millisecond on the current device (timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # warm
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize()
    return 2_000_000 / max(start.elapsed_time(end), 1e-3)


def host_us_rounds(fns: Dict[Hashable, Callable[[], object]], device: torch.device, calls: int = 2000,
                   rounds: int = 5, warmup: int = 20) -> Dict[Hashable, List[float]]:
    """Host microseconds per call of each of `fns` in each of `rounds` interleaved rounds (each
    round times every fn over `calls` back-to-back calls, one synchronize after; `host_us_per_call`):
    a slow spell of a shared host then disturbs one round of every row, not every round of one
    row, and a ratio of two rows taken round by round shows the run's own noise."""
    spent: Dict[Hashable, List[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            spent[name].append(host_us_per_call(fn, device, calls, warmup))
    return spent

