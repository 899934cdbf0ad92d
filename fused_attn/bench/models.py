"""Real models: training throughput and loss curves of Hugging Face transformers models.

    python -m fused_attn bench models [--quick]

Random-initialised Llama-, Gemma-2- and gpt-oss-style models (8 layers, hidden 1024, 16 query /
4 key-value heads of dim 64, MLP 2816 (gpt-oss: 4 experts of 1408, top 2), vocab 32000: 170-260M
parameters) train in bf16 (forward, backward, AdamW step) with each `attn_implementation`:
fused_attn, and transformers' sdpa, flex_attention and eager where the model supports them.

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
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import statistics
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .runner import SuiteResult

FAMILIES = ("llama", "gemma2", "qwen2", "gpt_oss")
BENCH_FAMILIES = ("llama", "gemma2", "gpt_oss")
IMPLS = ("fused_attn", "sdpa", "flex_attention", "eager")

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256, initializer_range=0.2)
_BENCH = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=8192,
              initializer_range=0.02)


# ----------------------------------------------------------------------------- configurations

def model_config(family: str, size: str = "bench", window: Optional[int] = None, **overrides):
    """A transformers config of `family` ("llama", "gemma2", "qwen2", "gpt_oss").

    size "tiny" (tests: 2 layers, hidden 64, 4/2 heads of dim 16, vocab 128, windows of 4 tokens,
    Gemma 2 softcap 5, initializer_range 0.2 so that attention, softcap and sinks matter) or
    "bench" (8 layers, hidden 1024, 16/4 heads of dim 64, vocab 32000; windows: Gemma 2 and
    Qwen 2 1024, gpt-oss 128). window: the sliding window (not Llama); overrides: config fields.
    """
    import transformers as tf

    tiny = size == "tiny"
    kw = dict(_TINY if tiny else _BENCH)
    kw.update(overrides)
    extra: Dict[str, object] = {}
    if family == "llama":
        cls = tf.LlamaConfig
    elif family == "qwen2":
        cls = tf.Qwen2Config
        extra = dict(use_sliding_window=True, sliding_window=window or (4 if tiny else 1024), max_window_layers=1)
    elif family == "gemma2":
        cls = tf.Gemma2Config
        extra = dict(sliding_window=window or (4 if tiny else 1024), query_pre_attn_scalar=kw["head_dim"],
                     attn_logit_softcapping=5.0 if tiny else 50.0, final_logit_softcapping=30.0)
    elif family == "gpt_oss":
        cls = tf.GptOssConfig
        extra = dict(sliding_window=window or (4 if tiny else 128), num_local_experts=4, num_experts_per_tok=2,
                     intermediate_size=32 if tiny else 1408)
    else:
        raise ValueError(f"unknown model family {family!r}; choose from {FAMILIES}")
    for name, value in extra.items():
        if name not in overrides:
            kw[name] = value
    return cls(**kw)


def build_model(config, attn_implementation: str = "eager", *, dtype: torch.dtype = torch.float32,
                device: Optional[torch.device] = None, seed: int = 0):
    """A randomly initialised causal LM for `config` (seeded), in `dtype` on `device`."""
    import transformers as tf

    torch.manual_seed(seed)
    extra = {}
    if config.model_type == "gpt_oss":
        # transformers' grouped_mm experts on CUDA (its default): GPU-bound steps, so the attention
        # implementations compare stably. Measured on H200 with transformers 5.17 (B4 S2048): the
        # backward of grouped_mm's token gather takes 122 of the step's 170 ms of GPU time; the
        # per-expert loop ("eager") needs 47 ms of GPU, but its ~140-170 host syncs per step (one
        # per expert hit) make the step host-bound (wall ~95-120 ms) and the implementations' ratios
        # swing 0.75x-1.24x between runs. grouped_mm has no float64 / CPU path: eager there.
        extra["experts_implementation"] = "eager" if dtype == torch.float64 or device is None or \
            torch.device(device).type != "cuda" else "grouped_mm"
    with torch.device(device or "cpu"):
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, **extra)
    return model.to(dtype)


def attention_features(impl: str, family: str) -> str:
    """Whether `impl`'s transformers attention function takes the model's real attention
    arguments (softcap for Gemma 2, s_aux sinks for gpt-oss): read from its signature."""
    want = {"gemma2": "softcap", "gpt_oss": "s_aux"}.get(family)
    if want is None:
        return "-"
    label = {"softcap": "softcap", "s_aux": "sinks"}[want]
    if impl == "eager":
        return f"{label} applied"
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping.get(impl)
    if fn is None:
        return "?"
    params = inspect.signature(fn).parameters
    return f"{label} applied" if want in params else f"{label} IGNORED (no {want} argument)"


# ----------------------------------------------------------------------------- data

class MarkovTokens:
    """Token streams where each token is followed by one of `branch` fixed random successors."""

    def __init__(self, vocab: int, seed: int = 0, branch: int = 4) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.table = torch.randint(0, vocab, (vocab, branch), generator=self.gen)
        self.vocab, self.branch = vocab, branch

    def sample(self, batch: int, length: int) -> torch.Tensor:
        out = torch.empty(batch, length, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (batch,), generator=self.gen)
        pick = torch.randint(0, self.branch, (batch, length), generator=self.gen)
        for t in range(1, length):
            out[:, t] = self.table[out[:, t - 1], pick[:, t]]
        return out

    def dense_batch(self, batch: int, length: int, device) -> Dict[str, torch.Tensor]:
        ids = self.sample(batch, length).to(device)
        return {"input_ids": ids, "labels": ids}

    def packed_batch(self, total: int, min_len: int, max_len: int, device) -> Dict[str, object]:
        """One row of `total` tokens: documents of random lengths, flattened as
        DataCollatorWithFlattening(return_flash_attn_kwargs=True) does."""
        from transformers import DataCollatorWithFlattening

        lengths, left = [], total
        while left > 0:
            n = min(left, int(torch.randint(min_len, max_len + 1, (1,), generator=self.gen)))
            lengths.append(n)
            left -= n
        feats = [{"input_ids": self.sample(1, n)[0].tolist()} for n in lengths]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


# ----------------------------------------------------------------------------- correctness

def check_logits(model, impls: Sequence[str], batch: Dict[str, object], family: str) -> Dict[str, Tuple[str, bool]]:
    """Per impl: (text, ok) comparing its logits (model's dtype) with eager on an fp32 copy,
    bound = 2 x |eager in the model's dtype - exact| + 4e-3 x max(1, max|exact|) on real tokens."""
    from fused_attn.testing import bound_from, max_error

    exact_model = copy.deepcopy(model).float()
    exact = _logits(exact_model, "eager", batch)
    del exact_model
    base = _logits(model, "eager", batch)
    bound = bound_from(base, exact, base.dtype, floor=4e-3)
    out: Dict[str, Tuple[str, bool]] = {}
    for impl in impls:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = _logits(model, impl, batch)
        except Exception as exc:  # the impl cannot run this model: reported in its rows
            out[impl] = (f"unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
                         False)
            continue
        err = max_error(got, exact)
        text = f"{'ok' if err <= bound else 'WRONG'} {err:.2e} (bound {bound:.2e})"
        if any(w.category.__name__ == "FallbackWarning" for w in caught):
            text += "; ran on the reference backend (FallbackWarning)"
        out[impl] = (text, err <= bound)
    return out


def _logits(model, impl: str, batch: Dict[str, object]) -> torch.Tensor:
    model.set_attn_implementation(impl)
    model.eval()
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return model(**inputs, use_cache=False).logits.float()


# ----------------------------------------------------------------------------- training runs

def train_run(model, impl: str, batches: Sequence[Dict[str, object]], init_state: Dict[str, torch.Tensor],
              warmup: int, device: torch.device) -> Dict[str, object]:
    """Train from `init_state` on `batches` with `impl`: losses, median step ms after `warmup`
    steps, peak memory, and whether a FallbackWarning was raised. Raises what the impl raises."""
    model.load_state_dict(init_state)
    model.set_attn_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0,
                            fused=device.type == "cuda")
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with warnings.catch_warnings(record=True) as caught, recompile_limit_hits() as limit_hits:
            warnings.simplefilter("always")
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                _train_step(model, opt, batch, losses)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    finally:
        del opt
    return {"losses": [float(x) for x in losses], "step_ms": statistics.median(times) if times else None,
            "peak_gb": peak, "fallback": any(w.category.__name__ == "FallbackWarning" for w in caught),
            "uncompiled": bool(limit_hits)}


