"""fused_attn as a transformers attention implementation, against transformers' eager (CPU).

Tiny random models (2 layers, hidden 64, 4 query / 2 key-value heads, vocab 128, windows of 4
tokens, initializer_range 0.2 so attention, softcap and sinks matter) of Llama, Gemma 2 (softcap
+ alternating sliding layers), Qwen 2 (GQA + a sliding layer) and gpt-oss (sinks + alternating
sliding layers, 4 experts): logits and the gradient of every parameter, for dense, left- and
right-padded and packed batches, with the project's tolerance rule at model level
(`helpers.hf_models`: the models, the batches and the rule).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fused_attn.integrations.transformers as fa_hf  # noqa: E402
from benchmarks.models import FAMILIES, model_config  # noqa: E402
from fused_attn.testing import agreement_bound, max_error, reference_attention  # noqa: E402
from helpers.hf_models import (FA, KINDS, assert_model_close, causal_lm_loss, exact_eager, make_batch,  # noqa: E402
                               models, run)

@pytest.fixture(scope="module", autouse=True)
def _registered():
    fa_hf.register()
    yield



def compare(family: str, kind: str, **overrides) -> None:
    m64, m32 = models(family, **overrides)
    batch = make_batch(kind)
    per_doc = kind == "packed_kwargs"  # cu_seq_lens: documents are sequences, whatever the model's masks say
    exact = run(m64, "eager", batch, per_document=per_doc)
    base32 = run(m32, "eager", batch, per_document=per_doc)
    got64 = run(m64, FA, batch)
    got32 = run(m32, FA, batch)
    assert_model_close(got64, exact, None, torch.float64, batch["valid"], f"{family}/{kind} float64")
    assert_model_close(got32, exact, base32, torch.float32, batch["valid"], f"{family}/{kind} float32")


# ----------------------------------------------------------------------------- model comparisons

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_model_logits_and_grads_match_eager(family, kind):
    compare(family, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["packed", "packed_rows"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_packed_position_ids_isolate_documents(family, kind):
    """These models give position_ids to their mask functions (without a cache), so transformers
    detects the packing and fused_attn runs every document as its own sequence: equal to eager
    run on each document alone."""
    m64, _ = models(family)
    batch = make_batch(kind)
    exact = run(m64, "eager", batch, per_document=True)
    assert_model_close(run(m64, FA, batch), exact, None, torch.float64, batch["valid"], f"{family}/{kind}")


@pytest.mark.slow
def test_gpt_oss_packing_needs_cu_seq_lens():
    """gpt-oss (transformers 5.17) does not give position_ids to its mask functions, so its eager
    and fused_attn treat a position_ids-packed row as one sequence (as its eager does); the
    cu_seq_lens_q/k kwargs of DataCollatorWithFlattening(return_flash_attn_kwargs=True) make
    fused_attn isolate the documents."""
    m64, _ = models("gpt_oss")
    plain, with_kwargs = make_batch("packed"), make_batch("packed_kwargs")
    per_doc = run(m64, "eager", plain, per_document=True)[0]
    as_one = run(m64, FA, plain)[0]
    eager_as_one = run(m64, "eager", plain)[0]
    assert max_error(as_one, eager_as_one) <= agreement_bound(eager_as_one)
    assert max_error(as_one, per_doc) > 1e-2
    assert max_error(run(m64, FA, with_kwargs)[0], per_doc) <= agreement_bound(per_doc)


@pytest.mark.slow
@pytest.mark.parametrize("family, disable, what", [
    ("gemma2", lambda attn: setattr(attn, "attn_logit_softcapping", None), "softcap"),
    ("gemma2", lambda attn: setattr(attn, "sliding_window", None), "sliding window"),
    ("qwen2", lambda attn: setattr(attn, "sliding_window", None), "sliding window"),
    ("gpt_oss", lambda attn: setattr(attn, "sliding_window", None), "sliding window"),
    ("gpt_oss", lambda attn: attn.sinks.data.fill_(-1e4), "sinks"),
])
def test_comparisons_are_sensitive_to_the_feature(family, disable, what):
    """Dropping the feature changes the logits by far more than the float32 bound: the model
    comparisons above would catch an integration that ignored it."""
    m64, _ = models(family)
    batch = make_batch("left_pad")
    exact, _ = run(m64, "eager", batch)
    off = copy.deepcopy(m64)
    for layer in off.model.layers:
        disable(layer.self_attn)
    changed, _ = run(off, FA, batch)
    valid = batch["valid"]
    assert max_error(changed[valid], exact[valid]) > 100 * agreement_bound(exact[valid], torch.float32), what


@pytest.mark.slow
def test_generation_with_left_padding_and_cache_matches_eager():
    """Greedy decoding with a KV cache (bottom-right causal, padding, sliding-window caches)."""
    for family in ("llama", "gemma2", "gpt_oss"):
        m64, _ = models(family)
        m64.eval()
        batch = make_batch("left_pad")
        kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  pad_token_id=0)
        outs = {}
        for impl in ("eager", FA):
            m64.set_attn_implementation(impl)
            with exact_eager(), torch.no_grad():
                outs[impl] = m64.generate(**batch["inputs"], **kw)
        assert torch.equal(outs["eager"].sequences, outs[FA].sequences), family
        for step, (a, b) in enumerate(zip(outs["eager"].scores, outs[FA].scores)):
            assert max_error(b, a) <= agreement_bound(a), (family, step)


@pytest.mark.slow
def test_from_config_one_line_switch():
    cfg = model_config("llama", "tiny")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=FA)
    assert model.config._attn_implementation == FA
    out = model(torch.randint(0, 128, (1, 9))).logits
    assert out.shape == (1, 9, 128) and torch.isfinite(out).all()


@pytest.mark.slow
def test_training_mode_without_dropout_equals_eval():
    m64, _ = models("llama")
    batch = make_batch("right_pad")
    a, ga = run(m64, FA, batch, train=True)
    b, gb = run(m64, FA, batch, train=False)
    assert torch.equal(a, b) and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "left_pad"])
def test_torch_compile(kind):
    """torch.compile(model) (graph breaks at mask creation and the mask's host conversion; the
    attention calls go through fused_attn's custom ops): same logits and gradients as eager mode."""
    _, m32 = models("gemma2")
    batch = make_batch(kind)
    want_logits, want_grads = run(m32, FA, batch)
    torch._dynamo.reset()
    compiled = torch.compile(m32, backend="aot_eager")
    m32.zero_grad(set_to_none=True)
    logits = compiled(**batch["inputs"], use_cache=False).logits
    s, n = causal_lm_loss(logits, batch["labels"])
    (s / n).backward()
    valid = batch["valid"]
    assert max_error(logits.double()[valid], want_logits[valid]) <= agreement_bound(want_logits[valid], torch.float32)
    for name, p in m32.named_parameters():
        assert max_error(p.grad, want_grads[name]) <= agreement_bound(want_grads[name], torch.float32), name


# ----------------------------------------------------------------------------- the attention function

class _Module(torch.nn.Module):
    def __init__(self, is_causal=True, groups=2):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups
        self.training = False


def _qkv(b=2, h=4, hkv=2, sq=10, skv=10, d=16, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=gen, dtype=dtype)
    k = torch.randn(b, hkv, skv, d, generator=gen, dtype=dtype)
    v = torch.randn(b, hkv, skv, d, generator=gen, dtype=dtype)
    return q, k, v


def _hf_mask(fn, b, sq, skv, padding=None, q_offset=0):
    """The boolean mask transformers' sdpa/eager path builds for `fn` (True = attend)."""
    from transformers.masking_utils import sdpa_mask

    m = sdpa_mask(batch_size=b, q_length=sq, kv_length=skv, q_offset=q_offset, mask_function=fn,
                  attention_mask=padding, allow_is_causal_skip=False)
    return m


@pytest.mark.parametrize("window", [1, 3, 4, 9, 10, 50])
def test_sliding_window_convention_matches_transformers_masks(window):
    """sliding_window=W is eager's `kv_idx > q_idx - W` (W keys including the diagonal)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, k, v = _qkv()
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3, sliding_window=window)
    mask = _hf_mask(sliding_window_causal_mask_function(window), 2, 10, 10)
    want, _ = reference_attention(q, k, v, 0.3, mask=mask)
    assert max_error(out, want.transpose(1, 2)) <= agreement_bound(want.transpose(1, 2))


def test_softcap_and_window_compose_as_eager():
    """softcap first, then the mask (eager adds the mask after capping)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q, k, v = _qkv()
    q = q * 3
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, sliding_window=4, softcap=2.0)
    mask = _hf_mask(sliding_window_causal_mask_function(4), 2, 10, 10)
    want, _ = reference_attention(q, k, v, 0.25, mask=mask, score_fn=lambda s, *_: 2.0 * torch.tanh(s / 2.0))
    assert max_error(out, want.transpose(1, 2)) <= agreement_bound(want.transpose(1, 2))
    again, _ = fa_hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, sliding_window=4, softcap=2.0)
    assert fa_hf._softcap_mod(2.0) is fa_hf._softcap_mod(2.0)  # one score_mod object per value
    assert torch.equal(out, again)


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True])
def test_sinks_semantics_against_float64_reference(padded):
    """s_aux: one extra logit per head with no value, trained (gradient), on dense and thd paths."""
    from transformers.masking_utils import causal_mask_function

    q, k, v = _qkv()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    pad = torch.ones(2, 10, dtype=torch.bool)
    if padded:
        pad[0, :3] = False
        pad[1, 7:] = False
    out, _ = fa_hf.attention_forward(_Module(), *leaves[:3], pad if padded else None, scaling=0.3, s_aux=leaves[3])
    mask = _hf_mask(causal_mask_function, 2, 10, 10, pad)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    want, _ = reference_attention(*ref_leaves[:3], 0.3, mask=mask, sinks=ref_leaves[3])
    want = want.transpose(1, 2)
    rows = pad[:, :, None, None].expand_as(want)  # padded query rows: 0 here, unspecified there
    assert max_error(out[rows], want[rows]) <= agreement_bound(want[rows])
    cot = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * rows
    got_g = torch.autograd.grad(out, leaves, cot)
    want_g = torch.autograd.grad(want, ref_leaves, cot)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g):
        assert max_error(a, b) <= agreement_bound(b), name


