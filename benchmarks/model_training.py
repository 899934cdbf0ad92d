"""What the `models` benchmark runs on one model: the logits check against eager on fp32
weights, training runs of one attention implementation (losses, step ms, peak memory, recompile
limit hits) and the profiled GPU ms per training step.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import statistics
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

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


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()

