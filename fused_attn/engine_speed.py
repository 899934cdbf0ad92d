"""backend="auto"'s choice by measurement: committed tables of engine timings per GPU architecture.

`python -m fused_attn bench engines` times every engine that can run a problem family on the GPU
at hand and writes `fused_attn/speed/sm<major><minor>.csv` (committed, shipped in the wheel):

    family,seq,engine,fwd_ms,fwd_bwd_ms,fwd_gpu_ms,fwd_bwd_gpu_ms
    dense/causal/none/vanilla/mha/d128,4096,cudnn,0.257,1.031,0.251,0.982

A family says what decides the fastest kernel (`family`): dense or thd, the mask (none / causal
/ window), the score_mod (none, softcap or any other), the softmax type (sinks), GQA or not, the
head dim. `rank` reorders the engines that can serve a problem by the row of its family nearest
in length (log scale), forward for calls without gradients, forward + backward otherwise: by
wall time per step (`*_ms`: what a call costs a step, its host path included), and among the
engines whose wall time is within `WALL_TIE` of the fastest (indistinguishable on a shared
host), by GPU time (`*_gpu_ms`, a stable measurement; rows without it rank by wall alone).
Engines without a row keep their default order after the measured ones; a family without rows
keeps the default order (cuDNN first), and the reason says so: the choice is never silent.

A training call may run its forward on one engine and its backward on another (`split`): a pair
is taken when it beats the best single engine's fwd+bwd by more than `WALL_TIE`. Its cost is its
own measured row where the table has one (engine "fa4+cudnn": what `bench engines` timed when
`auto` ran that pair; only its fwd+bwd column is read), else the estimate from the single
engines' rows: the forward engine's fwd plus the backward engine's fwd+bwd minus its fwd.
"""

from __future__ import annotations

import csv
import functools
import math
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import device_facts
from .cache_registry import register_lru

__all__ = ["Measured", "WALL_TIE", "Split", "family", "rank", "split", "pair_name", "table", "table_path", "arch_of",
           "seq_of", "clear"]

_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speed")

#: wall times within this fraction of the fastest engine's are a tie, which GPU time breaks
WALL_TIE = 0.05


class Measured(NamedTuple):
    """One engine's row of a family at one length: ms per call (wall per step, and GPU time
    where the table has it)."""
    seq: int
    engine: str
    fwd: float
    fwd_bwd: float
    fwd_gpu: Optional[float] = None
    fwd_bwd_gpu: Optional[float] = None


class Split(NamedTuple):
    """A training call's forward on one engine and its backward on another, and why."""
    forward: str
    backward: str
    reason: str


def _optional_ms(text: Optional[str]) -> Optional[float]:
    return float(text) if text not in (None, "") else None


def table_path(arch: str) -> str:
    """Where the table of architecture `arch` ("sm90") lives."""
    return os.path.join(_DIR, f"{arch}.csv")


@register_lru("engine_speed.table")
@functools.lru_cache(maxsize=16)
def table(arch: str) -> Dict[str, List[Measured]]:
    """family -> [Measured] of the committed table ({} when none)."""
    path = table_path(arch)
    out: Dict[str, List[Measured]] = {}
    if not os.path.exists(path):
        return out
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            try:
                entry = Measured(int(row["seq"]), row["engine"], float(row["fwd_ms"]), float(row["fwd_bwd_ms"]),
                                 _optional_ms(row.get("fwd_gpu_ms")), _optional_ms(row.get("fwd_bwd_gpu_ms")))
            except (KeyError, ValueError):
                continue  # a malformed row is not a measurement
            out.setdefault(row["family"], []).append(entry)
    return out


def clear() -> None:
    """Forget loaded tables (after a new table is written)."""
    table.cache_clear()


def arch_of(device: Any) -> Optional[str]:
    """"sm90" for a CUDA device of compute capability 9.0, None for other devices."""
    return device_facts.arch_name(device)


def family(problem: Any) -> str:
    """The family of a StaticProblem: "kind/mask/mod/softmax_type/mha|gqa/d<D>"."""
    spec = problem.spec
    mod = spec.score_mod
    band = spec.band
    native = mod.native_band if mod is not None else None
    if native is not None and band is None:
        band_left, band_right = native[0], native[1]
        mod_kind = "none"
    else:
        band_left, band_right = (band.left, band.right) if band is not None else (None, None)
        mod_kind = "none" if mod is None else ("softcap" if mod.base_name == "softcap" else "mod")
    if band is None and native is None:
        mask = "none"
    elif band_left is None and band_right == 0:
        mask = "causal"
    else:
        mask = "window"
    kind = "thd" if spec.is_packed else "dense"
    heads = "gqa" if problem.heads != problem.kv_heads else "mha"
    return f"{kind}/{mask}/{mod_kind}/{spec.softmax_type}/{heads}/d{problem.head_dim}"


def seq_of(problem: Any) -> int:
    """The length a problem is compared by: Skv (dense) or the max_seqlen bucket (thd; 0 unknown)."""
    return int(problem.seqlen_kv or 0)