def test_sinks_match_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv()
    module = _Module()
    module.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64))
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 10, 10, dtype=torch.float64).masked_fill(~causal, torch.finfo(torch.float64).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    got, _ = fa_hf.attention_forward(module, q, k, v, None, scaling=0.3, s_aux=module.sinks)
    assert max_error(got, want) <= agreement_bound(want)


def test_gqa_is_not_expanded_and_output_layout():
    q, k, v = _qkv(h=8, hkv=2)
    out, weights = fa_hf.attention_forward(_Module(groups=4), q, k, v, None)
    assert weights is None and out.shape == (2, 10, 8, 16) and out.is_contiguous()


def test_kv_cache_queries_are_bottom_right():
    """Sq < Skv without a mask: the queries are the last Sq keys (a KV cache)."""
    from transformers.masking_utils import causal_mask_function

    q, k, v = _qkv(sq=3, skv=10)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, sliding_window=4)
    from transformers.masking_utils import sliding_window_causal_mask_function

    mask = _hf_mask(sliding_window_causal_mask_function(4), 2, 3, 10, q_offset=7)
    want, _ = reference_attention(q, k, v, 0.25, mask=mask)
    assert max_error(out, want.transpose(1, 2)) <= agreement_bound(want.transpose(1, 2))
    del causal_mask_function


