"""Lower a score_mod DAG (forward and derived backward) to cuDNN frontend pointwise ops.

Every node of the DAG is classified once, structurally (`Plan`):

  scalar        only constants, scalar parameters and lengths below: folded on the host into
                one pass-by-value fp32 operand (as before);
  in-graph      depends on the score (or dS), or on BOTH q_idx and kv_idx through ops the
                engines accept: emitted as pointwise ops inside the fused kernel;
  materialized  a score-free subexpression that would cost kernel work or that the engines
                cannot do, evaluated eagerly with exact torch semantics and bound as a graph
                input (materialization.py): *single-axis* (depends on at most one of q_idx /
                kv_idx, plus b, h, parameters) -> a broadcast (B|1, H|1, Sq|1, Skv|1)
                tensor, when it contains anything beyond + - * and comparisons (//, %, bit
                tricks, clamps, floor, table gathers: Morton decoding costs O(S) once, nothing
                in the kernel); *dense* (depends on both) -> (B|1, H|1, Sq, Skv), when its op
                cannot be emitted (a gather at q_idx - kv_idx + c, bit ops mixing both axes);
  view          a tensor parameter indexed by bare index arguments in axis order (bias[b, h,
                q_idx, kv_idx], slopes[h], ids[q_idx]): bound as a view, no copy (as before).

Rules the H100 engines imposed (benchmarks/results/frontend_probe_h100.md):
* every emitted op has an input derived from score / dS / gen_index, and a graph input or a
  pass-by-value scalar is never an op's first input: such inputs are anchored by adding a zero
  built as sub(gen_index, gen_index);
* a comparison a OP b is rewritten as E OP c, with E the index-dependent part of a - b (e.g.
  kv_idx - q_idx) and c a host-folded scalar;
* `where` on &, |, ^, ~ becomes nested binary_selects on single comparisons; a materialized
  condition is bound as 0/1 and compared with 0.5;
* every op gets compute type FLOAT and an explicit output type (FLOAT or BOOLEAN).
Integer values are carried in fp32 in the graph: exact below 2**24 (positions are).
`cudnn` is imported only when ops are emitted.

The backend's entry point (`scaled_plan_for`, via `ScoreMod.lower_scaled_forward`) folds a
leading scalar factor out of the mod: when the score enters only as `score * c` or `score / c`
with c a host scalar (softcap's `score / cap`), the callback receives c x score through cuDNN's
attention scale and computes the rest, one pointwise op fewer per score in the forward and in
each backward pass over it (measured on H200, D64: softcap + causal 2-3%, softcap + window 8%
forward+backward). The fold needs c > 0 and finite at run time (the backend refuses other
values) and the same operands as the plain plan.

Modules: table (the op table and recipes), facts (per-node structural facts), rewrite (the
lowering form), guards (non-finite guards at masked scores), plans (Plan and its memos, scalar
operands), emit (frontend ops). This package re-exports their names.
"""

from __future__ import annotations

from ..expr import show  # noqa: F401 - re-exported (plan text in tests and docs)
from .emit import Emitter, lower_backward, lower_forward, unsupported_message  # noqa: F401
from .facts import AXIS_LETTER, ZERO, Facts, is_derived, is_scalar  # noqa: F401
from .guards import _masked_stays_masked, _zero_where_no_gradient  # noqa: F401
from .plans import (  # noqa: F401
    Plan, eval_scalar, fold_score_scale_of, plan_for, scalar_operands, scalar_tensor, scaled_plan_for,
)
from .rewrite import Materialized  # noqa: F401
from .table import BASE_OPS, IN_GRAPH, RECIPES, emittable, graph_op  # noqa: F401
