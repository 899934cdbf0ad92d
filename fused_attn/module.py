"""`DotProductAttention`: an nn.Module holding the attention configuration (Transformer Engine style).

The module resolves its `AttentionSpec` once, when it is built, and again whenever a
configuration attribute is assigned (`attn.score_mod = ...`, `attn.window_size = ...`,
`attn.attn_mask_type = ...`): a forward call is a spec read, a call-plan hit and the run.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import nn

from . import extensions
from . import validation as V
from .functional import _is_dtensor, _resolve_call, run_call, run_spec
from .layouts import dims
from .plan import NO_VARLEN, Varlen
from .engine_table import names as backend_names
from .problem import MASK_TYPES, QKV_FORMATS
from .ops import attention_by_key, op_keys_for, static_int, traced_backend
from .spec import SOFTMAX_TYPES, check_dropout, resolve_spec

__all__ = ["DotProductAttention"]

#: Configuration attributes: assigning one re-validates it and re-resolves the spec.
CONFIG = ("qkv_format", "attn_mask_type", "window_size", "softmax_scale", "score_mod", "backend", "deterministic",
          "softmax_type", "attention_dropout")
_VARLEN = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
           "max_seqlen_kv")
_SPEC_KWARGS = frozenset({"qkv_format", "attn_mask_type", "window_size", "softmax_scale", "score_mod",
                          "score_mod_tensors", "score_mod_bprop", "score_mod_bprop_tensors", "return_lse", "backend",
                          "deterministic"})
_CALL_KWARGS = _SPEC_KWARGS | frozenset(_VARLEN)
#: dot_product_attention's configuration tuple (see functional._resolve_call), without score_mod.
_CONFIG_ORDER = ("qkv_format", "attn_mask_type", "window_size", "softmax_scale", "score_mod_tensors", "score_mod_bprop",
                 "score_mod_bprop_tensors", "return_lse", "backend", "deterministic", "softmax_type", "dropout_p")


def _stable_mod(current: Any, new: Any) -> Any:
    """The score_mod object the module passes per call, kept the same object across value changes.

    A traced mod with the same structure and tensor parameters as `current` updates `current`'s
    float values (and its scalar tensor) in place, so torch.compile, which guards on the object,
    sees one object and a tensor of values: changing softcap 30 -> 50 neither rebuilds a cuDNN
    graph nor recompiles. Otherwise a private copy (the user's object is never mutated).
    """
    try:
        from score_mods.trace import TracedMod
    except ImportError:  # pragma: no cover - score_mods ships with fused_attn
        return new
    if not isinstance(new, TracedMod):
        return new
    if isinstance(current, TracedMod) and current.take_values(new):
        return current
    copy = new.private_copy()
    copy.scalar_tensor()  # made here, outside any compiled region
    return copy


def _positive_int(arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{arg} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{arg} must be a positive int, got {value}")
    return value


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with masks, windows, GQA, varlen, sinks, dropout and score_mods.

    Args:
        num_attention_heads: H, query heads.
        kv_channels: head dim D of query/key and value, or a (D_qk, D_v) pair.
        num_gqa_groups: Hkv, key/value heads (default H); H must be a multiple of it.
        qkv_format, attn_mask_type, window_size, softmax_scale, score_mod, backend,
        deterministic: defaults for `fused_attn.dot_product_attention`.
        softmax_type: "vanilla", "off-by-one" (a sink logit 0 per head) or "learnable" (a
            trained per-head sink logit: the parameter `sinks`, shape (H,), initialised to 0).
        attention_dropout: dropout probability on the attention weights, applied in training
            mode only (`module.train()`), with torch's RNG.
        cp_group: a process group for context parallelism (None: none). The module then takes
            each rank's sequence shard (`fused_attn.distributed.shard_sequence`) and returns its
            shard of the output, as `fused_attn.distributed.context_parallel_attention`.
        cp_comm: "ring" (K/V exchanged point to point, overlapped with compute), "all_gather",
            "all_to_all" (head-parallel: heads and kv heads multiples of the group size) or
            "auto" (all_to_all when the heads divide, else ring).
        cp_layout: "load_balanced" (rank r holds chunks r and 2N-1-r) or "contiguous".

    forward(query, key, value, **overrides): any keyword of `dot_product_attention`
    (attn_mask_type, score_mod, cu_seqlens_q, max_seqlen_q, return_lse, ...) overrides the
    default for one call. Shapes: see `dot_product_attention` (e.g. bshd: query (B, S, H, D) ->
    out (B, S, H, D_v)). Assigning a configuration attribute takes effect at the next call.
    """

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, qkv_format: str = "bshd", attn_mask_type: str = "no_mask",
                 window_size: Optional[Tuple[int, int]] = None, softmax_scale: Optional[float] = None,
                 score_mod: Any = None, backend: str = "auto", deterministic: bool = False,
                 softmax_type: str = "vanilla", attention_dropout: float = 0.0, cp_group: Any = None,
                 cp_comm: str = "ring", cp_layout: str = "load_balanced") -> None:
        super().__init__()
        self._ready = False
        if cp_group is not None:
            CP_COMMS, LAYOUTS = extensions.get("cp_choices")()
            V.check_choice("cp_comm", cp_comm, CP_COMMS)
            V.check_choice("cp_layout", cp_layout, LAYOUTS)
        self.cp_group, self.cp_comm, self.cp_layout = cp_group, cp_comm, cp_layout
        self.num_attention_heads = _positive_int("num_attention_heads", num_attention_heads)
        if isinstance(kv_channels, (tuple, list)):
            if len(kv_channels) != 2:
                raise ValueError(f"kv_channels must be an int or a (qk, v) pair of ints, got {kv_channels!r}")
            self.head_dim_qk = _positive_int("kv_channels[0]", kv_channels[0])
            self.head_dim_v = _positive_int("kv_channels[1]", kv_channels[1])
        else:
            self.head_dim_qk = self.head_dim_v = _positive_int("kv_channels", kv_channels)
        self.num_gqa_groups = (self.num_attention_heads if num_gqa_groups is None
                               else _positive_int("num_gqa_groups", num_gqa_groups))
        if self.num_attention_heads % self.num_gqa_groups != 0:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({self.num_gqa_groups})")
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.softmax_scale = softmax_scale
        self.backend = backend
        self.deterministic = deterministic
        self.softmax_type = softmax_type
        self.attention_dropout = attention_dropout
        self.score_mod = score_mod
        if self.softmax_type == "learnable":
            self.sinks = nn.Parameter(torch.zeros(self.num_attention_heads))
        else:
            self.sinks = None
        self._ready = True
        self._resolve()

    # ------------------------------------------------------------------ configuration

    def __setattr__(self, name: str, value: Any) -> None:
        if name in CONFIG:
            value = self._validated(name, value)
            object.__setattr__(self, "_" + name, value)
            if name == "score_mod":
                object.__setattr__(self, "_call_mod", _stable_mod(self.__dict__.get("_call_mod"), value))
            if self.__dict__.get("_ready"):
                self._resolve()
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name in CONFIG:
            return self.__dict__["_" + name]
        return super().__getattr__(name)

    def _validated(self, name: str, value: Any) -> Any:
        if name == "qkv_format":
            return V.check_choice("qkv_format", value, QKV_FORMATS)
        if name == "attn_mask_type":
            return V.check_choice("attn_mask_type", value, MASK_TYPES)
        if name == "window_size":
            return V.check_window(value)
        if name == "softmax_scale":
            return None if value is None else V.check_scale(value, self.head_dim_qk)
        if name == "backend":
            return V.check_choice("backend", value, backend_names())
        if name == "deterministic":
            return V.check_bool("deterministic", value)
        if name == "softmax_type":
            if self.__dict__.get("_ready"):
                raise AttributeError("softmax_type is fixed at construction (it decides the sinks parameter)")
            return V.check_choice("softmax_type", value, SOFTMAX_TYPES)
        if name == "attention_dropout":
            return check_dropout(value)
        return value

    def _resolve(self) -> None:
        """Resolve the spec for training and evaluation mode (dropout differs); raises on a bad
        combination (e.g. a causal mask with a two-sided window) at assignment time."""
        common = dict(qkv_format=self._qkv_format, attn_mask_type=self._attn_mask_type,
                      window_size=self._window_size, softmax_scale=self._softmax_scale, score_mod=self._call_mod,
                      backend=self._backend, deterministic=self._deterministic, softmax_type=self._softmax_type)
        eval_spec, mod = resolve_spec(**common)
        train_spec = eval_spec
        if self._attention_dropout:
            train_spec, _ = resolve_spec(**common, dropout_p=self._attention_dropout)
        object.__setattr__(self, "_specs", (eval_spec, train_spec, mod))
        # Spec keys for torch.compile, registered here in eager code: a compiled model reads constants.
        object.__setattr__(self, "_op_keys", (op_keys_for(eval_spec), op_keys_for(train_spec)))
        object.__setattr__(self, "_checked", {})
        # What an eager forward reads, in one attribute read: the specs, a private copy of the
        # score_mod that nothing updates in place (`_call_mod` is, for torch.compile), and the
        # configuration the per-call overrides start from. An assignment from another thread
        # replaces it whole, so a call never mixes two configurations.
        eager_mod = None if mod is None else mod.private_copy()
        config = dict(common, score_mod=eager_mod, score_mod_tensors=None, score_mod_bprop=None,
                      score_mod_bprop_tensors=None, return_lse=False)
        config.pop("softmax_type")
        object.__setattr__(self, "_state", (eval_spec, train_spec, eager_mod, config))

    # ------------------------------------------------------------------ forward

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                **overrides: Any) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        if type(query) is not torch.Tensor and _is_dtensor(query):
            return extensions.get("dtensor_module_forward")(self, query, key, value, **overrides)
        if self.cp_group is not None:
            return extensions.get("module_context_parallel")(self, self.cp_group, self.cp_comm, self.cp_layout, query, key, value,
                                           **overrides)
        eval_spec, train_spec, mod, config = self._state  # read once: see _resolve
        spec = train_spec if self.training else eval_spec
        varlen = NO_VARLEN
        if overrides:
            unknown = sorted(set(overrides) - _CALL_KWARGS)
            if unknown:
                raise TypeError(f"DotProductAttention.forward got unexpected keyword(s) {unknown}; accepted: "
                                f"{sorted(_CALL_KWARGS)}")
            if any(n in overrides for n in _VARLEN):
                varlen = Varlen(*(overrides.get(n) for n in _VARLEN))
            if any(n in overrides for n in _SPEC_KWARGS):
                cfg = dict(config, softmax_type=spec.softmax_type, dropout_p=spec.dropout_p)
                cfg.update((n, overrides[n]) for n in _SPEC_KWARGS if n in overrides)
                V.check_choice("qkv_format", cfg["qkv_format"], QKV_FORMATS)
                self._check_config(query, key, value, cfg["qkv_format"])
                score_mod = cfg.pop("score_mod")
                return run_call(_resolve_call, tuple(cfg[n] for n in _CONFIG_ORDER), score_mod, query, key, value,
                                varlen, self.sinks)
        self._check_config(query, key, value, spec.qkv_format)
        if torch.compiler.is_compiling():
            keys = self._op_keys[1 if self.training else 0]
            backend = spec.backend
            if backend == "auto":
                backend = traced_backend(query.device.type, query.dtype, static_int(query.shape[-1]),
                                         static_int(value.shape[-1]))
            # the compile-stable mod (values updated in place: no recompile per value)
            out, lse = attention_by_key(keys[backend], self._specs[2], query, key, value, varlen, self.sinks)
            return out if lse is None else (out, lse)
        return run_spec(spec, mod, query, key, value, varlen, self.sinks)

    def _check_config(self, query: Any, key: Any, value: Any, fmt: str) -> None:
        """Heads and head dims against the module's configuration, once per shape triple."""
        try:
            sig = (query.shape, key.shape, value.shape, fmt)
        except AttributeError:
            return  # not tensors: the functional checks name the argument
        compiling = torch.compiler.is_compiling()
        if not compiling and sig in self._checked:
            return  # (under torch.compile a shape-keyed memo would guard on every length: check each trace)
        rank = 3 if fmt == "thd" else 4
        if all(t.dim() == rank for t in (query, key, value)):
            want = (("query", query, self.num_attention_heads, self.head_dim_qk, "num_attention_heads"),
                    ("key", key, self.num_gqa_groups, self.head_dim_qk, "num_gqa_groups"),
                    ("value", value, self.num_gqa_groups, self.head_dim_v, "num_gqa_groups"))
            for name, t, heads, dim, heads_arg in want:
                _, h, _, d = dims(t, fmt)
                if h != heads:
                    hint = next((f"; a {o} tensor? pass qkv_format={o!r}" for o in ("bshd", "sbhd", "bhsd")
                                 if o != fmt and dims(t, o)[1] == heads and dims(t, o)[3] == dim), "")
                    raise ValueError(f"{name} has {h} heads but the module was built with {heads_arg}={heads} "
                                     f"(qkv_format={fmt!r}, shape {tuple(t.shape)}){hint}")
                if d != dim:
                    raise ValueError(f"{name} has head dim {d} but the module was built with kv_channels="
                                     f"{(self.head_dim_qk, self.head_dim_v)} (qkv_format={fmt!r}, shape "
                                     f"{tuple(t.shape)})")
        if compiling:
            return
        if len(self._checked) > 64:
            self._checked.clear()
        self._checked[sig] = True

    def extra_repr(self) -> str:
        kv = self.head_dim_qk if self.head_dim_qk == self.head_dim_v else (self.head_dim_qk, self.head_dim_v)
        parts = [f"num_attention_heads={self.num_attention_heads}", f"kv_channels={kv}",
                 f"num_gqa_groups={self.num_gqa_groups}", f"qkv_format={self._qkv_format!r}",
                 f"attn_mask_type={self._attn_mask_type!r}"]
        if self._window_size is not None:
            parts.append(f"window_size={self._window_size}")
        if self._softmax_scale is not None:
            parts.append(f"softmax_scale={self._softmax_scale}")
        if self._score_mod is not None:
            parts.append(f"score_mod={getattr(self._score_mod, 'name', getattr(self._score_mod, '__name__', 'custom'))}")
        if self._softmax_type != "vanilla":
            parts.append(f"softmax_type={self._softmax_type!r}")
        if self._attention_dropout:
            parts.append(f"attention_dropout={self._attention_dropout}")
        parts.append(f"backend={self._backend!r}")
        if self._deterministic:
            parts.append("deterministic=True")
        if self.cp_group is not None:
            parts.append(f"cp_comm={self.cp_comm!r}, cp_layout={self.cp_layout!r}")
        return ", ".join(parts)
