"""score_mods.gym on the cuDNN backend: every port of tests/score_mods/test_score_mods_gym.py, bf16 and fp16,
forward and backward, against float64 with the project's tolerance rule (fused_attn.testing).

A port cuDNN cannot serve must be refused with a NotImplementedError that says why, never served
by another backend: REFUSED lists every expected refusal, so a new refusal (or a refusal that
stops happening) fails here. `test_cudnn_refusals_report` prints which ports run where.
"""

from __future__ import annotations

import math

import pytest
import torch

import fused_attn
from fused_attn.testing import assert_close, bound_from, grad_tolerances, reference_attention, tolerance
from helpers.mods import quirk_applies
from helpers.gym_cases import CASES, Case, fresh_tables, oracle_mask, params

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

D = 64
DTYPES = [torch.bfloat16, torch.float16]

# Expected refusals, by case id and phase ("forward": any call; "backward": a call with inputs that
# require grad). No port is refused forward. Masks whose condition reads a graph input that varies
# along the keys (a tensor view: ids[kv_idx], spans, flags; or a materialized operand: bit-twiddled
# Morton coordinates, tile maps) report irregular_mask: where the cuDNN quirk irregular_mask_backward
# applies, with gradients required cuDNN refuses. Conditions over query-axis inputs only
# (document starts per query) and index arithmetic with //, %, clamp (NATTEN, STA, block
# diffusion, ...) were measured exact in the backward: those ports keep their cuDNN backward.
_NO_BACKWARD = "irregular_mask_backward"
REFUSED = {
    **{cid: {"backward": _NO_BACKWARD} for cid in (
        "global_sliding_window_1", "global_sliding_window_s1",
        "document_docs_3_1_4_2", "document_inner_causal_docs_3_1_4_2",
        "document_docs_1", "document_inner_causal_docs_1", "document_inner_lookback",
        "morton_natten_4x4_k3x3", "morton_natten_6x6_k3x3", "morton_natten_2x4_k1x3",
        "vsa_b2h2_t4", "vsa_b2h2_t4_padded", "vsa_shared_map_t3",
        "jetspec_tree_p3_n7", "jetspec_tree_p0_n7", "jetspec_tree_p2_n1",
        "flamingo_3x2_text12", "flamingo_1x1",
    )},
}
# Refusals only the GPU can know: cuDNN 9.19 proposes no engine for these backward graphs
# (measured on H200), so the call raises NotImplementedError with the frontend's reason.
DECLINED_BY_ENGINE = {"shared_prefix_5docs": {"backward": "cuDNN cannot run this attention configuration"}}


def test_refusal_list_matches_the_ports():
    """Runs everywhere: REFUSED is exactly what the ports report (irregular_mask, cudnn_unsupported),
    so a port that gains or loses a refusal shows up here before any GPU run."""
    got = {}
    for c in CASES.values():
        port = c.make(fresh_tables(c))[0]
        phases = {}
        if port.cudnn_unsupported:
            phases["forward"] = port.cudnn_unsupported
        elif port.irregular_mask:
            phases["backward"] = _NO_BACKWARD
        if phases:
            got[c.id] = phases
    assert set(got) == set(REFUSED), (f"newly refused: {sorted(set(got) - set(REFUSED))}; "
                                      f"no longer refused: {sorted(set(REFUSED) - set(got))}")
    for cid, phases in got.items():
        assert set(phases) == set(REFUSED[cid]), f"{cid}: refused in {sorted(phases)}, expected {sorted(REFUSED[cid])}"


def _inputs(c: Case, dtype: torch.dtype, requires_grad: bool):
    g = torch.Generator().manual_seed(0)
    shapes = ((c.b, c.h, c.sq, D), (c.b, c.h, c.skv, D), (c.b, c.h, c.skv, D))
    cpu = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
    dev = [t.to("cuda", dtype).requires_grad_(requires_grad) for t in cpu]
    return cpu, dev


