"""Regression tests for cache-key and parameter defects found by probing main, and for the small
pictures and names of mods.

Keys: -0.0 / +0.0 constants; a redefined raw callback (notebook re-run); NaN user keys;
Transformer Engine's score_mod_graph_cache_key() protocol; bound methods keyed to the live
object (weakref tokens, release listeners); bprop tensors without a bprop; bounded memos.
"""

import dataclasses
import gc
import math
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import score_mods as sm
from score_mods import keys, lower_cudnn


# --------------------------------------------------------------------------- constants by exact bits

def test_signed_zero_constants_have_their_own_keys_and_lowerings():
    pos = sm.score_mod(lambda score, b, h, q_idx, kv_idx: 1.0 / (score * 0.0 + 0.0))
    neg = sm.score_mod(lambda score, b, h, q_idx, kv_idx: 1.0 / (score * 0.0 + -0.0))
    assert pos.cache_key != neg.cache_key and pos.root != neg.root
    assert lower_cudnn.plan_for(pos.root) is not lower_cudnn.plan_for(neg.root)
    signs = {math.copysign(1.0, t.item()) for t in neg.cudnn_operands().values()}
    assert -1.0 in signs  # the -0.0 mod binds -0.0, not the +0.0 of a shared graph
    s = torch.full((1, 1, 1, 1), -2.0, dtype=torch.float64)
    idx = (torch.zeros(1, 1, 1, 1, dtype=torch.int64),) * 4
    assert pos.eager(s, *idx, 1, 1).item() == math.inf    # -2 * 0.0 = -0.0; -0.0 + 0.0 = +0.0; 1 / +0.0
    assert neg.eager(s, *idx, 1, 1).item() == -math.inf   # -0.0 + -0.0 = -0.0; 1 / -0.0
    with pytest.raises(ValueError, match="must not be NaN"):
        sm.score_mod(lambda score, b, h, q_idx, kv_idx: score + math.nan)


# --------------------------------------------------------------------------- raw callbacks follow their code

def _module(name, source):
    mod = types.ModuleType(name)
    exec(textwrap.dedent(source), mod.__dict__)  # noqa: S102 - test fixture
    sys.modules[name] = mod
    return mod


def test_a_redefined_callback_gets_a_new_key():
    v1 = _module("nb_cell", """
        def fprop(graph, score, tensors):
            return graph.mul(score, tensors["s"])
    """)
    key1 = sm.raw_callback(v1.fprop).cache_key
    v2 = _module("nb_cell", """
        def fprop(graph, score, tensors):
            return graph.add(score, tensors["s"])
    """)
    key2 = sm.raw_callback(v2.fprop).cache_key
    v3 = _module("nb_cell", """
        def fprop(graph, score, tensors):
            return graph.mul(score, tensors["s"])
    """)
    assert key1 != key2 and key1 == sm.raw_callback(v3.fprop).cache_key  # same code, same key


def test_code_digest_covers_constants_defaults_closures_and_helpers():
    def make(c, default=1.0):
        def inner(graph, score, tensors, scale=default):
            def nested():
                return c * 2.5
            return nested
        return inner

    digest = keys.code_digest
    assert digest(make(2)) == digest(make(2))
    assert digest(make(2)) != digest(make(3))                  # closure cell value
    assert digest(make(2)) != digest(make(2, default=2.0))     # default
    a = _module("helpers_a", """
        def helper(x):
            return x + 1
        def fprop(graph, score, tensors):
            return helper(score)
    """)
    da = digest(a.fprop)
    b = _module("helpers_a", """
        def helper(x):
            return x + 2
        def fprop(graph, score, tensors):
            return helper(score)
    """)
    assert digest(b.fprop) != da                                # a module helper it calls changed
    n1 = _module("consts", "def f(g, s, t):\n    return (lambda: 0.5)")
    n2 = _module("consts", "def f(g, s, t):\n    return (lambda: 0.25)")
    assert digest(n1.f) != digest(n2.f)                         # constants of nested code objects


@pytest.mark.slow  # fresh interpreters
def test_code_digest_is_stable_across_processes(tmp_path):
    (tmp_path / "cb_mod.py").write_text("def fprop(graph, score, tensors):\n    return graph.mul(score, tensors['s'])\n")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import cb_mod; from score_mods.keys import code_digest; print(code_digest(cb_mod.fprop))"
    runs = {subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}, cwd=".").stdout.strip()
            for seed in (1, 2)}
    assert len(runs) == 1 and len(runs.pop()) == 32


