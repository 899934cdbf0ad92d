"""The cuDNN quirk table on CPU: lookup by version, refusal texts, the lifted context, the
untested-version notice, the refusals it gates, and the callback input isolation (with a fake
graph that records the ops)."""

from __future__ import annotations

import pytest
import torch

import score_mods as sm
from fused_attn.backends.cudnn import quirks
from fused_attn.backends.cudnn.isolation import IsolatingGraph

V919, V926, V927, V930 = 91900, 92600, 92700, 93000


def test_lookup_by_version():
    fixed_926 = {"nan_dq_kv_64_mod_128", "ragged_sink_backward"}
    assert fixed_926 <= set(quirks.active(V919))
    assert not fixed_926 & set(quirks.active(V926))
    assert not fixed_926 & set(quirks.active(V927))
    assert "score_reused_in_pointwise" not in quirks.active(V919)  # a regression: 9.19 measured right
    assert "score_reused_in_pointwise" in quirks.active(V927)
    assert "nan_dq_kv_64_mod_128_score_mod_bias" in quirks.active(V927)  # the score_mod + bias form stays
    # an untested newer version keeps every open entry; an unknown one (0) keeps all of them
    open_entries = {n for n, q in quirks.QUIRKS.items() if q.fixed_in is None}
    assert set(quirks.active(V930)) == open_entries
    assert set(quirks.active(0)) == set(quirks.QUIRKS)


def test_every_entry_is_complete():
    for name, q in quirks.QUIRKS.items():
        assert q.name == name and q.fault and q.measured and q.handling and q.way_out, name
        assert q.handling.startswith(("workaround", "refusal", "documented")), name
        assert q.fixed_in is None or q.fixed_in > q.since, name
        assert "test_quirks_gpu.py" in q.test, name


def test_refusal_names_version_entry_and_way_out():
    text = quirks.QUIRKS["nan_dq_kv_64_mod_128"].refusal(V919, "a key length 64 mod 128 with a bias")
    assert "cuDNN 9.19.0" in text and "nan_dq_kv_64_mod_128" in text
    assert "fixed in cuDNN 9.26" in text and "pip install 'nvidia-cudnn-cu13>=9.26'" in text
    assert "backend='reference'" in text
    open_text = quirks.QUIRKS["kv_broadcast_operand_backward"].refusal(V927, "w[kv_idx]")
    assert "cuDNN 9.27.0" in open_text and "fixed in" not in open_text and "post_scale_bias" in open_text
    assert "this cuDNN" in quirks.QUIRKS["sq1_skv1_backward"].refusal(0, "x")


def test_versions_in_words():
    assert quirks.version_string(91900) == "9.19.0" and quirks.version_string(0) == "unknown"
    assert "fixed in 9.26" in quirks.QUIRKS["nan_dq_kv_64_mod_128"].versions()
    assert "not yet seen fixed" in quirks.QUIRKS["score_reused_in_pointwise"].versions()


def test_lifted_is_scoped_and_checks_names():
    assert quirks.applies("sq1_skv1_backward", V919)
    with quirks.lifted("sq1_skv1_backward"):
        assert not quirks.applies("sq1_skv1_backward", V919)
        assert quirks.applies("irregular_mask_backward", V919)
    assert quirks.applies("sq1_skv1_backward", V919)
    with pytest.raises(ValueError, match="unknown quirk"):
        with quirks.lifted("no_such_quirk"):
            pass


def test_untested_notice():
    assert quirks.untested_notice(V919) is None and quirks.untested_notice(V927) is None
    assert quirks.untested_notice(0) is None
    notice = quirks.untested_notice(V930)
    assert "9.30.0 is untested" in notice and "9.19.0" in notice and "9.27.0" in notice


