"""The score_mod expression language: symbolic values traced into a hash-consed DAG.

A traced function receives `Sym` objects for (score, b, h, q_idx, kv_idx) and its scalar
parameters, and `TensorSym` objects for tensor parameters. Operators and the math namespace
(namespace.py) build `Node`s. Nodes compare and hash by structure (constants by their exact bits, so
-0.0 and +0.0 differ), so the same subexpression is one node and the DAG serializes into a
structural cache key.

Kinds (`Node.dtype`): "f" float, "i" integer, "b" condition. Index arguments, lengths, int
constants and int parameters are integers; `+ - * // % min max abs` keep integers integer,
`/` and the transcendental functions give floats, `floor` / `ceil` give integers.

Node ops (see optable.py for their semantics):
    leaves   score, grad (d loss / d out, backward only), index(axis), length(q_len|kv_len),
             const(value), param(name), gather(*indices; attr=tensor name)
    numbers  add sub mul div floordiv mod pow neg abs minimum maximum floor ceil
             exp log tanh sqrt sigmoid erf  bitand bitor bitxor lshift rshift bitnot
             where(c, x, y)  tanh_bwd(g, x) sigmoid_bwd(g, x)   (the last two: autodiff only)
    bool     lt le gt ge eq ne  and or xor not

Modules: dag (Node and the walks over it), symbols (Sym, TensorSym and the operator rules),
namespace (the math functions, q_len / kv_len, TensorParam), hints (spellings for errors).
This package re-exports their names.
"""

from __future__ import annotations

from ..optable import BOOL_OPS, CMP_OPS, SYMBOL, fold  # noqa: F401 - re-exported
from .dag import (  # noqa: F401 - re-exported
    INDEX_AXES, LENGTHS, Node, Reads, const, direct_axes, exact, leaves, reads, show, structure_key, substitute,
    topo_order, topo_tuple, what,
)
from .hints import TORCH_TO_SM  # noqa: F401 - re-exported
from .namespace import (  # noqa: F401 - re-exported
    TENSOR_KINDS, TensorParam, _TraceScope, abs, ceil, clamp, erf, exp, floor, kv_len, log,
    logical_and, logical_not, logical_or, logical_xor, maximum, minimum, pow, q_len, sigmoid, sqrt, tanh, tracing,
    where,
)
from .symbols import (  # noqa: F401 - re-exported
    Sym, TensorSym, Value, arith, bitwise, compare, invert, lift, unary,
)
