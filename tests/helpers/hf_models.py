"""Tiny transformers models (`benchmarks.models`), batches of every kind (dense, padded,
packed), one forward/backward run with exact float64 eager attention, and the model-level tolerance
rule: shared by tests/integrations/test_transformers.py (CPU) and its GPU twin.

    exact = eager in float64 (its softmax too: transformers' eager upcasts to float32 only,
            which `exact_eager` raises to float64), or for packed batches eager run on every
            document alone (what packing means);
    float64 results: float32 agreement (`fused_attn.testing.agreement_bound`: some modules
            compute in float32 even in float64 models, Gemma's RMSNorm);
    lower precision: `fused_attn.testing.bound_from` of eager in that dtype.
"""

from __future__ import annotations

import contextlib
import copy
from functools import lru_cache
from typing import Dict, List, Tuple
from unittest import mock

import torch
import torch.nn.functional as F

from benchmarks.models import build_model, model_config
from fused_attn.testing import agreement_bound, bound_from, max_error

FA = "fused_attn"
KINDS = ("dense", "left_pad", "right_pad", "packed", "packed_kwargs", "packed_rows")


@contextlib.contextmanager
def exact_eager():
    """transformers' eager attention runs its softmax in float32 even for float64 models (and
    its float64 mask min then overflows to -inf: NaN rows); run float64 softmaxes in float64."""
    orig = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64:
            dtype = torch.float64
        return orig(input, dim=dim, dtype=dtype)

    with mock.patch.object(torch.nn.functional, "softmax", softmax):
        yield


# ----------------------------------------------------------------------------- models and batches

@lru_cache(maxsize=None)
def _models(family: str, **overrides) -> Tuple[torch.nn.Module, torch.nn.Module]:
    cfg = model_config(family, "tiny", **dict(overrides))
    m64 = build_model(cfg, "eager", dtype=torch.float64)
    m32 = copy.deepcopy(m64).float()
    return m64, m32


def models(family: str, **overrides):
    return _models(family, **overrides)


def _docs(gen: torch.Generator, lengths, vocab: int = 128) -> List[List[int]]:
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def make_batch(kind: str, seed: int = 0, length: int = 12, vocab: int = 128) -> Dict[str, object]:
    """Inputs, the labels, the positions whose logits count ("valid") and, for packed kinds, the
    documents of each row. `length`: tokens per row (a multiple of 12)."""
    gen = torch.Generator().manual_seed(seed)
    u = length // 12
    if kind.startswith("packed"):
        from transformers import DataCollatorWithFlattening

        if kind == "packed_rows":  # two rows, each holding two documents (position_ids restart)
            docs = _docs(gen, [5 * u, 7 * u, 8 * u, 4 * u], vocab)
            ids = torch.tensor([docs[0] + docs[1], docs[2] + docs[3]])
            pos = torch.tensor([list(range(5 * u)) + list(range(7 * u)), list(range(8 * u)) + list(range(4 * u))])
            labels = torch.tensor([[-100] + docs[0][1:] + [-100] + docs[1][1:],
                                   [-100] + docs[2][1:] + [-100] + docs[3][1:]])
            return {"inputs": {"input_ids": ids, "position_ids": pos}, "labels": labels,
                    "docs": [docs[:2], docs[2:]], "valid": torch.ones_like(ids, dtype=torch.bool)}
        docs = _docs(gen, [5 * u, 7 * u, 4 * u], vocab)
        coll = DataCollatorWithFlattening(return_flash_attn_kwargs=kind == "packed_kwargs")
        batch = coll([{"input_ids": d} for d in docs])
        labels = batch.pop("labels")
        return {"inputs": dict(batch), "labels": labels, "docs": [docs],
                "valid": torch.ones_like(batch["input_ids"], dtype=torch.bool)}
    ids = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    if kind == "left_pad":
        mask[0, :3 * u] = 0
        mask[1, :1] = 0
    elif kind == "right_pad":
        mask[1, 8 * u:] = 0
    inputs = {"input_ids": ids}
    if kind != "dense":
        inputs["attention_mask"] = mask
    # a target counts only if the position predicting it is a token: with left padding, the last
    # pad position "predicts" the first token, and pad positions' outputs are unspecified
    # (eager: an average over every key; fused_attn, like flash-attention: 0)
    prev_pad = torch.cat([torch.zeros(2, 1, dtype=torch.long), mask[:, :-1]], dim=1) == 0
    labels = ids.masked_fill((mask == 0) | (prev_pad & (torch.arange(length) > 0)), -100)
    return {"inputs": inputs, "labels": labels, "docs": None, "valid": mask.bool()}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token cross entropy over labelled targets, their count)."""
    flat = logits[:, :-1].reshape(-1, logits.shape[-1])
    target = labels[:, 1:].reshape(-1)
    return F.cross_entropy(flat.float() if flat.dtype == torch.bfloat16 else flat, target, ignore_index=-100,
                           reduction="sum"), (target != -100).sum()


def run(model, impl: str, batch: Dict[str, object], per_document: bool = False,
        train: bool = True) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(logits float64 detached, {param name: grad float64}) of one forward/backward.

    per_document: run each packed document alone (B=1) and concatenate (the packed reference)."""
    model.set_attn_implementation(impl)
    model.train(train)
    model.zero_grad(set_to_none=True)
    dev = next(model.parameters()).device
    with exact_eager():
        if per_document:  # every document alone, B=1, concatenated back into the batch's rows
            rows, total, count = [], 0.0, 0
            for row in batch["docs"]:
                pieces = []
                for doc in row:
                    ids = torch.tensor([doc], device=dev)
                    logits = model(input_ids=ids, use_cache=False).logits
                    s, n = causal_lm_loss(logits, ids.masked_fill(torch.arange(len(doc), device=dev) == 0, -100))
                    total, count = total + s, count + n
                    pieces.append(logits)
                rows.append(torch.cat(pieces, dim=1))
            logits, loss = torch.cat(rows, dim=0), total / count
        else:
            inputs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in batch["inputs"].items()}
            logits = model(**inputs, use_cache=False).logits
            s, n = causal_lm_loss(logits, batch["labels"].to(dev))
            loss = s / n
        loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().cpu()
             for n, p in model.named_parameters()}
    return logits.detach().double().cpu(), grads


def assert_model_close(got, exact, base, dtype: torch.dtype, valid: torch.Tensor, what: str) -> None:
    """The model-level tolerance rule (module docstring) for logits (valid positions) and grads."""
    (g_logits, g_grads), (e_logits, e_grads) = got, exact

    def bound(e, b):
        if dtype == torch.float64:  # some modules compute in float32 even in float64 models (Gemma's RMSNorm)
            return agreement_bound(e, torch.float32)
        return bound_from(b, e, dtype)

    e, g = e_logits[valid], g_logits[valid]
    b = None if base is None else base[0][valid]
    err, bd = max_error(g, e), bound(e, b)
    assert err <= bd, f"{what}: logits max error {err:.3e} > bound {bd:.3e}"
    for name, eg in e_grads.items():
        bd = bound(eg, None if base is None else base[1][name])
        err = max_error(g_grads[name], eg)
        assert err <= bd, f"{what}: grad of {name} max error {err:.3e} > bound {bd:.3e}"
