"""The integer / rounding / bitwise part of the score_mod language: eager semantics equal Python's
(negative operands included), Python-number folding never raises, kinds, mask_mod and
and_masks / or_masks, and decoration-time errors for what stays outside the language."""

import math

import pytest
import torch

import score_mods as sm
from fused_attn.testing import agreement_bound, assert_close
from score_mods import expr
from score_mods.lower_cudnn import eval_scalar

S = 9  # q_idx - kv_idx spans -8 .. 8
Q = torch.arange(S).view(1, 1, S, 1)
K = torch.arange(S).view(1, 1, 1, S)
IDX = (torch.zeros(1, 1, 1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, 1, dtype=torch.int64), Q, K)

# Written once with operators and sm.* functions: on Python ints these are Python itself (sm.*
# fold on numbers), on symbols they trace. The score_mod adds f(q_idx - kv_idx) to the score.
CASES = {
    "floordiv": lambda d: d // 3,
    "floordiv_neg": lambda d: d // -3,
    "rfloordiv": lambda d: 17 // (d * d + 1),
    "mod": lambda d: d % 3,
    "mod_neg": lambda d: d % -3,
    "rmod": lambda d: -17 % (d * d + 1),
    "divmod": lambda d: divmod(d, 4)[0] * 10 + divmod(d, 4)[1],
    "and": lambda d: d & 5,
    "or": lambda d: d | 5,
    "xor": lambda d: d ^ -6,
    "invert": lambda d: ~d,
    "lshift": lambda d: d << 2,
    "rshift": lambda d: d >> 1,
    "rlshift": lambda d: 1 << abs(d),
    "abs": lambda d: abs(d),
    "clamp": lambda d: sm.clamp(d, -2, 3),
    "clamp_min_only": lambda d: sm.clamp(d, min=-1),
    "minimum": lambda d: sm.minimum(d, 1) + sm.maximum(d, -1),
    "floor_div2": lambda d: sm.floor(d / 2),
    "ceil_div2": lambda d: sm.ceil(d / 2),
    "floor_float": lambda d: sm.floor(d * 0.7 - 0.2),
    "float_floordiv": lambda d: (d * 0.5) // 1.5,
    "float_mod": lambda d: (d * 0.5) % -1.5,
    "square": lambda d: d ** 2,
    "pow2": lambda d: sm.pow(2, d),
    "pow_half": lambda d: sm.pow(d * d + 1, 0.5),
    "erf": lambda d: sm.erf(d / 3),
    "morton_bits": lambda d: ((d & 0x55) | ((d & 0x55) >> 1)) & 0x33,
    "where_int": lambda d: sm.where(d < 0, -d, d * 2) // 3,
}


#: cases whose value comes from a math library function (pow with a fractional exponent, erf):
#: torch's vectorized kernels and Python's libm may differ in the last bit, so these compare to a
#: few ulps; every integer, rounding and bitwise case is compared exactly
_LIBM_CASES = frozenset({"pow_half", "erf"})