def test_irregular_mask_refusal_follows_the_entry(monkeypatch):
    """The cuDNN backend refuses an irregular mask's backward exactly where the entry applies."""
    from fused_attn.backends import cudnn as backend
    from fused_attn.plan import NO_VARLEN, _static_problem
    from fused_attn.spec import resolve_spec

    mod = sm.document_mask(torch.tensor([0, 0, 1, 1] * 32))
    q = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    spec, m = resolve_spec(score_mod=mod, backend="cudnn")
    problem = _static_problem(spec, m, q, q, q, NO_VARLEN, None, True)
    why = backend._mod_refusal(problem, m, ver=V919)
    assert "irregular_mask_backward" in why and "9.19.0" in why
    with quirks.lifted("irregular_mask_backward"):  # doc_ids[kv_idx] is also a key-axis view
        assert "kv_broadcast_operand_backward" in backend._mod_refusal(problem, m, ver=V919)
        with quirks.lifted("kv_broadcast_operand_backward"):
            assert backend._mod_refusal(problem, m, ver=V919) is None


class _FakeTensor:
    def __init__(self, name):
        self.name = name

    def set_data_type(self, _):
        return self

    def __repr__(self):
        return self.name


class _FakeGraph:
    """Records (op, input names) and returns named fake tensors."""

    def __init__(self):
        self.ops = []

    def __getattr__(self, op):
        def call(*args, **kw):
            names = [a.name for a in args if isinstance(a, _FakeTensor)]
            names += [f"{k}={v.name}" for k, v in kw.items() if isinstance(v, _FakeTensor)]
            out = _FakeTensor(f"{op}{len(self.ops)}")
            self.ops.append((op, tuple(names)))
            return out

        return call


def _isolated(build):
    g = _FakeGraph()
    proxy = IsolatingGraph(g, "float")
    s = proxy.root(_FakeTensor("s"))
    build(proxy, s)
    return g.ops, proxy.copies_made


def test_isolation_copies_an_input_read_next_to_its_own_values():
    ops, n = _isolated(lambda g, s: g.mul(s, s))
    assert ops == [("identity", ("s",)), ("mul", ("identity0", "identity0"))] and n == 1
    ops, n = _isolated(lambda g, s: g.mul(g.neg(s), s))
    assert ops == [("neg", ("s",)), ("identity", ("s",)), ("mul", ("neg0", "identity1"))] and n == 1
    ops, _ = _isolated(lambda g, s: g.binary_select(g.binary_select(s, g.neg(s), g.cmp_ge(g.gen_index(s), s)), s,
                                                    g.gen_index(s)))
    assert ops[-1][0] == "binary_select" and "s" not in ops[-1][1]


def test_isolation_leaves_other_forms_alone():
    # both operands computed from s, or s next to values that do not depend on it: no copy
    ops, n = _isolated(lambda g, s: g.mul(g.tanh(s), g.sigmoid(s)))
    assert n == 0 and ("identity", ("s",)) not in ops
    ops, n = _isolated(lambda g, s: g.mul(s, g.gen_index(_FakeTensor("other"))))
    assert n == 0
    ops, n = _isolated(lambda g, s: g.tanh_backward(loss=s, input=g.mul(s, _FakeTensor("c"))))
    assert n == 1 and ops[-1] == ("tanh_backward", ("loss=identity1", "input=mul0"))


def test_isolation_is_one_copy_per_input():
    g = _FakeGraph()
    proxy = IsolatingGraph(g, "float")
    s, ds = proxy.root(_FakeTensor("s")), proxy.root(_FakeTensor("ds"))
    a = proxy.mul(s, s)
    proxy.add(proxy.mul(ds, ds), proxy.add(a, s))
    assert proxy.copies_made == 2
    assert [op for op in g.ops if op[0] == "identity"] == [("identity", ("s",)), ("identity", ("ds",))]


def test_an_untested_cudnn_loads_with_one_notice(monkeypatch):
    from fused_attn.backends.cudnn import version

    monkeypatch.setattr(version, "_result", None)
    monkeypatch.setattr(version, "_probe", lambda: (None, V930))
    with pytest.warns(version.UntestedCudnnWarning, match="9.30.0 is untested"):
        assert version.unavailable_reason() is None
    assert version.backend_version() == V930  # probed once: no second notice
    assert "nan_dq_kv_64_mod_128" not in quirks.active(version.backend_version())
