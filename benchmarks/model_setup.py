"""The models of the `models` benchmark: Hugging Face configurations per family (tiny for tests,
bench size), random-initialised causal LMs, which attention arguments an implementation takes, and
the learnable Markov-chain token data they train on.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch

FAMILIES = ("llama", "gemma2", "qwen2", "gpt_oss")

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