def test_unkeyable_closures_and_callables_need_cache_key():
    t = torch.ones(1)
    with pytest.raises(TypeError, match="closure variable 't' .* holds a Tensor .* pass cache_key="):
        sm.raw_callback(lambda g, s, ts: g.mul(s, t))
    assert sm.raw_callback(lambda g, s, ts: g.mul(s, t), cache_key="scaled-v1").cache_key[1] == "scaled-v1"
    with pytest.raises(TypeError, match="pass cache_key="):
        sm.raw_callback(print)


# --------------------------------------------------------------------------- user keys

@dataclasses.dataclass(frozen=True)
class _Key:
    name: str
    scale: float


@pytest.mark.parametrize("key", [math.nan, ("softcap", math.nan), frozenset({1.0, math.nan}), _Key("x", math.nan),
                                 ("nested", (1, complex(0, math.nan)))])
def test_nan_cache_keys_are_refused(key):
    def fprop(g, s, t):
        return s

    with pytest.raises(ValueError, match="NaN|equal to itself"):
        sm.raw_callback(fprop, cache_key=key)


def test_cache_keys_must_be_hashable():
    with pytest.raises(TypeError, match="cache_key must be hashable"):
        sm.raw_callback(lambda g, s, t: s, cache_key=["x"])
    assert sm.raw_callback(lambda g, s, t: s, cache_key=_Key("x", 1.0)).cache_key[1] == _Key("x", 1.0)


# --------------------------------------------------------------------------- Transformer Engine's protocol

class TESoftcap:
    def __init__(self, layers):
        self.layers = layers

    def score_mod_graph_cache_key(self):
        return {"kind": "softcap", "layers": list(self.layers)}

    def forward(self, graph, score, tensors):
        return graph.tanh(score)

    def backward(self, graph, dscore, tensors):
        return dscore


def test_te_protocol_keys_by_the_method_result_and_qualname():
    a, b = TESoftcap([1, 2]), TESoftcap([1, 2])
    ka = sm.raw_callback(a.forward, bprop=a.backward).cache_key
    assert ka == sm.raw_callback(b.forward, bprop=b.backward).cache_key  # objects differ, topology does not
    assert ka != sm.raw_callback(TESoftcap([3]).forward, bprop=a.backward).cache_key
    assert ka != sm.raw_callback(a.backward, bprop=a.backward).cache_key  # the method's name is in the key
    fkey = ka[1][0]
    assert fkey[0] == "te" and fkey[1][1] == "TESoftcap.forward"
    assert fkey[2] == (("kind", "softcap"), ("layers", (1, 2)))
    assert sm.raw_callback(a.forward).object_tokens == ()

    class WithTensor(TESoftcap):
        def score_mod_graph_cache_key(self):
            return ("x", torch.ones(1))

    with pytest.raises(TypeError, match="must not include tensors"):
        sm.raw_callback(WithTensor([]).forward)

    class WithNan(TESoftcap):
        def score_mod_graph_cache_key(self):
            return {"cap": math.nan}

    with pytest.raises(ValueError, match="NaN"):
        sm.raw_callback(WithNan([]).forward)


# --------------------------------------------------------------------------- bound methods: live-object tokens

class Plain:
    def forward(self, graph, score, tensors):
        return score


@pytest.mark.slow
def test_bound_methods_are_keyed_to_the_live_object_and_released():
    released = []
    sm.add_release_listener(released.append)
    try:
        a, b = Plain(), Plain()
        ka = sm.raw_callback(a.forward).cache_key
        assert ka == sm.raw_callback(a.forward).cache_key
        assert ka != sm.raw_callback(b.forward).cache_key
        mod = sm.raw_callback(a.forward)
        (token,) = mod.object_tokens
        assert ka[1][0][:2] == ("bound", token)
        del mod, a
        gc.collect()
        assert token in released
        seen = set()
        for _ in range(50):  # new objects, possibly at the freed addresses: never an old key
            c = Plain()
            kc = sm.raw_callback(c.forward).cache_key
            assert kc != ka and kc not in seen
            seen.add(kc)
            del c
            gc.collect()
    finally:
        sm.remove_release_listener(released.append)
    assert keys.live_tokens() < 10  # the registry holds only live objects


