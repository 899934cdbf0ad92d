"""Check-then-time one benchmark configuration over several implementations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .common import Group, Impl, ImplWrongError, check_impl, time_ms


@dataclass
class SuiteResult:
    """Rows of a suite run plus the failures (wrong or crashing required impls) found on the way."""

    rows: List[Dict[str, object]] = field(default_factory=list)
    failures: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def extend(self, other: "SuiteResult") -> None:
        self.rows += other.rows
        self.failures += other.failures
        self.notes += other.notes


def run_config(suite: str, config: str, impls: Sequence[Impl], ref32: Dict[str, torch.Tensor],
               tol: Dict[str, float], select: Callable[[str, torch.Tensor], torch.Tensor],
               flops: Dict[str, Optional[float]], device: torch.device, *, modes: Sequence[str] = ("fwd", "fwd_bwd"),
               rep_ms: float = 100.0) -> SuiteResult:
    """Check every impl against `ref32` (within `tol`), then time it in each mode.

    A wrong result, or a crash of a `required` impl, is recorded in `failures` and the impl is not
    timed; a crashing peer gets a row with its error in `note`. Returns rows with peer ratios.
    """
    result = SuiteResult()
    groups = {m: Group(suite, config, m, flops.get(m)) for m in modes}
    for impl in impls:
        try:
            errs = check_impl(impl, ref32, tol, select)
        except ImplWrongError as exc:
            result.failures.append(f"{suite} / {config}: {exc}")
            for g in groups.values():
                g.add(impl.name, None, None, note="WRONG: " + str(exc))
            continue
        except Exception as exc:  # the impl could not run this configuration
            msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            if impl.required:
                result.failures.append(f"{suite} / {config}: {impl.name} failed: {msg}")
            for g in groups.values():
                g.add(impl.name, None, None, note=("FAILED: " if impl.required else "unsupported: ") + msg)
            continue
        for mode, g in groups.items():
            fn = impl.fwd if mode == "fwd" else impl.fwd_bwd
            if fn is None:
                g.add(impl.name, None, None, note="no backward")
                continue
            keys = ["out"] if mode == "fwd" else list(errs)
            err = max((errs[k] for k in keys if k in errs), default=None)
            g.add(impl.name, time_ms(fn, device, rep_ms=rep_ms), err, note=impl.note)
    for g in groups.values():
        result.rows += g.finish()
    return result
