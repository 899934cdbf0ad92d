"""cuDNN faults the backend works around, as data: one entry per fault, with the library versions
it applies to.

    quirk = QUIRKS["nan_dq_kv_64_mod_128"]
    applies("nan_dq_kv_64_mod_128", 91900)   # True: the workaround (or refusal) is on
    applies("nan_dq_kv_64_mod_128", 92700)   # False: fixed in 9.26, the plain path runs
    quirk.refusal(91900, "a key length 64 mod 128 with a bias next to a score_mod")  # the message

Versions are cuDNN's integer form (major * 10000 + minor * 100 + patch: 91900 is 9.19.0). An
entry applies from `since` (the oldest version measured faulty; older ones are assumed faulty
too) up to, not including, `fixed_in`; `fixed_in=None` is open-ended (not yet seen fixed), so a
cuDNN newer than any tested one keeps every open entry. Each entry names the GPU test that
shows the fault where it applies and the plain path right outside it
(`tests/backends/cudnn/test_quirks_gpu.py`), so an upgrade that fixes or breaks something is a
test result. An entry's handling is a workaround, a refusal, or "documented" for a fault that
only non-finite inputs reach and whose check would cost every call a pass over them.
`lifted(...)` turns entries off inside a context: what those tests use to run the
plain path on a version where the entry applies (never for users).

Nothing outside this package names a cuDNN version: other modules ask `applies(name, version)`.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterator, Optional, Tuple

__all__ = ["Quirk", "QUIRKS", "TESTED_VERSIONS", "applies", "shaping", "active", "lifted", "version_string", "untested_notice",
           "upgrade_hint"]

#: cuDNN versions the GPU suite runs on (torch 2.11's pin, and the newest).
TESTED_VERSIONS: Tuple[int, ...] = (91900, 92700)

_TEST = "tests/backends/cudnn/test_quirks_gpu.py::test_quirk_matches_this_cudnn"


def version_string(version: int) -> str:
    """91900 -> "9.19.0" (cuDNN 9's integer version); 0 -> "unknown"."""
    if version <= 0:
        return "unknown"
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def _short(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}"


def upgrade_hint(version: int) -> str:
    """How a user gets cuDNN `version` or newer in place of torch's copy."""
    return f"pip install 'nvidia-cudnn-cu13>={_short(version)}'"


@dataclass(frozen=True)
class Quirk:
    """One cuDNN fault: what goes wrong, on which versions, where it was measured, what the
    backend does about it (a workaround or a refusal) and the user's way out."""

    name: str
    fault: str
    since: int
    fixed_in: Optional[int]
    measured: str
    handling: str
    way_out: str
    regression: bool = False
    test: str = _TEST

    def applies(self, version: int) -> bool:
        """Whether the fault is present on `version`. An unknown version (0) counts as faulty;
        versions older than `since` count as faulty too, except for a regression (a fault that
        a newer cuDNN introduced: older versions were measured right)."""
        if version and self.regression and version < self.since:
            return False
        return self.fixed_in is None or version < self.fixed_in

    def versions(self) -> str:
        """The versions it applies to, in words."""
        start = f"cuDNN {_short(self.since)}" if self.regression else f"cuDNN {_short(self.since)} (and older)"
        if self.fixed_in is None:
            return f"{start} and later (not yet seen fixed)"
        return f"{start} up to {_short(self.fixed_in)} (fixed in {_short(self.fixed_in)})"

    def refusal(self, version: int, what: str) -> str:
        """The refusal text for `what` on `version`: the fault, the version and the way out."""
        where = f"cuDNN {version_string(version)}" if version else "this cuDNN"
        fix = f"; fixed in cuDNN {_short(self.fixed_in)}: {upgrade_hint(self.fixed_in)}" if self.fixed_in else ""
        return f"{what}: {where} {self.fault} (quirk {self.name!r}{fix}); {self.way_out}"


def _q(name: str, fault: str, since: int, fixed_in: Optional[int], measured: str, handling: str, way_out: str,
       regression: bool = False) -> Quirk:
    return Quirk(name, fault, since, fixed_in, measured, handling, way_out, regression)


QUIRKS: Dict[str, Quirk] = {q.name: q for q in (
    _q("nan_dq_kv_64_mod_128",
       "writes NaN into dQ when the key length is 64 mod 128 and a row's log-sum-exp is below about -88.7 "
       "(reachable through a bias or a score_mod)",
       91900, 92600, "H200, cuDNN 9.19 (bias -200 on some rows, Skv 192 / 320); absent on 9.27; upstream fix 9.26",
       "workaround: the backward runs keys padded by 64 and masked past the real length (causal score_mods, biases "
       "alone); refusal where that padded form crashes the planner (a bias next to a score_mod, a score_mod "
       "without a causal mask, one that folds q_len / kv_len)",
       "pad the keys to a multiple of 128, or use backend='reference'"),
    _q("nan_dq_kv_64_mod_128_score_mod_bias",
       "writes NaN into dQ at key lengths 64 mod 128 when a score_mod callback and cuDNN's bias input meet in "
       "one graph and a row's log-sum-exp is below about -88.7",
       91900, None, "H200, cuDNN 9.27.0 (a -200 bias on some rows with softcap, Skv 576); 9.19 as the entry above",
       "refusal (the padded-key backward with a score_mod and a bias input crashes the 9.19 planner)",
       "pad the keys to a multiple of 128, or use backend='reference'"),
    _q("ragged_sink_backward",
       "reads out of bounds in a ragged (thd) backward with a sink token (its dot(dO, O) pre-pass)",
       91900, 92600, "upstream report, fixed in 9.26; declined by 9.19's planner",
       "workaround: the sink stays out of the ragged backward graph (the forward's Stats already include it, so "
       "dQ, dK, dV are exact) and its gradient is a reduction of its own",
       "nothing to do: the workaround is exact"),
    _q("sq1_skv1_backward",
       "has no backward for s_q = s_kv = 1",
       91900, None, "H100 / H200, cuDNN 9.19",
       "refusal (training calls with one query and one key per dense batch entry)",
       "use backend='reference' for such calls"),
    _q("kv_broadcast_operand_backward",
       "reads a graph input that varies along the keys only (a (.., 1, Skv) view such as w[kv_idx]) wrongly in "
       "its backward (dQ/dK/dV off by O(1) while the forward is right)",
       91900, None, "H200, cuDNN 9.19",
       "refusal for training calls",
       "pass the term as a full (.., Sq, Skv) bias (post_scale_bias), or use backend='reference'"),
    _q("batch_broadcast_operand",
       "reads a graph input that varies along the batch only ((B, 1|H, 1, 1), a per-sequence scalar such as "
       "lens[b]) wrongly inside a mask or a product (outputs off by O(1))",
       91900, None, "H200, cuDNN 9.19 (`kv_idx < lens[b]` masks, `score * w[b]`)",
       "refusal",
       "index it along the keys or queries as well (e.g. a (B, Skv) table read at [b, kv_idx]), or use "
       "backend='reference'"),
    _q("ragged_batch_operand",
       "reads per-sequence graph inputs (indexed by the batch index) wrongly in ragged (thd) graphs",
       91900, None, "H200, cuDNN 9.19",
       "refusal on packed batches",
       "pass the batch padded (dense with cu_seqlens), or use backend='reference'"),
    _q("dbias_next_to_score_mod",
       "computes dBias wrongly when the graph also has a score_mod callback",
       91900, None, "H200, cuDNN 9.19",
       "refusal (a trained bias next to another score_mod term)",
       "train the bias alone (post_scale_bias), or use backend='reference'"),
    _q("ragged_key_tail_next_to_score_mod",
       "does not mask keys past each sequence's length in ragged graphs next to a score_mod (outputs off by "
       "O(1) wherever a sequence's key count leaves a partial tile), and no mask in the callback can bound them",
       91900, None, "H200, cuDNN 9.19 (softcap without a mask); on 9.27.0 that case is exact, but a window over "
       "separate query and key lengths (queries past the keys) still gives wrong rows",
       "workaround: such packed calls run as a zero-padded dense batch with the lengths in the bias input, or "
       "under a top-left causal band over one cu_seqlens tensor; refusal where neither serves",
       "use a causal mask over one cu_seqlens tensor, or backend='reference'"),
    _q("irregular_mask_backward",
       "recomputes masks that read a graph input varying along the keys (document ids, 2-D neighbourhoods) "
       "wrongly in its backward (dQ off by up to 4.0) while the forward is right",
       91900, None, "H100 / H200, cuDNN 9.19",
       "refusal for training calls (forward-only calls run)",
       "packed documents run as sequences (fused_attn.doc_packed_attn or thd); else backend='reference'"),
    _q("band_next_to_score_mod",
       "declines its own band (causal, sliding window) next to a score_mod callback",
       91900, None, "H200, cuDNN 9.19",
       "workaround: the band becomes a select in the callback, cut into rectangles where that saves work "
       "(band_chunks, band_ragged)",
       "nothing to do: the workaround is exact"),
    _q("nonfinite_value_in_causal_tile",
       "spreads a NaN value at a key that later queries attend to the earlier rows of its query tile, which "
       "do not attend that key (their weight 0 times NaN in the tile's P @ V); a non-finite key does not, and "
       "keys that no query attends are never loaded",
       91900, None, "H200, cuDNN 9.19 and 9.27.0 (causal, a NaN in V at one attended key, 6 of 6 seeds)",
       "documented, not worked around: finite inputs are exact, and padding past the lengths is never read",
       "keep V finite at attended keys, or use backend='reference' (exact here)"),
    _q("score_reused_in_pointwise",
       "faults with an illegal address (err 700; the CUDA context is lost) when a pointwise op of a score_mod "
       "callback reads the callback's input (the score, or dS) next to a value computed from it (s * s, "
       "-s * s, tanh(s) + s, where(c, where(c2, s, -inf), s))",
       92000, None, "H200, cuDNN 9.27.0 (raw graphs; 9.19 runs the same graphs right): first seen in the "
       "block_diffusion mask, then gelu_tanh / power / custom activations",
       "workaround: the callbacks (the library's lowering and raw user callbacks) read such an input through "
       "one identity copy (isolation.IsolatingGraph); exact",
       "nothing to do: the workaround is exact", regression=True),
)}

_LIFTED: "contextvars.ContextVar[FrozenSet[str]]" = contextvars.ContextVar("fused_attn_cudnn_lifted",
                                                                           default=frozenset())


def applies(name: str, version: int) -> bool:
    """Whether quirk `name` applies on cuDNN `version` (and is not lifted in this context)."""
    return name not in _LIFTED.get() and QUIRKS[name].applies(version)


def shaping(version: int, *, score_mod: bool, banded: bool, padded_keys: Tuple[str, ...] = (),
            sink_split: bool = False) -> Tuple[str, ...]:
    """The entries whose workarounds shaped one plan (what `explain` lists), one rule for every
    runner: the sink-free ragged backward (`sink_split`), the padded-key backward (the entries
    that asked for it, `padded_keys`), and the score_mod graph's isolation and band handling."""
    got = []
    if sink_split:
        got.append("ragged_sink_backward")
    got.extend(padded_keys)
    if score_mod and applies("score_reused_in_pointwise", version):
        got.append("score_reused_in_pointwise")
    if score_mod and banded and applies("band_next_to_score_mod", version):
        got.append("band_next_to_score_mod")
    return tuple(got)


def active(version: int) -> Tuple[str, ...]:
    """The names of the entries that apply on `version`."""
    return tuple(name for name in QUIRKS if applies(name, version))


@contextlib.contextmanager
def lifted(*names: str) -> Iterator[None]:
    """Run the plain path of these entries in this context (tests that show a fault; plans made
    here must not be reused outside it: clear the plan cache after)."""
    unknown = [n for n in names if n not in QUIRKS]
    if unknown:
        raise ValueError(f"lifted: unknown quirk(s) {unknown}; known: {sorted(QUIRKS)}")
    token = _LIFTED.set(_LIFTED.get() | frozenset(names))
    try:
        yield
    finally:
        _LIFTED.reset(token)


def untested_notice(version: int) -> Optional[str]:
    """A one-line notice for a cuDNN version the suite has not run on, else None."""
    if version <= 0 or version in TESTED_VERSIONS:
        return None
    tested = ", ".join(version_string(v) for v in TESTED_VERSIONS)
    newer = version > max(TESTED_VERSIONS)
    return (f"fused_attn: cuDNN {version_string(version)} is untested (tested: {tested}); "
            + ("every workaround not yet seen fixed stays on" if newer else "workarounds apply as for the nearest "
               "tested version"))