def test_bidirectional_padding_matches_eager_mask():
    from transformers.masking_utils import bidirectional_mask_function

    q, k, v = _qkv()
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :2] = False
    pad[1, 6:] = False
    out, _ = fa_hf.attention_forward(_Module(is_causal=False), q, k, v, pad)
    mask = _hf_mask(bidirectional_mask_function, 2, 10, 10, pad)
    want, _ = reference_attention(q, k, v, 0.25, mask=mask)
    assert max_error(out, want.transpose(1, 2)) <= agreement_bound(want.transpose(1, 2))  # every query row (eager's own semantics)


def test_is_causal_kwarg_overrides_module():
    q, k, v = _qkv()
    a, _ = fa_hf.attention_forward(_Module(is_causal=True), q, k, v, None, is_causal=False)
    b, _ = fa_hf.attention_forward(_Module(is_causal=False), q, k, v, None)
    assert torch.equal(a, b)


def test_reducible_4d_masks_are_served():
    """A prepared eager mask (causal / window + left and right padding) reduces to lengths."""
    from transformers.masking_utils import eager_mask, sliding_window_causal_mask_function

    q, k, v = _qkv()
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[0, :3] = False
    pad[1, 8:] = False
    fn = sliding_window_causal_mask_function(4)
    additive = eager_mask(batch_size=2, q_length=10, kv_length=10, mask_function=fn, attention_mask=pad,
                          dtype=torch.float64)
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, additive, sliding_window=4)
    want, _ = reference_attention(q, k, v, 0.25, mask=_hf_mask(fn, 2, 10, 10, pad))
    want = want.transpose(1, 2)
    rows = pad[:, :, None, None].expand_as(want)
    assert max_error(out[rows], want[rows]) <= agreement_bound(want[rows])
    boolean = _hf_mask(fn, 2, 10, 10, pad)
    out_b, _ = fa_hf.attention_forward(_Module(), q, k, v, boolean, sliding_window=4)
    assert torch.equal(out_b, out)