#: The logger through which torch.compile reports a function that hit its recompile limit (the
#: function then runs uncompiled: for flex_attention, the whole score matrix materialised).
DYNAMO_LOGGER = "torch._dynamo.convert_frame"


class _Collect(logging.Handler):
    def __init__(self, hits: List[str]) -> None:
        super().__init__(logging.WARNING)
        self.hits = hits

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.hits.append(message.splitlines()[0])


@contextlib.contextmanager
def recompile_limit_hits():
    """A list that collects torch.compile's "hit config.recompile_limit" reports inside the block."""
    hits: List[str] = []
    handler = _Collect(hits)
    logger = logging.getLogger(DYNAMO_LOGGER)
    logger.addHandler(handler)
    try:
        yield hits
    finally:
        logger.removeHandler(handler)


def _train_step(model, opt, batch: Dict[str, object], losses: List[torch.Tensor]) -> None:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.detach())


def _guarded_run(model, impl: str, batches: Sequence[Dict[str, object]], init_state: Dict[str, torch.Tensor],
                 warmup: int, device: torch.device) -> Tuple[Optional[Dict[str, object]], Optional[str]]:
    """train_run, or (None, why) when the impl runs out of memory or fails; frees cached memory."""
    try:
        return train_run(model, impl, batches, init_state, warmup, device), None
    except torch.cuda.OutOfMemoryError:
        return None, "OOM"
    except Exception as exc:
        return None, f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        _free(device)


