"""The score_mod contract (`score_mods.base.ScoreMod`) is all the library uses of a score_mod.

Read from fused_attn's source: no private attribute of another object is reached through
`getattr` / `hasattr` / `__dict__`, and what the library reads off a score_mod is a member that
ScoreMod declares (or, for traced mods, public TracedMod API). Run: a ScoreMod subclass that
implements only the abstract members works through the functional API and the module on the
reference backend, against the float64 reference."""

from __future__ import annotations

import ast
import os
from typing import Iterator, Set, Tuple

import pytest
import torch

from score_mods.base import ScoreMod
from score_mods.trace import TracedMod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the names the library gives a score_mod object where it reads one
MOD_NAMES = {"mod", "score_mod", "eager_mod", "template", "inner", "score_part", "bias_part"}


def _public_members(cls: type) -> Set[str]:
    return {n for c in cls.__mro__ if c is not object for n in vars(c) if not n.startswith("_")}


def _library_files() -> Iterator[Tuple[str, ast.AST]]:
    for folder, _, files in os.walk(os.path.join(ROOT, "fused_attn")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


def _is_mod(node: ast.AST) -> bool:
    """`mod`, `score_mod`, ... or `<anything>.score_mod` / `<anything>.mod`."""
    if isinstance(node, ast.Name):
        return node.id in MOD_NAMES
    return isinstance(node, ast.Attribute) and node.attr in {"mod", "score_mod"}


def test_no_private_attribute_is_reached_by_name():
    bad = []
    for path, tree in _library_files():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in {"getattr", "hasattr", "setattr"} and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                    bad.append(f"{path}:{node.lineno} {node.func.id}(..., {name!r})")
            if (isinstance(node, ast.Attribute) and node.attr == "__dict__"
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
    assert not bad, "private state reached by name:\n" + "\n".join(bad)


def test_what_the_library_reads_off_a_score_mod_is_declared():
    declared, traced = _public_members(ScoreMod), _public_members(TracedMod)
    bad = []
    for path, tree in _library_files():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_mod(node.value):
                if node.attr.startswith("_") or node.attr not in traced:
                    bad.append(f"{path}:{node.lineno} {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in {"getattr", "hasattr"} and len(node.args) >= 2 and _is_mod(node.args[0])
                  and isinstance(node.args[1], ast.Constant)):
                # a probe for a member: the contract declares every member, so none may be optional
                bad.append(f"{path}:{node.lineno} {ast.unparse(node)} (declared: {node.args[1].value in declared})")
    assert not bad, "undeclared score_mod members or probes:\n" + "\n".join(bad)


class _HalfScores(ScoreMod):
    """score / 2 written against the contract alone (no tracing)."""

    name = "half_scores"

    @property
    def cache_key(self):
        return ("half_scores",)

    def eager(self, score, b, h, q_idx, kv_idx, q_len, kv_len):
        return score * 0.5

    def lower_forward(self, graph, score, operands, memo):
        raise NotImplementedError("no cuDNN lowering in this test")


def test_the_declared_members_have_defaults_for_callback_mods():
    """Everything the library reads exists on a ScoreMod that implements only the abstract members."""
    mod = _HalfScores()
    assert mod.root is None and dict(mod.specs) == {} and mod.native_band is None
    assert mod.base_name == "half_scores" and dict(mod.bound_values) == {} and mod.private_copy() is mod
    assert mod.trainable() == {} and mod.split_additive_bias() == (mod, None)
    assert mod.compile_structure() is None and mod.scalar_tensor().shape == (0,)
    assert mod.backend_memo() is mod.backend_memo() and _HalfScores().backend_memo() is not mod.backend_memo()


@pytest.mark.parametrize("entry", ["functional", "module"])
def test_a_contract_only_mod_runs_and_matches_float64(entry):
    import fused_attn
    from fused_attn import testing

    g = torch.Generator().manual_seed(11)
    q, k, v, dout = (torch.randn(2, 3, 24, 16, generator=g, dtype=torch.float64) for _ in range(4))
    scale = 16 ** -0.5
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    if entry == "functional":
        out = fused_attn.dot_product_attention(*leaves, qkv_format="bhsd", score_mod=_HalfScores(),
                                               backend="reference")
    else:
        attn = fused_attn.DotProductAttention(3, 16, qkv_format="bhsd", score_mod=_HalfScores(),
                                              backend="reference")
        out = attn(*leaves)
    fn = lambda sc, b, h, qi, ki: sc * 0.5  # noqa: E731
    exact, _ = testing.reference_attention(q, k, v, scale, score_fn=fn)
    testing.assert_close(out.double(), exact, testing.tolerance(q, k, v, scale, torch.float32, score_fn=fn),
                         what="out")
    out.backward(dout.float())
    grads, bounds = testing.grad_tolerances(q, k, v, dout, scale, torch.float32, score_fn=fn)
    for what, leaf, g_exact, b in zip(("dq", "dk", "dv"), leaves, grads, bounds):
        testing.assert_close(leaf.grad.double(), g_exact, b, what=what)
