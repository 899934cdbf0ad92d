"""GPU: transformers models with attn_implementation="fused_attn" on cuDNN in bf16, against eager.

The CPU file's comparisons (test_transformers.py) on a CUDA device, with the integration
registered as "fused_attn_cudnn" (backend="cudnn": a configuration cuDNN cannot serve raises
NotImplementedError, reported here as an xfail with its reason, never a silent fallback):

    exact = eager in float64 on the GPU (float64 softmax), per document for cu_seq_lens batches;
    fused_attn bf16: |got - exact| <= 2 * |eager bf16 - exact| + 4e-3 * max(1, max|exact|)

for logits (real tokens) and the gradient of every parameter (sinks included). The models are
the tiny ones with head dim 64, hidden 128, windows of 16 tokens and 48 tokens per row.
"""

from __future__ import annotations

import copy
import warnings
from functools import lru_cache

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

transformers = pytest.importorskip("transformers")

import fused_attn  # noqa: E402
import fused_attn.integrations.transformers as fa_hf  # noqa: E402
from benchmarks.models import FAMILIES, build_model, model_config  # noqa: E402
from fused_attn.testing import bound_from, grad_tolerances, max_error, tolerance  # noqa: E402
from helpers.hf_models import KINDS, assert_model_close, exact_eager, make_batch, run  # noqa: E402

CUDNN = "fused_attn_cudnn"
LENGTH = 48
GPU_SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=64)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    fa_hf.register(CUDNN, backend="cudnn")
    fa_hf.register()
    yield
    fa_hf.unregister(CUDNN)


@lru_cache(maxsize=None)
def gpu_models(family: str):
    extra = dict(num_local_experts=1, num_experts_per_tok=1) if family == "gpt_oss" else {}  # no routing flips
    cfg = model_config(family, "tiny", window=16, **GPU_SIZES, **extra)
    m64 = build_model(cfg, "eager", dtype=torch.float64, device=torch.device("cuda"))
    m16 = copy.deepcopy(m64).to(torch.bfloat16)
    return m64, m16


def _run_or_xfail(model, impl, batch):
    try:
        return run(model, impl, batch)
    except NotImplementedError as exc:
        pytest.xfail(f"cuDNN refuses this configuration: {exc}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_models_bf16_on_cudnn_match_eager(family, kind):
    m64, m16 = gpu_models(family)
    batch = make_batch(kind, length=LENGTH)
    per_doc = kind == "packed_kwargs"
    exact = run(m64, "eager", batch, per_document=per_doc)
    base = run(m16, "eager", batch, per_document=per_doc)
    got = _run_or_xfail(m16, CUDNN, batch)
    assert_model_close(got, exact, base, torch.bfloat16, batch["valid"], f"{family}/{kind} bf16 cuDNN")


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_decoding_with_a_cache_matches_eager(family):
    """Prefill a left-padded batch, then decode token by token with a DynamicCache (bottom-right
    causal, sliding-window caches): every step's logits within the bf16 rule."""
    m64, m16 = gpu_models(family)
    batch = make_batch("left_pad", length=LENGTH)
    ids, mask = batch["inputs"]["input_ids"].cuda(), batch["inputs"]["attention_mask"].cuda()
    prefill = LENGTH - 6

    def decode(model, impl):
        model.set_attn_implementation(impl)
        model.eval()
        outs = []
        with exact_eager(), torch.no_grad():
            out = model(input_ids=ids[:, :prefill], attention_mask=mask[:, :prefill], use_cache=True)
            outs.append(out.logits[:, -1])
            cache = out.past_key_values
            for t in range(prefill, LENGTH):
                out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                            use_cache=True)
                outs.append(out.logits[:, -1])
                cache = out.past_key_values
        return torch.stack(outs).double().cpu()

    exact = decode(m64, "eager")
    base = decode(m16, "eager")
    bound = bound_from(base, exact, torch.bfloat16)
    try:
        got = decode(m16, CUDNN)
    except NotImplementedError as exc:
        # cuDNN 9.19 and 9.27 have no decode graph (s_q = 1) with a sink token: a refusal that says
        # so, and backend="auto" decodes on another engine (FA4, or the reference with a warning)
        assert family == "gpt_oss" and "sink" in str(exc), str(exc)[:400]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fused_attn.FallbackWarning)
            got = decode(m16, fa_hf.NAME)
    assert max_error(got, exact) <= bound