def _cuda(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cuda", torch.float32 if t.is_floating_point() else t.dtype)


def _on_cuda(port, keep=()):
    """The port with its tensor parameters on the GPU (float tables as float32), except `keep`."""
    moved = {n: _cuda(t) for n, t in port.tensors().items() if n not in keep}
    return port.bind(**moved) if moved else port


def _oracle(c: Case):
    tables = fresh_tables(c)
    _, mask_fn, score_fn = c.make(tables)
    dense = oracle_mask(mask_fn, c.b, c.h, c.sq, c.skv) if mask_fn else None
    return dense, score_fn


def _expect(c: Case, phase: str):
    reason = REFUSED.get(c.id, {}).get(phase) or DECLINED_BY_ENGINE.get(c.id, {}).get(phase)
    if reason == _NO_BACKWARD and not quirk_applies("irregular_mask_backward"):
        reason = None
    return pytest.raises(NotImplementedError, match=reason) if reason else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", params(CASES.values()))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_forward(c: Case, dtype):
    (q, k, v), (qd, kd, vd) = _inputs(c, dtype, requires_grad=False)
    port = _on_cuda(c.make(fresh_tables(c))[0])
    refusal = _expect(c, "forward")
    if refusal:
        with refusal:
            fused_attn.dot_product_attention(qd, kd, vd, qkv_format="bhsd", score_mod=port, backend="cudnn")
        return
    out = fused_attn.dot_product_attention(qd, kd, vd, qkv_format="bhsd", score_mod=port, backend="cudnn")
    dense, score_fn = _oracle(c)
    scale = 1 / math.sqrt(D)
    expected, _ = reference_attention(q, k, v, scale, dense, score_fn)
    assert_close(out, expected, tolerance(q, k, v, scale, dtype, dense, score_fn), f"{c.id} {dtype} forward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", params(CASES.values()))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_backward(c: Case, dtype):
    (q, k, v), (qd, kd, vd) = _inputs(c, dtype, requires_grad=True)
    port = _on_cuda(c.make(fresh_tables(c))[0])
    if _expect(c, "forward"):
        pytest.skip("forward refused (test_cudnn_forward checks the refusal)")
    refusal = _expect(c, "backward")
    if c.sq == 1 and c.skv == 1:  # a shape limit of cuDNN's backward, checked before the port's own
        refusal = pytest.raises(NotImplementedError, match="s_q = s_kv = 1")
    if refusal:
        with refusal:
            fused_attn.dot_product_attention(qd, kd, vd, qkv_format="bhsd", score_mod=port, backend="cudnn")
        return
    out = fused_attn.dot_product_attention(qd, kd, vd, qkv_format="bhsd", score_mod=port, backend="cudnn")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(dout.to("cuda", dtype))
    dense, score_fn = _oracle(c)
    exact, bounds = grad_tolerances(q, k, v, dout, 1 / math.sqrt(D), dtype, dense, score_fn)
    for name, t, e, bound in zip(("dq", "dk", "dv"), (qd, kd, vd), exact, bounds):
        assert_close(t.grad, e, bound, f"{c.id} {dtype} {name}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("c", params([c for c in CASES.values() if c.tables and c.id not in REFUSED]))
def test_cudnn_learnable_table_gradient(c: Case):
    """A float table that enters only through an additive bias gets cuDNN's dBias (pulled back to
    the table by autograd), equal to the float64 reference within the rule; any other trained
    table is refused with the reason, never left without a gradient."""
    port = c.make(fresh_tables(c))[0]
    facts = port.trainable()
    trained = [n for n, f in facts.items() if f.floating]
    if not trained:
        pytest.skip("no floating table")
    if c.sq == 1 and c.skv == 1:
        pytest.skip("s_q = s_kv = 1: cuDNN has no backward at this shape (test_cudnn_backward checks the refusal)")
    (q, k, v), _ = _inputs(c, torch.bfloat16, requires_grad=False)
    dout = torch.randn(c.b, c.h, c.sq, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def table_grads(backend, qkv_dtype, table_dtype, device):
        tables = {n: t.detach().to(device, table_dtype if t.is_floating_point() else t.dtype)
                  .requires_grad_(n in trained) for n, t in port.tensors().items()}
        qq, kk, vv = (t.to(device, qkv_dtype) for t in (q, k, v))
        out = fused_attn.dot_product_attention(qq, kk, vv, qkv_format="bhsd", score_mod=port.bind(**tables),
                                               backend=backend)
        return torch.autograd.grad(out, [tables[n] for n in trained], dout.to(device, qkv_dtype))

    if not all(facts[n].bias_only for n in trained):
        with pytest.raises(NotImplementedError, match="additive bias"):
            table_grads("cudnn", torch.bfloat16, torch.float32, "cuda")
        return
    exact = table_grads("reference", torch.float64, torch.float64, "cpu")
    same_dtype = table_grads("reference", torch.bfloat16, torch.float32, "cpu")
    got = table_grads("cudnn", torch.bfloat16, torch.float32, "cuda")
    for n, e, s_, g in zip(trained, exact, same_dtype, got):
        assert_close(g.float(), e, bound_from(s_, e, torch.bfloat16), f"{c.id} d{n}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_refusals_report(capsys):
    """Which ports run on cuDNN (forward / backward) and which are refused, with the reason."""
    rows = []
    for c in CASES.values():
        try:
            port = _on_cuda(c.make(fresh_tables(c))[0])
        except Exception as exc:  # noqa: BLE001 - a port the language cannot build yet
            rows.append(f"{c.id:40s} not built: {type(exc).__name__}: {exc}"[:200])
            continue
        cells = []
        for grad in (False, True):
            _, (qd, kd, vd) = _inputs(c, torch.bfloat16, requires_grad=grad)
            try:
                fused_attn.dot_product_attention(qd, kd, vd, qkv_format="bhsd", score_mod=port, backend="cudnn")
                cells.append("runs")
            except NotImplementedError as exc:
                cells.append(f"refused ({str(exc)[:90]})")
            except Exception as exc:  # noqa: BLE001 - report, do not stop: test_cudnn_forward/backward fail on it
                cells.append(f"ERROR {type(exc).__name__} ({str(exc)[:90]})")
        rows.append(f"{c.id:40s} forward: {cells[0]:10s} with grad: {cells[1]}")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
