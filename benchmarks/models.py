"""Real models: training throughput and loss curves of Hugging Face transformers models.

    python -m fused_attn bench models [--quick]

Random-initialised Llama-, Gemma-2- and gpt-oss-style models (8 layers, hidden 1024, 16 query /
4 key-value heads of dim 64, MLP 2816 (gpt-oss: 4 experts of 1408, top 2), vocab 32000: 170-260M
parameters) train in bf16 (forward, backward, AdamW step) with each `attn_implementation`:
fused_attn, and transformers' sdpa, flex_attention and eager where the model supports them; on a
GPU where flash-attn-4 runs also fused_attn with its FA4 engine forced ("fused_attn_fa4") and
transformers' own "flash_attention_4" where this transformers has it. On request (`--impls`),
"fused_attn_cudnn": fused_attn with its cuDNN engine forced, to set `backend="auto"`'s choices
(FA4, cuDNN, or FA4's forward with cuDNN's backward) against one engine in the same run.

Per model, first the correctness check: the logits of one batch (B1 S1024; quick: S512) from each
implementation in bf16 against eager on an fp32 copy of the weights, within the project's rule
(2 x the error of eager in bf16 + 4e-3 x max|logit|). Then, per batch shape (B2 S4096, B4 S2048
and a packed row of 8192 tokens of mixed-length documents with cu_seq_lens), every
implementation trains from the same initial weights on the same batches, the implementations
taking turns over 3 rounds: rows with tokens/s, step ms (the best round's median after warm-up),
GPU ms per step (kernel time of a profiled pass: the step's GPU work without host gaps; the
passes run after every timing of the process, `SuiteResult.profiled`), peak
memory, the last loss and whether the implementation applies the model's real attention (Gemma 2's softcap, gpt-oss's sinks: transformers' sdpa has
no softcap argument, so it silently drops Gemma 2's softcap). The B4 S2048 run is long enough
to print loss curves (loss at steps 0, 10, 20, ...; 200 steps, quick: 30), which should agree
across implementations that compute the same attention. Each family starts from a fresh
torch.compile cache (as a training process would), and a row whose implementation hit
torch.compile's recompile limit (it then runs uncompiled) says so in its note.

The data is learnable: each token is followed by one of 4 fixed random successors, so the loss
falls from ln(32000) = 10.4 towards ln(4) = 1.39 as the model learns the table.

This module runs the suite; the models and data come from `model_setup`, the logits check and
the training runs from `model_training`.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .model_setup import FAMILIES, MarkovTokens, attention_features, build_model, model_config  # noqa: F401
from .model_training import (DYNAMO_LOGGER, _fill_gpu_ms, _free, _guarded_run, check_logits,  # noqa: F401
                             gpu_ms_per_step, recompile_limit_hits, train_run)
from .runner import SuiteResult

BENCH_FAMILIES = ("llama", "gemma2", "gpt_oss")
IMPLS = ("fused_attn", "sdpa", "flex_attention", "eager")
#: fused_attn with its flash-attn-4 engine forced, and transformers' own flash-attn-4 attention
FA4_OURS, FA4_PEER = "fused_attn_fa4", "flash_attention_4"
#: fused_attn with its cuDNN engine forced (only when asked for)
CUDNN_OURS = "fused_attn_cudnn"


def default_impls(device: torch.device) -> Tuple[str, ...]:
    """IMPLS, plus on a GPU where flash-attn-4 runs: fused_attn on its FA4 engine (FA4_OURS) and,
    where this transformers has it, transformers' FA4 attention (FA4_PEER)."""
    if device.type != "cuda":
        return IMPLS
    from fused_attn.backends.fa4 import install

    if install.unavailable() is not None or install.arch_refusal(device) is not None:
        return IMPLS
    from transformers import AttentionInterface

    peer = (FA4_PEER,) if FA4_PEER in AttentionInterface._global_mapping else ()
    return IMPLS[:1] + (FA4_OURS,) + IMPLS[1:] + peer


def _ours(impl: str) -> bool:
    return impl in ("fused_attn", FA4_OURS, CUDNN_OURS)


def _tokens(batch: Dict[str, object]) -> int:
    return int(batch["input_ids"].numel())