def _nearest(rows: Sequence[Measured], seq: int) -> Dict[str, Measured]:
    """engine -> its row nearest to `seq` (log distance)."""
    best: Dict[str, Tuple[float, Measured]] = {}
    for m in rows:
        dist = abs(math.log2(max(m.seq, 1)) - math.log2(max(seq, 1)))
        if m.engine not in best or dist < best[m.engine][0]:
            best[m.engine] = (dist, m)
    return {e: m for e, (_, m) in best.items()}


def _order(near: Dict[str, Measured], measured: List[str], what: str) -> Tuple[List[str], bool]:
    """(the measured engines fastest first, whether GPU time broke a tie of wall times)."""
    wall = {e: getattr(near[e], what) for e in measured}
    gpu = {e: getattr(near[e], what + "_gpu") for e in measured}
    by_wall = sorted(measured, key=lambda e: wall[e])
    fastest = wall[by_wall[0]]
    tied = [e for e in by_wall if wall[e] <= fastest * (1 + WALL_TIE)]
    if len(tied) < 2 or any(gpu[e] is None for e in tied):
        return by_wall, False
    tied.sort(key=lambda e: gpu[e])
    return tied + [e for e in by_wall if e not in tied], tied[0] != by_wall[0]


def rank(problem: Any, candidates: Sequence[str]) -> Tuple[List[str], str]:
    """(candidates in the order to try, why that order). Only engines with a measured row of the
    problem's family move; the rest keep their default order after them."""
    candidates = list(candidates)
    if len(candidates) < 2:
        return candidates, ""
    arch, fam, near = _measured_rows(problem)
    if arch is None:
        return candidates, ""
    if not near:
        return candidates, f"no measurement for {fam} on {arch}: the default order"
    measured = [c for c in candidates if c in near]
    if len(measured) < 2:
        return candidates, f"fewer than two measured engines for {fam} on {arch}: the default order"
    what = "fwd_bwd" if problem.needs_grad else "fwd"
    order, tie = _order(near, measured, what)
    rest = [c for c in candidates if c not in near]

    def cost(e: str) -> str:
        gpu = getattr(near[e], what + "_gpu")
        return f"{e} {getattr(near[e], what):.3f} ms" + (f" (GPU {gpu:.3f})" if gpu is not None else "")

    times = ", ".join(cost(e) for e in order)
    label = "fwd+bwd" if problem.needs_grad else "fwd"
    how = f"; wall times within {WALL_TIE:.0%}: GPU time decides" if tie else ""
    return order + rest, f"measured on {arch} for {fam} near S={near[order[0]].seq} ({label}: {times}{how})"


def _measured_rows(problem: Any) -> Tuple[Optional[str], str, Dict[str, Measured]]:
    """(arch or None, family, engine -> its row nearest the problem's length)."""
    arch = arch_of(problem.device)
    fam = family(problem)
    if arch is None:
        return None, fam, {}
    return arch, fam, _nearest(table(arch).get(fam, ()), seq_of(problem))


def pair_name(forward: str, backward: str) -> str:
    """The table's engine name of a split call: "fa4+cudnn" (forward engine + backward engine)."""
    return f"{forward}+{backward}"


def _pair_cost(near: Dict[str, Measured], fwd: str, bwd: str) -> Tuple[float, str]:
    """(ms per fwd+bwd, how it is known) of a pair: its own measured row, else the estimate."""
    own = near.get(pair_name(fwd, bwd))
    if own is not None:
        return own.fwd_bwd, f"{fwd} + {bwd} measured as a pair near S={own.seq}: {own.fwd_bwd:.3f} ms per fwd+bwd"
    cost = near[fwd].fwd + near[bwd].fwd_bwd - near[bwd].fwd
    return cost, (f"{fwd}'s forward {near[fwd].fwd:.3f} ms + {bwd}'s backward {near[bwd].fwd_bwd - near[bwd].fwd:.3f}"
                  f" ms = {cost:.3f} ms per fwd+bwd")


def split(problem: Any, forward_engines: Sequence[str], backward_engines: Sequence[str],
          single: Sequence[str]) -> Optional[Split]:
    """The (forward engine, backward engine) pair of two different engines for a training call
    when the table says it beats every engine of `single` (the engines that can serve the whole
    call) by more than WALL_TIE of wall time per step, or None (`_pair_cost`: the pair's own row,
    else the forward's fwd plus the backward engine's fwd+bwd minus its fwd)."""
    if not problem.needs_grad:
        return None
    arch, fam, near = _measured_rows(problem)
    whole = [e for e in single if e in near]
    if not whole:
        return None
    best = min(whole, key=lambda e: near[e].fwd_bwd)
    best_cost = near[best].fwd_bwd
    pairs = [_pair_cost(near, f, b) + (f, b)
             for f in forward_engines if f in near for b in backward_engines if b in near and b != f]
    if not pairs:
        return None
    cost, how, fwd, bwd = min(pairs)
    if cost >= best_cost * (1 - WALL_TIE):
        return None
    return Split(fwd, bwd, f"measured on {arch} for {fam} near S={near[fwd].seq}: {how} against {best_cost:.3f} ms "
                           f"for {best} alone")