# ----------------------------------------------------------------------------- the mask function

def _cache_kwarg() -> str:
    """The mask functions' cache argument: `cache` in newer transformers (`past_key_values` there
    is a deprecated alias that warns), `past_key_values` in older ones."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def _mask_kwargs(**over):
    cfg = model_config("llama", "tiny")
    cfg._attn_implementation = FA
    kw = dict(config=cfg, inputs_embeds=torch.zeros(2, 10, 64), attention_mask=None, **{_cache_kwarg(): None})
    kw.update(over)
    return kw


def test_mask_function_never_builds_a_dense_mask():
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    assert create_causal_mask(**_mask_kwargs()) is None
    cfg = model_config("qwen2", "tiny")
    cfg._attn_implementation = FA
    assert create_sliding_window_causal_mask(**_mask_kwargs(config=cfg)) is None
    pad = torch.ones(2, 10, dtype=torch.long)
    pad[0, :4] = 0
    got = create_causal_mask(**_mask_kwargs(attention_mask=pad))
    assert got.dtype == torch.bool and torch.equal(got, pad.bool())
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]] * 2)
    got = create_causal_mask(**_mask_kwargs(position_ids=pos))
    assert got.dtype == torch.int32 and got[0].tolist() == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3]


def test_mask_function_with_a_cache_keeps_keys_up_to_the_last_query():
    # static-cache style: 16 key slots, the first 7 + 3 written, queries at 7..9
    mask = fa_hf.attention_mask_function(2, 3, 16, q_offset=7, kv_offset=0, attention_mask=None)
    assert mask.shape == (2, 10) and bool(mask.all())
    # a dynamic cache: keys are exactly the tokens so far
    assert fa_hf.attention_mask_function(2, 3, 10, q_offset=7, kv_offset=0) is None


def test_mask_patterns_are_parsed():
    from transformers.masking_utils import (and_masks, bidirectional_mask_function, causal_mask_function,
                                            packed_sequence_mask_function, sliding_window_causal_mask_function)

    assert fa_hf.parse_mask_function(causal_mask_function) == (True, None, None)
    assert fa_hf.parse_mask_function(bidirectional_mask_function) == (False, None, None)
    assert fa_hf.parse_mask_function(sliding_window_causal_mask_function(7))[:2] == (True, 7)
    ids = torch.zeros(1, 4, dtype=torch.long)
    p = fa_hf.parse_mask_function(and_masks(causal_mask_function, packed_sequence_mask_function(ids)))
    assert p.causal and p.packed is ids


def test_remapped_packed_positions_are_parsed_and_mean_the_same_mask():
    """transformers >= 5.24 evaluates a packed row's pattern at per-sequence positions
    (remap_positions_for_packed_sequence) next to the packed-sequence mask: brute force over a row
    whose sequences start at arbitrary positions, the parsed pattern is that mask."""
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "remap_positions_for_packed_sequence"):
        pytest.skip("this transformers has no per-sequence position remapping")
    pos = torch.tensor([[5, 6, 7, 8, 0, 1, 2, 40, 41, 42, 43, 44]])
    ids = mu.find_packed_sequence_indices(pos)
    for base, window in ((mu.causal_mask_function, None), (mu.sliding_window_causal_mask_function(2), 2),
                         (mu.bidirectional_mask_function, None)):
        fn = mu.and_masks(mu.remap_positions_for_packed_sequence(base, pos), mu.packed_sequence_mask_function(ids))
        p = fa_hf.parse_mask_function(fn)
        assert (p.window, p.packed is ids) == (window, True)
        q, kv = torch.arange(pos.shape[1]).view(-1, 1), torch.arange(pos.shape[1]).view(1, -1)
        want = (ids[0, q] == ids[0, kv]) & ((kv <= q) | (not p.causal)) & ((q - kv < window) if window else True)
        assert torch.equal(fn(torch.tensor(0), torch.tensor(0), q, kv), want)


def test_remapped_positions_need_the_packed_mask_and_a_known_pattern():
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "remap_positions_for_packed_sequence"):
        pytest.skip("this transformers has no per-sequence position remapping")
    pos = torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(NotImplementedError, match="without the packed-sequence mask"):
        fa_hf.parse_mask_function(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, pos))
    union = mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 1)
    ids = mu.find_packed_sequence_indices(pos)
    with pytest.raises(NotImplementedError, match="union of mask patterns"):
        fa_hf.parse_mask_function(mu.and_masks(mu.remap_positions_for_packed_sequence(union, pos),
                                               mu.packed_sequence_mask_function(ids)))


# ----------------------------------------------------------------------------- refusals

def test_or_mask_function_is_refused():
    from transformers.masking_utils import create_causal_mask

    with pytest.raises(NotImplementedError, match="union of mask patterns"):
        create_causal_mask(**_mask_kwargs(or_mask_function=lambda b, h, q, kv: kv < 2))


def test_custom_and_mask_function_is_refused():
    from transformers.masking_utils import create_causal_mask

    def no_first_key(b, h, q, kv):
        return kv > 0

    with pytest.raises(NotImplementedError, match="custom mask function .*no_first_key"):
        create_causal_mask(**_mask_kwargs(and_mask_function=no_first_key))


def test_chunked_attention_is_refused():
    from transformers.masking_utils import create_chunked_causal_mask

    cfg = model_config("llama", "tiny")
    cfg._attn_implementation = FA
    cfg.attention_chunk_size = 4
    with pytest.raises(NotImplementedError, match="chunked attention"):
        create_chunked_causal_mask(**_mask_kwargs(config=cfg))


def test_biased_4d_mask_is_refused():
    q, k, v = _qkv()
    bias = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="additive bias"):
        fa_hf.attention_forward(_Module(), q, k, v, bias)


def test_irregular_4d_mask_is_refused():
    q, k, v = _qkv()
    m = torch.ones(10, 10, dtype=torch.bool).tril()
    m[5, 2] = False
    with pytest.raises(NotImplementedError, match="cannot be reduced to lengths"):
        fa_hf.attention_forward(_Module(), q, k, v, m.expand(2, 1, 10, 10))


def test_padding_with_holes_is_refused():
    q, k, v = _qkv()
    pad = torch.ones(2, 10, dtype=torch.bool)
    pad[1, 4] = False
    with pytest.raises(NotImplementedError, match="row 1 has padding inside the tokens"):
        fa_hf.attention_forward(_Module(), q, k, v, pad)


def test_block_mask_and_position_bias_are_refused():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="BlockMask"):
        fa_hf.attention_forward(_Module(), q, k, v, object())
    with pytest.raises(NotImplementedError, match="position_bias"):
        fa_hf.attention_forward(_Module(), q, k, v, None, position_bias=torch.zeros(1, 4, 10, 10))


@pytest.mark.parametrize("name", sorted(fa_hf.UNSUPPORTED_KWARGS))
def test_keywords_that_change_the_math_are_refused(name):
    """transformers models pass these through **kwargs (sparse-attention indices, per-token sinks,
    ...): ignored, they would give plain attention silently. None means absent."""
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=name):
        fa_hf.attention_forward(_Module(), q, k, v, None, **{name: torch.zeros(2, 4, 10, 1)})
    out, _ = fa_hf.attention_forward(_Module(), q, k, v, None, **{name: None})
    want, _ = fa_hf.attention_forward(_Module(), q, k, v, None)
    assert torch.equal(out, want)


def test_padding_mask_with_cu_seq_lens_is_refused():
    q, k, v = _qkv(b=1)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="both a padding attention_mask and cu_seq_lens"):
        fa_hf.attention_forward(_Module(), q, k, v, torch.ones(1, 10, dtype=torch.bool), cu_seq_lens_q=cu,
                                cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)


def test_causal_packed_with_different_key_offsets_is_refused():
    q, k, v = _qkv(b=1)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_k different from cu_seq_lens_q"):
        fa_hf.attention_forward(_Module(), q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 10], dtype=torch.int32),
                                cu_seq_lens_k=torch.tensor([0, 5, 10], dtype=torch.int32), max_length_q=6,
                                max_length_k=6)


def test_noncausal_window_with_a_cache_is_refused():
    q, k, v = _qkv(sq=3)
    with pytest.raises(NotImplementedError, match="non-causal sliding window"):
        fa_hf.attention_forward(_Module(is_causal=False), q, k, v, None, sliding_window=2)


def test_output_attentions_warns_once():
    q, k, v = _qkv()
    fa_hf._WARNED.clear()
    with pytest.warns(UserWarning, match="does not return attention weights"):
        fa_hf.attention_forward(_Module(), q, k, v, None, output_attentions=True)


# ----------------------------------------------------------------------------- dropout

def _dropout_or_xfail(fn):
    try:
        return fn()
    except NotImplementedError as exc:
        if "dropout" in str(exc):
            pytest.xfail(f"the core refuses attention dropout on this backend: {exc}")
        raise


def test_dropout_zero_is_exact():
    q, k, v = _qkv()
    a, _ = fa_hf.attention_forward(_Module(), q, k, v, None, dropout=0.0)
    b, _ = fa_hf.attention_forward(_Module(), q, k, v, None)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_dropout_statistics_and_forward_backward_consistency():
    """p > 0: with V = I the output rows are the dropped, rescaled weights: the kept fraction is
    1 - p, their mean over seeds is the p = 0 output, and the backward uses the forward's mask
    (dV = out^T dO exactly, since out = M @ I)."""
    p, n = 0.3, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64).expand(1, 2, n, n).contiguous()
    module = _Module(groups=1)
    full, _ = fa_hf.attention_forward(module, q, k, eye, None, scaling=0.1)
    outs = []
    for seed in range(200):
        torch.manual_seed(seed)
        out, _ = _dropout_or_xfail(lambda: fa_hf.attention_forward(module, q, k, eye, None, dropout=p, scaling=0.1))
        outs.append(out)
    stack = torch.stack(outs)
    allowed = full > 0
    kept = (stack[:, allowed] != 0).double().mean()
    assert abs(float(kept) - (1 - p)) < 0.02
    mean, sd = stack.mean(0), stack.std(0)
    assert float(((mean - full).abs() - 5 * sd / math.sqrt(len(outs))).max()) <= 1e-12
    v = eye.clone().requires_grad_(True)
    torch.manual_seed(7)
    out, _ = fa_hf.attention_forward(module, q, k, v, None, dropout=p, scaling=0.1)
    d_o = torch.randn(out.shape, dtype=torch.float64, generator=gen)
    (dv,) = torch.autograd.grad(out, v, d_o)
    m = out.transpose(1, 2)  # (B, H, Sq, Skv): the dropped weights
    want = m.transpose(-1, -2) @ d_o.transpose(1, 2)
    assert max_error(dv, want) <= agreement_bound(want)


@pytest.mark.slow
def test_model_dropout_in_training():
    m64, _ = models("llama", attention_dropout=0.2)
    batch = make_batch("dense")
    torch.manual_seed(0)
    _dropout_or_xfail(lambda: run(m64, FA, batch, train=True))
    a, _ = run(m64, FA, batch, train=False)
    b, _ = run(m64, "eager", batch, train=False)
    assert max_error(a, b) <= agreement_bound(b)


# ----------------------------------------------------------------------------- the benchmark harness

@pytest.mark.slow
def test_models_bench_cpu_smoke():
    from benchmarks import models as bench

    result = bench.run_model("gemma2", True, torch.device("cpu"), size="tiny", impls=(FA, "sdpa", "eager"),
                             shapes=(("B2 S16", 2, 16), ("packed 32", 1, 32)), curve_label="B2 S16",
                             curve_steps=3, timed_steps=1, warmup=1, check_len=12)
    assert result.failures == []
    rows = {(r["batch"], r["impl"]): r for r in result.rows if r["suite"] == "models"}
    assert rows[("B2 S16", FA)]["check"].startswith("ok") and rows[("B2 S16", "eager")]["check"].startswith("ok")
    # transformers' sdpa has no softcap argument: before 5.23 Gemma 2's softcap is dropped and the
    # check says so; later versions refuse the model under sdpa, and the row says that instead
    sdpa = rows[("B2 S16", "sdpa")]
    assert sdpa["check"].startswith("WRONG") or (sdpa["check"].startswith("unsupported")
                                                 and sdpa["note"].startswith("not run")), sdpa
    assert sdpa["attention"].startswith("softcap IGNORED")
    assert rows[("B2 S16", FA)]["attention"] == "softcap applied"
    assert rows[("B2 S16", FA)]["loss_end"] == pytest.approx(rows[("B2 S16", "eager")]["loss_end"], rel=1e-4)
    curve = [r for r in result.rows if r["suite"] == "models_loss"]
    assert [r["step"] for r in curve] == [0, 2] and all(r["batch"] == "B2 S16" for r in curve)
    assert curve[-1][FA] == pytest.approx(curve[-1]["eager"], rel=1e-4)