def _python_grid(f):
    return torch.tensor([[float(f(i - j)) for j in range(S)] for i in range(S)], dtype=torch.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_eager_equals_python_semantics(case):
    f = CASES[case]

    @sm.score_mod
    def mod(score, b, h, q_idx, kv_idx):
        return score + f(q_idx - kv_idx)

    s = torch.randn(1, 1, S, S, dtype=torch.float64)
    got = mod.eager(s, *IDX, S, S)
    want = s[0, 0] + _python_grid(f)
    if case in _LIBM_CASES:  # neither torch's nor C's pow / erf is correctly rounded: float64 agreement
        assert_close(got[0, 0], want, agreement_bound(want), case)
    else:
        assert torch.equal(got[0, 0], want), (got[0, 0] - want).abs().max()


def test_int_params_and_host_folds_follow_python():
    @sm.score_mod
    def mod(score, b, h, q_idx, kv_idx, w=3, x=2.5):
        d = q_idx - kv_idx
        return score + d // w + d % w + (w // 2) * x + (w & 1)

    s = torch.zeros(1, 1, S, S, dtype=torch.float64)
    for w in (3, -3, 4):
        m = mod(w=w)
        want = _python_grid(lambda d: d // w + d % w + (w // 2) * 2.5 + (w & 1))
        assert torch.equal(m.eager(s, *IDX, S, S)[0, 0], want)
    assert mod.specs["w"].kind == "int" and mod(w=4.0).scalars_typed()["w"] == 4
    with pytest.raises(TypeError, match="'w' is an int parameter, got 2.5"):
        mod(w=2.5)
    # host folds (pass-by-value scalars) use Python semantics, never raising for float math
    n = expr.arith("floordiv", sm.exp(sm.log(expr.Sym(expr.Node("param", attr="x")))), 0.0).node
    assert eval_scalar(n, {"x": 2.0}) == math.inf


def test_python_number_folding_never_raises():
    assert sm.exp(1000.0) == math.inf and sm.log(0.0) == -math.inf
    assert math.isnan(sm.log(-1.0)) and math.isnan(sm.sqrt(-1.0))
    assert sm.pow(0.0, -1.0) == math.inf and math.isnan(sm.pow(-8.0, 1 / 3))
    assert sm.pow(2, 10) == 1024 and isinstance(sm.pow(2, 10), int) and sm.pow(2, -1) == 0.5
    assert sm.floor(2.5) == 2 and isinstance(sm.floor(2.5), int) and sm.floor(-2.5) == -3 and sm.ceil(-2.5) == -2
    assert sm.floor(math.inf) == math.inf and math.isnan(sm.ceil(math.nan))
    assert sm.erf(0.5) == math.erf(0.5) and sm.sigmoid(-1000.0) == 0.0 and sm.sigmoid(1000.0) == 1.0
    assert math.isnan(sm.minimum(math.nan, 1.0)) and sm.clamp(5, 0, 3) == 3
    assert expr.fold("floordiv", 7, 0) == math.inf and math.isnan(expr.fold("mod", 7, 0))
    assert expr.fold("floordiv", -7, 2) == -4 and expr.fold("mod", -7, 2) == 1


def test_kinds():
    seen = {}

    @sm.score_mod
    def mod(score, b, h, q_idx, kv_idx, w=2, x=1.0, t=sm.TensorParam(), ids=sm.TensorParam("int"),
            flag=sm.TensorParam("bool")):
        seen.update(
            idx=q_idx.node.dtype, add=(q_idx + 1).node.dtype, div=(q_idx / 2).node.dtype,
            fdiv=(q_idx // w).node.dtype, fx=(q_idx * x).node.dtype, floor=sm.floor(score).node.dtype,
            floor_int=sm.floor(q_idx) is q_idx, gather=t[h].node.dtype, ids=ids[q_idx].node.dtype,
            flag=flag[kv_idx].node.dtype, pow_int=(q_idx ** 2).node.dtype, pow_neg=(q_idx ** -1).node.dtype,
            length=sm.q_len().node.dtype, where=sm.where(q_idx < 1, q_idx, 0).node.dtype,
        )
        return score

    assert seen == dict(idx="i", add="i", div="f", fdiv="i", fx="f", floor="i", floor_int=True, gather="f",
                        ids="i", flag="b", pow_int="i", pow_neg="f", length="i", where="i")


def _ref_mask(fn, sq=S, skv=S):
    return torch.tensor([[bool(fn(i, j)) for j in range(skv)] for i in range(sq)])


def _mask_of(mod, sq=S, skv=S):
    s = torch.zeros(1, 1, sq, skv, dtype=torch.float64)
    idx = (IDX[0], IDX[1], torch.arange(sq).view(1, 1, -1, 1), torch.arange(skv).view(1, 1, 1, -1))
    return torch.isfinite(mod.eager(s, *idx, sq, skv))[0, 0]


def test_mask_mod_and_combinators():
    @sm.mask_mod
    def dilated(b, h, q_idx, kv_idx, w=4, d=2):
        diff = (q_idx - kv_idx).abs()
        return (diff <= w) & (diff % d == 0)

    assert torch.equal(_mask_of(dilated), _ref_mask(lambda i, j: abs(i - j) <= 4 and abs(i - j) % 2 == 0))
    assert torch.equal(_mask_of(dilated(w=2, d=3)), _ref_mask(lambda i, j: abs(i - j) <= 2 and abs(i - j) % 3 == 0))

    def prefix(b, h, q_idx, kv_idx):  # a plain flex-style mask_mod function
        return kv_idx < 3

    plm = sm.or_masks(prefix, sm.causal())
    assert torch.equal(_mask_of(plm), _ref_mask(lambda i, j: j < 3 or j <= i))
    both = sm.and_masks(dilated, sm.causal())
    assert both.scalars() == {"m0_w": 4.0, "m0_d": 2.0}
    assert torch.equal(_mask_of(both.bind(m0_w=6)), _ref_mask(lambda i, j: abs(i - j) <= 6 and abs(i - j) % 2 == 0 and j <= i))
    assert both.name == "and_masks(dilated, causal)"
    win = sm.and_masks(sm.sliding_window(2, 1))  # one argument: that mask
    assert win.mask_condition() is not None

    @sm.mask_mod
    def xor_eq(b, h, q_idx, kv_idx):
        return ((q_idx < 4) != (kv_idx < 4)) | ((q_idx % 2 == 0) == (kv_idx % 2 == 1))

    assert torch.equal(_mask_of(xor_eq), _ref_mask(lambda i, j: ((i < 4) != (j < 4)) or ((i % 2 == 0) == (j % 2 == 1))))

    with pytest.raises(TypeError, match="argument 1 .* is not a mask"):
        sm.and_masks(sm.causal(), sm.softcap(2.0))
    with pytest.raises(ValueError, match="at least one mask"):
        sm.or_masks()
    with pytest.raises(TypeError, match="must return a condition"):
        @sm.mask_mod
        def not_a_condition(b, h, q_idx, kv_idx):
            return q_idx - kv_idx
    with pytest.raises(TypeError, match="takes \\(b, h, q_idx, kv_idx, \\*\\*params\\): no score"):
        @sm.mask_mod
        def wrong_signature(score, b, h, q_idx, kv_idx):
            return q_idx < kv_idx


def test_tensor_gathers_at_computed_indices():
    @sm.score_mod
    def graphormer(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), dist=sm.TensorParam("int")):
        return score + table[h, dist[b, q_idx, kv_idx]]

    @sm.mask_mod
    def shared_offsets(b, h, q_idx, kv_idx, doc=sm.TensorParam("int"), offsets=sm.TensorParam("int"),
                       is_global=sm.TensorParam("bool")):
        start = offsets[doc[q_idx]]
        return ((kv_idx >= start) & (kv_idx <= q_idx)) | is_global[kv_idx]

    @sm.score_mod
    def chained(score, b, h, q_idx, kv_idx, intervals=sm.TensorParam("int")):
        row = intervals[kv_idx // 3]  # a row of a 2-D table, indexed further
        return sm.where((q_idx >= row[0]) & (q_idx < row[1]), score, -math.inf)

    g = torch.Generator().manual_seed(0)
    table = torch.randn(2, 5, generator=g, dtype=torch.float64)
    dist = torch.randint(0, 5, (1, S, S), generator=g)
    s = torch.randn(1, 2, S, S, dtype=torch.float64)
    idx = (IDX[0], torch.arange(2).view(1, 2, 1, 1), Q, K)
    want = s + table[torch.arange(2).view(2, 1, 1), dist[0]].unsqueeze(0)
    assert torch.equal(graphormer(table=table, dist=dist).eager(s, *idx, S, S), want)

    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    offsets = torch.tensor([0, 3, 5, 9])
    glob = torch.zeros(S, dtype=torch.bool)
    glob[0] = True
    m = shared_offsets(doc=doc, offsets=offsets, is_global=glob)
    assert torch.equal(_mask_of(m), _ref_mask(lambda i, j: (offsets[doc[i]] <= j <= i) or bool(glob[j])))

    intervals = torch.tensor([[0, 4], [2, 9], [5, 7]])
    assert torch.equal(_mask_of(chained(intervals=intervals)),
                       _ref_mask(lambda i, j: intervals[j // 3][0] <= i < intervals[j // 3][1]))
    with pytest.raises(ValueError, match="'dist' is indexed by 3 indices .* must have 3 dims, got shape \\(9, 9\\)"):
        graphormer(table=table, dist=dist[0])
    with pytest.raises(TypeError, match="'is_global' must have a torch.bool dtype"):
        shared_offsets(is_global=torch.zeros(S))


def test_scalar_conditions_fold_on_the_host():
    @sm.score_mod
    def signed(score, b, h, q_idx, kv_idx, cap=1.0):
        return sm.where(cap > 0, score, -score) + sm.where((cap > 2) & (q_idx < 2), 1.0, 0.0)

    s = torch.randn(1, 1, S, S, dtype=torch.float64)
    torch.testing.assert_close(signed(cap=1.0).eager(s, *IDX, S, S), s)
    torch.testing.assert_close(signed(cap=-1.0).eager(s, *IDX, S, S), -s)
    torch.testing.assert_close(signed(cap=3.0).eager(s, *IDX, S, S), s + (Q < 2).double())
    flex = signed(cap=-1.0).to_flex()
    assert flex(torch.tensor(2.0, dtype=torch.float64), torch.tensor(0), torch.tensor(0), torch.tensor(1),
                torch.tensor(1)).item() == -2.0


def _trace(body):
    @sm.score_mod
    def mod(score, b, h, q_idx, kv_idx, table=sm.TensorParam(), cap=1.0):
        return body(score, b, h, q_idx, kv_idx, table, cap)

    return mod


ERRORS = [
    ("cond & int", lambda s, b, h, q, k, t, c: sm.where((q < 3) & q, s, 0.0),
     TypeError, r"`&` mixes the condition \(q_idx < 3\) with the integer q_idx"),
    ("bit op on float", lambda s, b, h, q, k, t, c: s + (s & 1), TypeError, r"bitwise `&` needs integers, got the float value score"),
    ("shift of float param", lambda s, b, h, q, k, t, c: s + (q << c), TypeError, r"bitwise `<<` needs integers, got the float value cap"),
    ("invert float", lambda s, b, h, q, k, t, c: ~s, TypeError, r"`~` needs a condition or an integer"),
    ("float index", lambda s, b, h, q, k, t, c: s + t[q / 2], TypeError, r"index 0 of tensor parameter 'table' is the float value \(q_idx / 2\); indices must be integers"),
    ("condition index", lambda s, b, h, q, k, t, c: s + t[q < 2], TypeError, r"indices must be integers"),
    ("slice index", lambda s, b, h, q, k, t, c: s + t[:, q], TypeError, r"only integer expressions can index"),
    ("cond == number", lambda s, b, h, q, k, t, c: sm.where((q < 3) == 1, s, 0.0), TypeError, r"compares the condition \(q_idx < 3\) with the integer 1"),
    ("ordering conditions", lambda s, b, h, q, k, t, c: sm.where((q < 3) < (k < 3), s, 0.0), TypeError, r"cannot order two conditions"),
    ("condition in arithmetic", lambda s, b, h, q, k, t, c: s + (q < 3), TypeError, r"`\+` needs numbers, got the condition"),
    ("condition branch", lambda s, b, h, q, k, t, c: sm.where(q < 3, q < 2, s), TypeError, r"where\(\) branches must be values"),
    ("torch.where", lambda s, b, h, q, k, t, c: torch.where(q < k, s, 0.0), TypeError, r"torch.where was called .* use sm.where\(cond, x, y\)"),
    ("torch.clamp", lambda s, b, h, q, k, t, c: torch.clamp(s, -1.0, 1.0), TypeError, r"torch.clamp .* use sm.clamp\(x, lo, hi\)"),
    ("torch.floor", lambda s, b, h, q, k, t, c: torch.floor(s), TypeError, r"torch.floor .* use sm.floor\(x\)"),
    ("torch.exp2", lambda s, b, h, q, k, t, c: s + torch.exp2(h * 1.0), TypeError, r"torch.exp2 .* sm.pow\(2.0, x\)"),
    ("closure tensor index", lambda s, b, h, q, k, t, c: s + torch.ones(3)[q], TypeError, r"indexing a torch.Tensor .*name=sm.TensorParam\(\)"),
    ("math.exp", lambda s, b, h, q, k, t, c: math.exp(s), TypeError, r"use the score_mods namespace instead of math"),
    ("int()", lambda s, b, h, q, k, t, c: s + int(q), TypeError, r"index arguments are already integers"),
    (".long()", lambda s, b, h, q, k, t, c: s + q.long(), AttributeError, r"no attribute 'long'.*no .long\(\)"),
    ("python if", lambda s, b, h, q, k, t, c: s if q < k else -s, TypeError, r"cannot branch on a symbolic value"),
    ("builtin min", lambda s, b, h, q, k, t, c: min(s, 1.0), TypeError, r"sm.minimum"),
    ("unpack gather", lambda s, b, h, q, k, t, c: s + sum(t[q]), TypeError, r"cannot be iterated or unpacked"),
    ("index a value", lambda s, b, h, q, k, t, c: s + q[0], TypeError, r"the integer q_idx cannot be indexed"),
    ("round", lambda s, b, h, q, k, t, c: round(s), TypeError, r"round\(\) is not supported"),
    ("python bool", lambda s, b, h, q, k, t, c: sm.where(True, s, 0.0), TypeError, r"Python bool True .* x if flag else y"),
]


@pytest.mark.parametrize("case", [e[0] for e in ERRORS])
def test_decoration_errors_name_the_construct(case):
    _, body, exc, match = next(e for e in ERRORS if e[0] == case)
    with pytest.raises(exc, match=match):
        _trace(body)


def test_math_floor_and_ceil_are_the_sm_functions():
    @sm.score_mod
    def mod(score, b, h, q_idx, kv_idx):
        return score + math.floor(score) + math.ceil(q_idx / 2)

    s = torch.randn(1, 1, S, S, dtype=torch.float64) * 3
    torch.testing.assert_close(mod.eager(s, *IDX, S, S), s + torch.floor(s) + torch.ceil(Q / 2))


def test_nan_is_refused_everywhere_inf_only_where_meaningful():
    with pytest.raises(ValueError, match="parameter 'cap' must not be NaN"):
        sm.softcap(3.0).bind(cap=math.nan)
    with pytest.raises(ValueError, match="softcap: cap must be a finite float > 0, got inf"):
        sm.softcap(3.0).bind(cap=math.inf)
    with pytest.raises(ValueError, match="softcap: m0_cap must be a finite float > 0"):
        sm.compose(sm.softcap(3.0), sm.causal()).bind(m0_cap=-1.0)
    with pytest.raises(ValueError, match="sliding_window: left must be >= 0"):
        sm.sliding_window(4, 0).bind(left=-2.0)
    with pytest.raises(ValueError, match="'x' has the default NaN"):
        @sm.score_mod
        def nan_default(score, b, h, q_idx, kv_idx, x=math.nan):
            return score * x
    with pytest.raises(ValueError, match="must not be NaN"):
        sm.score_mod(lambda score, b, h, q_idx, kv_idx: score * math.nan)

    @sm.score_mod
    def shift(score, b, h, q_idx, kv_idx, x=0.0):
        return sm.where(q_idx < x, score, -math.inf)

    assert shift(x=math.inf).scalars() == {"x": math.inf}  # +-inf allowed where it means something