@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_auto_backend_runs_models_on_cudnn(kind):
    """backend="auto" (the default registration) serves dense and packed batches of every family
    (gpt-oss's sinks on packed batches included) without falling back."""
    from fused_attn import FallbackWarning

    for family in FAMILIES:
        _, m16 = gpu_models(family)
        batch = make_batch(kind, length=LENGTH)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(m16, fa_hf.NAME, batch)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
        assert not fallbacks, f"{family}: {fallbacks}"


# ----------------------------------------------------------------------------- the attention function

def _case(name):
    """(module kwargs, call kwargs, 2-D padding or None, HF mask function, q_offset, Sq, Skv, score_fn, sinks)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    pad = torch.ones(2, 96, dtype=torch.bool)
    pad[0, :20] = False
    pad[1, 70:] = False
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    cap = lambda s, *_: 5.0 * torch.tanh(s / 5.0)  # noqa: E731
    cases = {
        "causal": ({}, None, causal_mask_function, 0, 96, 96, None, None),
        "window": (dict(sliding_window=16), None, sliding_window_causal_mask_function(16), 0, 96, 96, None, None),
        "softcap+window": (dict(sliding_window=16, softcap=5.0), None, sliding_window_causal_mask_function(16), 0,
                           96, 96, cap, None),
        "sinks+window": (dict(sliding_window=16, s_aux=sinks), None, sliding_window_causal_mask_function(16), 0,
                         96, 96, None, sinks),
        "padding": ({}, pad, causal_mask_function, 0, 96, 96, None, None),
        "padding+softcap+window": (dict(sliding_window=16, softcap=5.0), pad, sliding_window_causal_mask_function(16),
                                   0, 96, 96, cap, None),
        "padding+sinks": (dict(s_aux=sinks), pad, causal_mask_function, 0, 96, 96, None, sinks),
        "decode": (dict(sliding_window=16), None, sliding_window_causal_mask_function(16), 90, 6, 96, None, None),
    }
    return cases[name]


@pytest.mark.parametrize("name", ["causal", "window", "softcap+window", "sinks+window", "padding",
                                  "padding+softcap+window", "padding+sinks", "decode"])
def test_attention_function_bf16_on_cudnn(name):
    """One attention call through the transformers function on cuDNN vs the float64 reference
    with transformers' own mask (fused_attn.testing's rule), forward and gradients."""
    from transformers.masking_utils import sdpa_mask

    kw, pad, fn, q_off, sq, skv, score_fn, sinks = _case(name)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, sq, 64, generator=gen)
    k, v = torch.randn(2, 2, skv, 64, generator=gen), torch.randn(2, 2, skv, 64, generator=gen)
    mask = sdpa_mask(batch_size=2, q_length=sq, kv_length=skv, q_offset=q_off, mask_function=fn,
                     attention_mask=pad, allow_is_causal_skip=False)
    scale = 0.125
    rows = torch.ones(2, sq, dtype=torch.bool) if pad is None else pad[:, skv - sq:]
    cot = torch.randn(2, sq, 4, 64, generator=gen) * rows[:, :, None, None]
    call = fa_hf.make_attention_forward(backend="cudnn")
    leaves = [t.cuda().bfloat16().requires_grad_(True) for t in (q, k, v)]
    extra = dict(kw)
    if sinks is not None:
        extra["s_aux"] = sinks.cuda().requires_grad_(True)
    module = torch.nn.Module()
    module.is_causal = True
    try:
        out, _ = call(module, *leaves, None if pad is None else pad.cuda(), scaling=scale, **extra)
    except NotImplementedError as exc:
        pytest.xfail(f"cuDNN refuses this configuration: {exc}")
    wrt = leaves + ([extra["s_aux"]] if sinks is not None else [])
    grads = torch.autograd.grad(out, wrt, cot.cuda().bfloat16())
    from fused_attn.testing import reference_attention

    want, _ = reference_attention(q, k, v, scale, mask=mask, score_fn=score_fn, sinks=sinks)
    bound = tolerance(q, k, v, scale, torch.bfloat16, mask=mask, score_fn=score_fn, sinks=sinks)
    got = out.transpose(1, 2).double().cpu()
    sel = rows[:, None, :, None].expand_as(want)
    assert max_error(got[sel], want[sel]) <= bound, "out"
    exact, bounds = grad_tolerances(q, k, v, cot.transpose(1, 2), scale, torch.bfloat16, mask=mask,
                                    score_fn=score_fn, sinks=sinks)
    for what, g, e, b in zip(("dq", "dk", "dv", "dsinks"), grads, exact, bounds):
        assert max_error(g.double().cpu(), e) <= b, what
