"""Check-then-time one benchmark configuration over several implementations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .common import (Group, Impl, ImplWrongError, check_impl, device_ms_per_call, host_us_launching, time_ms,
                     worst_error)


@dataclass
class SuiteResult:
    """Rows of a suite run plus the failures (wrong or crashing required impls) found on the way.

    profiled: torch.profiler passes that fill columns of rows already in `rows`, deferred until
    every timing of the process is taken (`run_profiled`): torch's profiler leaves CUPTI attached
    to the process after a pass (pytorch/pytorch#144455), and host-bound work timed after one ran
    up to 2x slower (H200), so a pass run between timings would skew every later row.
    """

    rows: List[Dict[str, object]] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    profiled: List[Tuple[str, Callable[[], None]]] = field(default_factory=list)

    def extend(self, other: "SuiteResult") -> None:
        self.rows += other.rows
        self.failures += other.failures
        self.notes += other.notes
        self.profiled += other.profiled

    def defer_profile(self, what: str, fill: Callable[[], None]) -> None:
        """Queue `fill` (a profiler pass that writes into rows of this result) under the name `what`."""
        self.profiled.append((what, fill))

    def run_profiled(self) -> None:
        """Run the deferred profiler passes in order, once; a pass that raises leaves its columns
        empty and is recorded in `failures`."""
        passes, self.profiled = self.profiled, []
        for what, fill in passes:
            try:
                fill()
            except Exception as exc:  # noqa: BLE001 - a profile is extra information; say why it is missing
                self.failures.append(f"profiler pass {what}: {type(exc).__name__}: {exc}")


def run_config(suite: str, config: str, impls: Sequence[Impl], expected: Dict[str, torch.Tensor],
               bounds: Dict[str, float], select: Callable[[str, torch.Tensor], torch.Tensor],
               flops: Dict[str, Optional[float]], device: torch.device, *, modes: Sequence[str] = ("fwd", "fwd_bwd"),
               rep_ms: float = 100.0, split_times: bool = False) -> SuiteResult:
    """Check every impl against the float64 `expected` values (max abs error within `bounds`, see
    `common.reference_and_bounds`), then time the impls that passed in each mode.

    All impls are checked first; then `expected` is emptied, so the reference is freed before
    anything is timed. A wrong result (any impl), or a crash of a `required` impl, is recorded in
    `failures` and the impl is not timed; a crashing peer gets a row with its error in `note`.
    Rows (in impl order, with peer ratios) carry max_err, bound and worst: for fwd the output's,
    for fwd_bwd those of the checked quantity closest to its bound.

    split_times (CUDA): each row also gets gpu_ms (the device time of one call with the host
    ahead: kernels, copies, fills and the gaps between them) and host_us (host time per call while
    the GPU works behind), both measured after ms, so a row whose ms is set by the host rather
    than the GPU shows it.
    """
    result = SuiteResult()
    groups = {m: Group(suite, config, m, flops.get(m)) for m in modes}
    checked: List[Tuple[Impl, Dict[str, float], Optional[Dict[str, object]]]] = []  # impl, errs, row if bad
    for impl in impls:
        try:
            checked.append((impl, check_impl(impl, expected, bounds, select), None))
        except ImplWrongError as exc:
            result.failures.append(f"{suite} / {config}: {exc}")
            checked.append((impl, {}, dict(max_err=exc.err, bound=exc.bound, worst=exc.key, note="WRONG: " + str(exc))))
        except Exception as exc:  # the impl could not run this configuration
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if impl.required:
                result.failures.append(f"{suite} / {config}: {impl.name} failed: {msg}")
            note = ("FAILED: " if impl.required else "unsupported: ") + msg
            checked.append((impl, {}, dict(max_err=None, note=note)))
    expected.clear()  # free the reference before timing
    split_here = split_times and device.type == "cuda"
    empty = {"gpu_ms": None, "host_us": None} if split_here else None
    for impl, errs, bad in checked:
        for mode, g in groups.items():
            fn = impl.fwd if mode == "fwd" else impl.fwd_bwd
            if bad is not None:
                g.add(impl.name, None, **bad, split=empty)
            elif fn is None:
                g.add(impl.name, None, None, note="no backward", split=empty)
            else:
                key, err, bound = worst_error(errs, bounds, ["out"] if mode == "fwd" else None)
                ms, split = time_ms(fn, device, rep_ms=rep_ms), None
                if split_here:
                    host_us = host_us_launching(fn, device)
                    split = {"gpu_ms": device_ms_per_call(fn, device, host_us), "host_us": host_us}
                g.add(impl.name, ms, err, note=impl.note, bound=bound, worst=key, split=split)
    for g in groups.values():
        result.rows += g.finish()
    return result