def run_model(family: str, quick: bool, device: torch.device, *, size: str = "bench",
              impls: Optional[Sequence[str]] = None, shapes: Optional[Sequence[Tuple[str, int, int]]] = None,
              curve_label: str = "B4 S2048", curve_steps: Optional[int] = None, timed_steps: int = 10,
              warmup: int = 3, check_len: Optional[int] = None, rounds: int = 3) -> SuiteResult:
    """One model family (impls: default_impls(device) when None): the logits check, then per batch
    shape `rounds` training runs of every impl in turn (losses, curves and memory from the first; step ms: the best round's median);
    the loss-curve rows (suite "models_loss") follow the timing rows."""
    from fused_attn.integrations.transformers import register

    register()
    impls = tuple(impls) if impls is not None else default_impls(device)
    if FA4_OURS in impls:
        register(FA4_OURS, backend="fa4")
    if CUDNN_OURS in impls:
        register(CUDNN_OURS, backend="cudnn")
    # a fresh torch.compile cache per family: transformers compiles flex_attention once per process,
    # and the shapes and score_mods of earlier families count against dynamo's recompile limit, past
    # which flex_attention runs uncompiled (one H200 run: Gemma 2's packed flex step 450 ms of GPU and
    # 37.7 GB after the Llama family, 53 ms in a process of its own)
    torch._dynamo.reset()
    result = SuiteResult()
    if device.type == "cuda":  # the same for this family's profiler passes, which run after every family's timings
        result.defer_profile(f"models / {family}: a fresh torch.compile cache", torch._dynamo.reset)
    curve_rows: List[Dict[str, object]] = []
    uncompiled: set = set()  # impls whose torch.compile hit dynamo's recompile limit in this family
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(family, size)
    model = build_model(config, "eager", dtype=dtype, device=device)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(p.numel() for p in model.parameters())
    data = MarkovTokens(config.vocab_size, seed=1)
    check_len = check_len or (512 if quick else 1024)
    checks = check_logits(model, impls, data.dense_batch(1, check_len, device), family)
    for impl, (text, ok) in checks.items():
        if _ours(impl) and not ok:
            result.failures.append(f"models / {family}: fused_attn logits check: {text}")
    shapes = shapes or (("B2 S4096", 2, 4096), ("B4 S2048", 4, 2048), ("packed 8192", 1, 8192))
    curve_steps = curve_steps or (30 if quick else 200)
    for label, b, s in shapes:
        curve = label == curve_label
        steps = curve_steps if curve else warmup + timed_steps
        if label.startswith("packed"):
            batches = [data.packed_batch(s, max(8, s // 32), max(16, s // 4), device) for _ in range(steps)]
        else:
            batches = [data.dense_batch(b, s, device) for _ in range(steps)]
        tokens = sum(_tokens(x) for x in batches) / len(batches)
        rows: Dict[str, Dict[str, object]] = {}
        for impl in impls:
            rows[impl] = {"suite": "models", "model": family, "params_M": n_params / 1e6, "batch": label,
                          "impl": impl, "tokens_per_s": None, "step_ms": None, "gpu_ms": None, "peak_gb": None,
                          "loss_end": None, "check": checks[impl][0], "attention": attention_features(impl, family),
                          "note": ""}
            if checks[impl][0].startswith("unsupported"):
                rows[impl]["note"] = "not run (the logits check could not run it)"
        live = [impl for impl in impls if not rows[impl]["note"]]
        round_ms: Dict[str, List[float]] = {impl: [] for impl in live}
        curves: Dict[str, List[float]] = {}
        for rnd in range(rounds):  # the implementations take turns: a slow spell hits one round of each
            for impl in list(live):
                run, failure = _guarded_run(model, impl, batches if rnd == 0 else batches[:warmup + timed_steps],
                                            init_state, min(warmup, steps - 1), device)
                if failure is not None:
                    rows[impl]["note"] = failure
                    if _ours(impl) and failure != "OOM":
                        result.failures.append(f"models / {family} / {label}: {impl} {failure}")
                    live.remove(impl)
                    continue
                round_ms[impl].append(run["step_ms"])
                if rnd == 0:
                    rows[impl].update(peak_gb=run["peak_gb"], loss_end=run["losses"][-1], _loss0=run["losses"][0])
                    if run["fallback"]:
                        rows[impl]["note"] = "fused_attn ran (partly) on the reference backend: FallbackWarning"
                    if curve:
                        curves[impl] = run["losses"]
                if run["uncompiled"]:  # reported once per compiled function: it stays uncompiled after
                    uncompiled.add(impl)
        for impl in uncompiled & set(rows):
            note = "torch.compile hit its recompile limit in this family's runs: parts of the step may run uncompiled"
            rows[impl]["note"] = (rows[impl]["note"] + "; " if rows[impl]["note"] else "") + note
        for impl in live:
            ms = min(round_ms[impl])
            rows[impl].update(step_ms=ms, tokens_per_s=tokens / (ms / 1e3) if ms else None)
            if device.type == "cuda":
                result.defer_profile(f"models / {family} / {label} / {impl}", functools.partial(
                    _fill_gpu_ms, rows[impl], model, impl, batches[:warmup + timed_steps], init_state, device))
        result.rows += list(rows.values())
        _flag_first_losses(result.rows, family, label)
        if curves:
            curve_rows += loss_rows(family, label, curves)
    del model  # the deferred profiler passes hold it until they have run
    _free(device)
    result.rows += curve_rows
    return result


def _flag_first_losses(rows: List[Dict[str, object]], family: str, label: str) -> None:
    """Same weights and batches: every impl's step-0 loss should equal fused_attn's. A peer whose
    does not computes a different attention here (e.g. it ignores softcap, or attends across
    packed documents: gpt-oss in transformers 5.17 does not give position_ids to its mask
    functions, so eager / flex see one long document); say so in its row."""
    mine = [r for r in rows if r["model"] == family and r["batch"] == label]
    first = {r["impl"]: r.get("_loss0") for r in mine}
    ref = first.get("fused_attn")
    for r in mine:
        loss0 = r.pop("_loss0", None)
        if ref is None or loss0 is None or r["impl"] == "fused_attn":
            continue
        if abs(loss0 - ref) > 1e-2 * abs(ref):
            r["note"] = (r["note"] + "; " if r["note"] else "") + f"step-0 loss {loss0:.4f} != fused_attn's {ref:.4f}"


def loss_rows(family: str, label: str, curves: Dict[str, List[float]], every: int = 10) -> List[Dict[str, object]]:
    """Rows of a loss-curve table: the loss at steps 0, every, 2*every, ... and the last step, per impl."""
    n = max(len(v) for v in curves.values())
    steps = sorted(set(list(range(0, n, every)) + [n - 1]))
    return [{"suite": "models_loss", "model": family, "batch": label, "step": i,
             **{impl: (v[i] if i < len(v) else None) for impl, v in curves.items()}} for i in steps]


def run(quick: bool, device: torch.device, families: Optional[Sequence[str]] = None,
        impls: Optional[Sequence[str]] = None,
        after_family: Optional[Callable[[SuiteResult], None]] = None) -> SuiteResult:
    """The `models` suite (see the module docstring). families: None for BENCH_FAMILIES; impls: a
    subset of `default_impls(device)`
    (None: all); after_family(result so far) runs after each family (the CLI writes its files
    there, so a run cut short keeps the families it finished)."""
    result = SuiteResult(notes=[
        "tokens_per_s / step_ms: training steps (forward, backward, AdamW) in bf16: 3 rounds in which the "
        "implementations take turns, each the median step after 3 warm-up steps; the best round counts; "
        "gpu_ms: device kernel time per step (torch.profiler, 3 steps), host gaps excluded; "
        "check: bf16 logits vs eager on fp32 weights within 2 x (eager bf16 error) + 4e-3 x max|logit|; attention: "
        "whether the impl takes the model's softcap (Gemma 2) / sinks (gpt-oss)"])
    try:
        import transformers  # noqa: F401
    except ImportError:
        result.notes.append("transformers is not installed: pip install -e '.[hf]' from the checkout")
        print("models suite: transformers is not installed (pip install -e '.[hf]' from the checkout); skipped")
        return result
    for family in families or BENCH_FAMILIES:
        print(f"models: {family} ...", flush=True)
        result.extend(run_model(family, quick, device, impls=impls))
        if after_family is not None:
            after_family(result)
    return result


def cpu_smoke() -> SuiteResult:
    """The suite's machinery at tiny sizes on CPU (reference backend): every family, two shapes."""
    result = SuiteResult()
    for family in FAMILIES:
        result.extend(run_model(family, True, torch.device("cpu"), size="tiny", impls=("fused_attn", "sdpa", "eager"),
                                shapes=(("B2 S32", 2, 32), ("packed 64", 1, 64)), curve_label="B2 S32",
                                curve_steps=4, timed_steps=2, warmup=1, check_len=24))
    return result