def gpu_ms_per_step(model, impl: str, batches: Sequence[Dict[str, object]], init_state: Dict[str, torch.Tensor],
                    device: torch.device, profiled: int = 3) -> float:
    """Device kernel ms per training step of `impl` (a torch.profiler pass over the last `profiled`
    batches after the others warmed up): what the step costs the GPU, host gaps excluded."""
    from .steps import profile_steps

    model.load_state_dict(init_state)
    model.set_attn_implementation(impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    losses: List[torch.Tensor] = []
    try:
        for batch in batches[:-profiled]:
            _train_step(model, opt, batch, losses)
        return profile_steps(lambda batch: _train_step(model, opt, batch, losses), batches[-profiled:],
                             device)["gpu_ms_per_step"]
    finally:
        del opt
        _free(device)


def _fill_gpu_ms(row: Dict[str, object], model, impl: str, batches: Sequence[Dict[str, object]],
                 init_state: Dict[str, torch.Tensor], device: torch.device) -> None:
    """A deferred profiler pass (`SuiteResult.defer_profile`): the row's gpu_ms."""
    row["gpu_ms"] = gpu_ms_per_step(model, impl, batches, init_state, device)


def _tokens(batch: Dict[str, object]) -> int:
    return int(batch["input_ids"].numel())


def run_model(family: str, quick: bool, device: torch.device, *, size: str = "bench",
              impls: Sequence[str] = IMPLS, shapes: Optional[Sequence[Tuple[str, int, int]]] = None,
              curve_label: str = "B4 S2048", curve_steps: Optional[int] = None, timed_steps: int = 10,
              warmup: int = 3, check_len: Optional[int] = None, rounds: int = 3) -> SuiteResult:
    """One model family: the logits check, then per batch shape `rounds` training runs of every
    impl in turn (losses, curves and memory from the first; step ms: the best round's median);
    the loss-curve rows (suite "models_loss") follow the timing rows."""
    from fused_attn.integrations.transformers import register

    register()
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
        if impl == "fused_attn" and not ok:
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
                    if impl == "fused_attn" and failure != "OOM":
                        result.failures.append(f"models / {family} / {label}: fused_attn {failure}")
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


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(quick: bool, device: torch.device, families: Sequence[str] = BENCH_FAMILIES) -> SuiteResult:
    """The `models` suite (see the module docstring)."""
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
    for family in families:
        print(f"models: {family} ...", flush=True)
        result.extend(run_model(family, quick, device))
    return result


def cpu_smoke() -> SuiteResult:
    """The suite's machinery at tiny sizes on CPU (reference backend): every family, two shapes."""
    result = SuiteResult()
    for family in FAMILIES:
        result.extend(run_model(family, True, torch.device("cpu"), size="tiny", impls=("fused_attn", "sdpa", "eager"),
                                shapes=(("B2 S32", 2, 32), ("packed 64", 1, 64)), curve_label="B2 S32",
                                curve_steps=4, timed_steps=2, warmup=1, check_len=24))
    return result
