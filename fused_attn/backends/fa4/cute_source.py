"""A traced score_mod's DAG as the Python source of flash-attn-4's CuTe callables.

From one DAG (`score_mods.expr`) this module writes two functions in CuTe DSL:

    score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None)
        -> the modified scores (FA4's forward and the backward's recomputation)
    score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None)
        -> d loss / d score, from `score_mods.autodiff.grad_dag` (FA4's backward)

Arguments are FA4's: `score` the scaled fp32 scores (a TensorSSA of the kernel's vector size),
the four index vectors Int32 (positions within the sequence, as the reference's), `seqlen_info`
the sequence's lengths (q_len / kv_len), `aux_tensors` the mod's tensor parameters flattened to
1-D in the order `Source.tensors` names them, `aux_scalars` its float / int parameters in the
order `Source.scalars` names them (runtime values: a new value never recompiles).

Value kinds in the kernel: "f" fp32, "i" Int32, "b" Boolean. The reference's semantics are kept:
Python floor division and sign of remainder, NaN-propagating minimum / maximum, floor / ceil as
integral floats, a size-1 tensor dim indexed by a bare b or h broadcasting. What the CuTe form
cannot express exactly is refused (`Unsupported`) and runs on another engine.

No cutlass import here: the text is testable anywhere; `cute_load` turns it into callables.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from score_mods.autodiff import grad_dag
from score_mods.expr import Node, topo_order

__all__ = ["Source", "Unsupported", "TableLayout", "emit", "UNSUPPORTED_OPS"]

#: ops with no exact CuTe form here (they run on another engine)
UNSUPPORTED_OPS = ("lshift", "rshift", "bitnot")

_INDEX_ARG = {"b": "b_idx", "h": "h_idx", "q_idx": "q_idx", "kv_idx": "kv_idx"}
_LENGTH_FIELD = {"q_len": "seqlen_q", "kv_len": "seqlen_k"}
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_ARITH = {"add": "+", "sub": "-", "mul": "*"}
_MATH1 = {"exp": "exp", "log": "log", "sqrt": "sqrt", "erf": "erf"}
#: tanh in its hardware approximation (tanh.approx.f32, ~2^-11 relative), as FA4's own softcap:
#: the accurate form costs 1.5x the whole forward of a softcap call (H200); the approximation's
#: error is far inside the bf16 / fp16 bounds the GPU tests check against float64
_TANH = "cute.math.tanh({}, fastmath=True)"
_BITS = {"bitand": "&", "bitor": "|", "bitxor": "^"}
_LOGIC = {"and": "&", "or": "|", "xor": "^"}

#: A value of one kind (from, to) written as another: "f" Float32, "i" Int32, "b" bool; {} is its name.
_CONVERT = {
    ("i", "f"): "{}.to(cutlass.Float32)",
    ("b", "f"): "cute.where({}, cute.full_like(score, 1.0), cute.full_like(score, 0.0))",
    ("f", "i"): "{}.to(cutlass.Int32)",
    ("b", "i"): "cute.where({}, cute.full_like(q_idx, 1), cute.full_like(q_idx, 0))",
    ("f", "b"): "({} != cute.full_like(score, 0.0))",
    ("i", "b"): "({} != cute.full_like(q_idx, 0))",
}


class Unsupported(Exception):
    """The mod has no exact CuTe form here; the message says which part."""


@dataclass(frozen=True)
class TableLayout:
    """A tensor parameter as the kernel reads it: flattened, with its logical shape (strides of
    the contiguous 1-D copy follow from it) and its kind ("f" float, "i" integer, "b" bool)."""

    name: str
    shape: Tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class Source:
    """The generated module text, the order of aux tensors / scalars, and a structural hash."""

    text: str
    tensors: Tuple[str, ...]
    scalars: Tuple[str, ...]
    uses_aux_tensors: bool
    digest: str


def _float_text(value: float) -> str:
    if math.isinf(value):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(float(value))


class _Writer:
    """Emits one function body: one line per DAG node, each value named v<n> with its kind."""

    def __init__(self, tables: Dict[str, TableLayout], scalar_kinds: Dict[str, str], scalars: Sequence[str],
                 tensors: Sequence[str], has_grad: bool):
        self.tables, self.scalar_kinds = tables, scalar_kinds
        self.scalar_pos = {n: i for i, n in enumerate(scalars)}
        self.tensor_pos = {n: i for i, n in enumerate(tensors)}
        self.lines: List[str] = []
        self.names: Dict[Node, Tuple[str, str]] = {}
        self.has_grad = has_grad

    # -- helpers returning expressions of a given kind
    def _new(self, text: str, kind: str) -> Tuple[str, str]:
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = {text}")
        return name, kind

    def as_kind(self, value: Tuple[str, str], kind: str) -> str:
        """The expression of `value` (name, kind) as `kind`: "f" Float32, "i" Int32 or "b" bool."""
        name, have = value
        return name if have == kind else _CONVERT[have, kind].format(name)

    def f(self, value: Tuple[str, str]) -> str:
        return self.as_kind(value, "f")

    def i(self, value: Tuple[str, str]) -> str:
        return self.as_kind(value, "i")

    def b(self, value: Tuple[str, str]) -> str:
        return self.as_kind(value, "b")

    # -- the nodes
    def node(self, n: Node) -> Tuple[str, str]:
        args = [self.names[a] for a in n.args]
        op = n.op
        if op in UNSUPPORTED_OPS:
            raise Unsupported(f"op {op!r} has no exact CuTe form in this lowering")
        if op == "score":
            return "score", "f"
        if op == "grad":
            if not self.has_grad:
                raise Unsupported("the forward reads the gradient")
            return "grad", "f"
        if op == "index":
            return _INDEX_ARG[n.attr], "i"
        if op == "length":
            return self._new(f"cute.full_like(q_idx, seqlen_info.{_LENGTH_FIELD[n.attr]})", "i")
        if op == "const":
            if n.dtype == "i":
                if not -(2 ** 31) <= n.attr < 2 ** 31:
                    raise Unsupported(f"integer constant {n.attr} does not fit the kernel's int32")
                return self._new(f"cute.full_like(q_idx, {int(n.attr)})", "i")
            return self._new(f"cute.full_like(score, {_float_text(n.attr)})", "f")
        if op == "param":
            pos = self.scalar_pos[n.attr]
            if self.scalar_kinds.get(n.attr) == "i":
                return self._new(f"cute.full_like(q_idx, cutlass.Int32(aux_scalars[{pos}]))", "i")
            return self._new(f"cute.full_like(score, cutlass.Float32(aux_scalars[{pos}]))", "f")
        if op == "gather":
            return self._gather(n, args)
        return self._compute(n, args)

    def _gather(self, n: Node, args: List[Tuple[str, str]]) -> Tuple[str, str]:
        table = self.tables[n.attr]
        if len(args) != len(table.shape):
            raise Unsupported(f"tensor parameter {n.attr!r} has {len(table.shape)} dims, indexed with {len(args)}")
        terms, stride = [], 1
        strides = []
        for size in reversed(table.shape):
            strides.append(stride)
            stride *= size
        strides.reverse()
        if stride >= 2 ** 31:
            raise Unsupported(f"tensor parameter {n.attr!r} has {stride} elements, beyond int32 indexing")
        for arg_node, arg, size, st in zip(n.args, args, table.shape, strides):
            if size == 1 and arg_node.op == "index" and arg_node.attr in ("b", "h"):
                continue  # a size-1 dim indexed by a bare b / h broadcasts
            term = self.i(arg)
            terms.append(term if st == 1 else f"{term} * cute.full_like(q_idx, {st})")
        index = " + ".join(terms) if terms else "cute.full_like(q_idx, 0)"
        pos = self.tensor_pos[n.attr]
        at, _ = self._new(index, "i")
        self.lines.append(f"    {at}_frag = cute.make_rmem_tensor(1, cutlass.Int32)")
        self.lines.append(f"    {at}_frag.store({at})")
        self.lines.append(f"    {at}_val = cute.make_rmem_tensor(1, aux_tensors[{pos}].element_type)")
        self.lines.append(f"    {at}_val[0] = aux_tensors[{pos}][{at}_frag[0]]")
        loaded = f"{at}_val.load()"
        if table.kind == "f":
            return self._new(f"{loaded}.to(cutlass.Float32)", "f")
        if table.kind == "b":
            return self._new(f"({loaded}.to(cutlass.Int32) != cute.full_like(q_idx, 0))", "b")
        return self._new(f"{loaded}.to(cutlass.Int32)", "i")

    def _numeric_kind(self, n: Node, args: List[Tuple[str, str]]) -> str:
        """Integers stay Int32 only when every operand is one; else fp32 (integral floats)."""
        if n.dtype == "i" and all(k == "i" for _, k in args):
            return "i"
        return "f"

    def _compute(self, n: Node, args: List[Tuple[str, str]]) -> Tuple[str, str]:
        op = n.op
        if op in _ARITH:
            kind = self._numeric_kind(n, args)
            a, c = (self.as_kind(x, kind) for x in args)
            return self._new(f"{a} {_ARITH[op]} {c}", kind)
        if op == "div":
            divisor = n.args[1]
            if divisor.op == "const" and divisor.dtype == "f" and divisor.attr not in (0.0,) and \
                    math.isfinite(divisor.attr):
                return self._new(f"{self.f(args[0])} * cute.full_like(score, {_float_text(1.0 / divisor.attr)})", "f")
            if divisor.op == "param" and self.scalar_kinds.get(divisor.attr) != "i":
                # a runtime scalar divisor: one reciprocal, then a multiply per score (within 1 ulp)
                pos = self.scalar_pos[divisor.attr]
                inv = f"cute.full_like(score, cutlass.Float32(1.0) / cutlass.Float32(aux_scalars[{pos}]))"
                return self._new(f"{self.f(args[0])} * {inv}", "f")
            return self._new(f"{self.f(args[0])} / {self.f(args[1])}", "f")
        if op == "pow":
            base = n.args[0]
            if base.op != "const" or not base.attr > 0:
                raise Unsupported("pow with a base that is not a positive constant has no exact CuTe form here")
            return self._new(f"cute.math.exp({self.f(args[1])} * cute.full_like(score, {math.log(base.attr)!r}))", "f")
        if op == "reciprocal":
            return self._new(f"cute.full_like(score, 1.0) / {self.f(args[0])}", "f")
        if op in ("floordiv", "mod"):
            kind = self._numeric_kind(n, args)
            a, c = (self.as_kind(x, kind) for x in args)
            quotient = f"({a} // {c})" if kind == "i" else f"cute.math.floor({a} / {c})"
            if op == "floordiv":
                return self._new(quotient, kind)
            return self._new(f"{a} - {quotient} * {c}", kind)  # the sign of the divisor, as Python
        if op == "neg":
            kind = "i" if args[0][1] == "i" else "f"
            return self._new(f"-{self.as_kind(args[0], kind)}", kind)
        if op == "abs":
            kind = "i" if args[0][1] == "i" else "f"
            x = self.as_kind(args[0], kind)
            zero = "cute.full_like(q_idx, 0)" if kind == "i" else "cute.full_like(score, 0.0)"
            return self._new(f"cute.where({x} < {zero}, -{x}, {x})", kind)
        if op in ("minimum", "maximum"):
            kind = self._numeric_kind(n, args)
            a, c = (self.as_kind(x, kind) for x in args)
            pick = f"cute.where({a} {'<' if op == 'minimum' else '>'} {c}, {a}, {c})"
            if kind == "f":  # NaN in either operand gives NaN, as torch.minimum / maximum
                pick = f"cute.where({a} != {a}, {a}, cute.where({c} != {c}, {c}, {pick}))"
            return self._new(pick, kind)
        if op in ("floor", "ceil"):
            if args[0][1] == "i":
                return args[0]
            return self._new(f"cute.math.{op}({self.f(args[0])})", "f")
        if op == "tanh":
            return self._new(_TANH.format(self.f(args[0])), "f")
        if op in _MATH1:
            return self._new(f"cute.math.{_MATH1[op]}({self.f(args[0])})", "f")
        if op == "sigmoid":
            x = self.f(args[0])
            return self._new(f"cute.full_like(score, 1.0) / (cute.full_like(score, 1.0) + cute.math.exp(-{x}))", "f")
        if op == "tanh_bwd":
            g, x = self.f(args[0]), self.f(args[1])
            t, _ = self._new(_TANH.format(x), "f")
            return self._new(f"{g} * (cute.full_like(score, 1.0) - {t} * {t})", "f")
        if op == "sigmoid_bwd":
            g, x = self.f(args[0]), self.f(args[1])
            s, _ = self._new(f"cute.full_like(score, 1.0) / (cute.full_like(score, 1.0) + cute.math.exp(-{x}))", "f")
            return self._new(f"{g} * {s} * (cute.full_like(score, 1.0) - {s})", "f")
        if op in _BITS:
            a, c = (self.i(x) for x in args)
            return self._new(f"{a} {_BITS[op]} {c}", "i")
        if op in _CMP:
            kind = "i" if all(k == "i" for _, k in args) else "f"
            a, c = (self.as_kind(x, kind) for x in args)
            return self._new(f"({a} {_CMP[op]} {c})", "b")
        if op in _LOGIC:
            a, c = (self.b(x) for x in args)
            return self._new(f"({a} {_LOGIC[op]} {c})", "b")
        if op == "not":
            c = self.b(args[0])
            return self._new(f"(cute.where({c}, cute.full_like(q_idx, 0), cute.full_like(q_idx, 1)) != "
                             "cute.full_like(q_idx, 0))", "b")
        if op == "where":
            kind = n.dtype if n.dtype in ("f", "i", "b") else "f"
            if kind == "i" and not all(k == "i" for _, k in args[1:]):
                kind = "f"
            c = self.b(args[0])
            x, y = (self.as_kind(v, kind) for v in args[1:])
            return self._new(f"cute.where({c}, {x}, {y})", kind)
        raise Unsupported(f"op {op!r} has no CuTe form in this lowering")

    def body(self, root: Node) -> List[str]:
        for n in topo_order(root):
            self.names[n] = self.node(n)
        result = self.f(self.names[root])
        return self.lines + [f"    return {result}"]


def _scalar_kinds(specs: Dict[str, object]) -> Dict[str, str]:
    return {name: ("i" if getattr(spec, "kind", "float") == "int" else "f") for name, spec in specs.items()}


def emit(root: Node, tables: Sequence[TableLayout], scalars: Sequence[str], specs: Dict[str, object],
         name: str = "score_mod") -> Source:
    """The module text for a mod with DAG `root`, tensor parameters `tables` (the gathers' names,
    shapes and kinds) and scalar parameters `scalars` (names, in aux_scalars order).
    Raises Unsupported when some op has no exact CuTe form."""
    table_map = {t.name: t for t in tables}
    tensors = tuple(t.name for t in tables)
    kinds = _scalar_kinds(specs)
    forward = _Writer(table_map, kinds, scalars, tensors, has_grad=False).body(root)
    backward_root = grad_dag(root)
    backward = _Writer(table_map, kinds, scalars, tensors, has_grad=True).body(backward_root)
    uses_aux = bool(tables)
    header = [
        f'"""CuTe score_mod callables generated from the score_mod {name!r} (fused_attn)."""',
        "import cutlass",
        "import cutlass.cute as cute",
        "",
        "",
        "@cute.jit",
        "def score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):",
    ]
    middle = ["", "", "@cute.jit",
              "def score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars=None):"]
    text = "\n".join(header + forward + middle + backward) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    return Source(text=text, tensors=tensors, scalars=tuple(scalars), uses_aux_tensors=uses_aux, digest=digest)


def tables_of(root: Node, tensors: Dict[str, "object"]) -> Tuple[TableLayout, ...]:
    """The TableLayouts of the tensor parameters a DAG gathers from (`tensors`: name -> tensor
    or anything with .shape and .dtype), in name order."""
    import torch

    names = sorted({n.attr for n in topo_order(root) if n.op == "gather"})
    out = []
    for name in names:
        t = tensors[name]
        kind = "b" if t.dtype == torch.bool else ("f" if t.dtype.is_floating_point else "i")
        out.append(TableLayout(name, tuple(int(s) for s in t.shape), kind))
    return tuple(out)


def params_of(root: Node) -> Tuple[str, ...]:
    """The scalar parameter names a DAG reads (forward and backward), sorted: the aux_scalars order."""
    return tuple(sorted({n.attr for n in topo_order(root) if n.op == "param"}))


def source_for(mod: object) -> Optional[Source]:
    """The Source of a traced mod (`root`, `specs`, `tensors()`), or None for other mods."""
    root = mod.root
    if root is None:
        return None
    tensors = mod.tensors()
    return emit(root, tables_of(root, tensors), params_of(root), mod.specs, mod.base_name)