def test_objects_without_weakrefs_need_cache_key():
    class Slotted:
        __slots__ = ()

        def forward(self, graph, score, tensors):
            return score

    with pytest.raises(TypeError, match="does not support weak references; pass cache_key="):
        sm.raw_callback(Slotted().forward)


# --------------------------------------------------------------------------- raw arguments

def _fprop(graph, score, tensors):
    return score


def test_bprop_tensors_without_bprop_is_a_value_error():
    with pytest.raises(ValueError, match="score_mod_bprop_tensors .* without score_mod_bprop"):
        sm.raw_callback(_fprop, bprop_tensors={"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="without score_mod_bprop"):
        sm.as_score_mod(_fprop, bprop_tensors={"s": torch.tensor(1.0)})


def test_module_level_memos_are_bounded():
    for fn in (lower_cudnn.plan_for, lower_cudnn.is_scalar, lower_cudnn.is_derived):
        assert fn.cache_info().maxsize is not None
    from score_mods import materialization

    assert materialization.MAX_ENTRIES > 0 and materialization.MAX_BYTES > 0


# --------------------------------------------------------------------------- pictures and names

def test_describe_pictures():
    assert sm.causal().describe(4, 4) == "\n".join([
        "causal (4x4): x attend, . masked",
        "x . . .",
        "x x . .",
        "x x x .",
        "x x x x",
    ])
    assert sm.sliding_window(2, 0).describe(5, 6) == "\n".join([
        "sliding_window_2_0 (5x6): x attend, . masked",
        "x . . . . .",
        "x x . . . .",
        "x x x . . .",
        ". x x x . .",
        ". . x x x .",
    ])
    assert sm.causal_bottom_right().describe(2, 4) == "\n".join([
        "causal_bottom_right (2x4): x attend, . masked",
        "x x x .",
        "x x x x",
    ])
    assert sm.alibi(torch.tensor([0.5, 1.0])).describe(3, 3, h=1) == "\n".join([
        "alibi (3x3, h=1): values at score=0, . masked",
        " 0  1  2",
        "-1  0  1",
        "-2 -1  0",
    ])
    assert sm.compose(sm.alibi(torch.tensor([0.5])), sm.causal()).describe(2, 2) == "\n".join([
        "compose(alibi, causal) (2x2, h=0): values at score=0, . masked",
        "   0    .",
        "-0.5    0",
    ])


def test_visualize_needs_matplotlib_or_draws(tmp_path, monkeypatch):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs matplotlib \\(pip install matplotlib\\); describe\\(\\)"):
            sm.causal().visualize(4, 4, path=str(tmp_path / "c.png"))
        return
    out = sm.causal().visualize(4, 4, path=str(tmp_path / "c.png"))
    assert out.dtype == torch.bool and torch.equal(out, torch.ones(4, 4, dtype=torch.bool).tril())
    assert (tmp_path / "c.png").stat().st_size > 0


def test_names_carry_values_but_never_keys():
    assert sm.softcap(30.0).name == "softcap_30" and sm.softcap(2.5).name == "softcap_2.5"
    assert sm.softcap(30.0).bind(cap=50.0).name == "softcap_50"
    assert sm.softcap(30.0).base_name == "softcap"
    assert sm.sliding_window(128, 0).name == "sliding_window_128_0"
    assert sm.sliding_window(-1, 4).name == "sliding_window_-1_4"
    assert sm.sliding_window(8, 0, bottom_right=True).name == "sliding_window_8_0_bottom_right"
    assert sm.sliding_window(128, 0).cache_key == sm.sliding_window(64, 0).cache_key
    assert sm.softcap(30.0).cache_key == sm.softcap(50.0).cache_key
    assert sm.compose(sm.softcap(30.0), sm.causal()).name == "compose(softcap_30, causal)"


def test_take_values_keeps_the_native_band_in_step():
    held = sm.sliding_window(2, 0).private_copy()
    assert held.take_values(sm.sliding_window(5, 0))
    assert held.native_band == (5, 0, False) and held.scalars() == {"left": 5.0, "right": 0.0}
    assert held.name == "sliding_window_5_0"
