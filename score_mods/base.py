"""The contract between a score modifier and the attention backends.

A `ScoreMod` is what `dot_product_attention(score_mod=...)` receives once it has been
normalized (`as_score_mod`). The library and its engines use only the members declared below
(never private attributes; `tests/core/test_score_mod_contract.py` checks the library's source):

* the reference backend calls `eager(...)` on fp32 score blocks;
* the cuDNN backend checks `cudnn_unsupported` (None = it can lower the mod), puts `cache_key`
  in its graph key, creates one graph input per entry of `cudnn_operands(dims, device=...)`
  (binding those torch tensors at every execute; `describe_operands` of them goes into the
  graph key), and calls `lower_forward` / `lower_backward` from inside the frontend's score_mod
  callbacks.

Materialization: a mod may evaluate score-free index subexpressions (`q_idx // 4`, Morton
decoding, table gathers) eagerly into graph inputs; those need the graph's dims (B, H, Sq, Skv)
-- for packed (thd) problems the bucketed graph dims, since positions are within a sequence.
`needs_dims` says whether a mod needs them; without dims, `cudnn_operands()` keeps its old
behaviour and raises ValueError for a mod that needs them.

Scores the modifier sees are *scaled* (softmax_scale already applied), fp32, and indexed by
(b, h, q_idx, kv_idx) within the current sequence; q_len / kv_len are that sequence's lengths.
"""

from __future__ import annotations

import abc
from types import MappingProxyType
from typing import Any, Dict, Hashable, Mapping, Optional, Tuple

import torch

#: Names of the per-sequence length operands the *backend* supplies to the lowering.
#: For packed/padded problems they are the (B, 1, 1, 1) int32 `seq_len` graph tensors given to
#: sdpa; for plain dense problems they are pass-by-value fp32 scalars holding Sq and Skv.
LENGTH_OPERANDS = ("q_len", "kv_len")

_NO_VALUES: Mapping[str, Any] = MappingProxyType({})


class ScoreMod(abc.ABC):
    """A score modifier usable by every backend. Subclasses: traced mods, raw cuDNN callbacks."""

    #: Short human-readable name ("softcap", "compose(softcap, causal)", ...), for errors and tables.
    name: str = "score_mod"
    #: The expression DAG (a `score_mods.expr` Node) of a traced mod; None for a mod given as
    #: callbacks. A mod with a root is a `TracedMod` and also offers its public API (`bind`,
    #: `rebind`, `program` / `run` / `index_env`), which engines that lower the DAG use.
    root: Optional[Any] = None
    #: Parameter declarations by name (`ParamSpec`: kind "float" / "int" / "tensor" and rank);
    #: empty for a mod given as callbacks.
    specs: Mapping[str, Any] = _NO_VALUES
    #: (left, right, bottom_right): the band a backend may run natively in place of this mod (a
    #: pure library window / causal mask), or None.
    native_band: Optional[Tuple[Any, ...]] = None

    @property
    def base_name(self) -> str:
        """The name without parameter values ("softcap" for "softcap_30"): stable across values."""
        return self.name

    @property
    def bound_values(self) -> Mapping[str, Any]:
        """The parameter values bound now, as one object that a change of values in place
        (`TracedMod.take_values`) replaces: compared by identity it tells a backend that what it
        derived from the values is stale; by equality, that the function changed. Default: none."""
        return _NO_VALUES

    def backend_memo(self) -> Dict[Any, Any]:
        """A dict in which a backend may keep what it derives from this mod (bounded by the
        backend). It lives and dies with the mod, so no process-wide cache keeps the mod's
        tensors alive; a copy of the mod starts with an empty one."""
        memo = self.__dict__.get("_backend_memo")
        if memo is None:
            memo = self.__dict__["_backend_memo"] = {}
        return memo

    def private_copy(self) -> "ScoreMod":
        """A copy that owns its state, for holders that later update values in place (a module's
        `score_mod`). Default: self (a mod whose values never change in place)."""
        return self

    def trainable(self) -> Dict[str, Any]:
        """Tensor parameters that may be trained: name -> facts (`parts.Trainable`). Default: none."""
        return {}

    def split_additive_bias(self) -> Tuple[Optional["ScoreMod"], Optional["ScoreMod"]]:
        """(score part, bias part) with mod(s) == score_part(s) + g (see TracedMod); (self, None)
        when the mod has no score-free additive term. Default: (self, None)."""
        return self, None

    def scalars_typed(self) -> Dict[str, Any]:
        """Scalar parameters with their kinds (ints as int). Default: `scalars()`."""
        return dict(self.scalars())

    def scalar_tensor(self) -> torch.Tensor:
        """The scalar parameters as one CPU float64 tensor in `scalars()` order (a traced mod makes
        it once, so torch.compile sees a tensor input and a new value does not recompile)."""
        return torch.tensor(list(self.scalars().values()), dtype=torch.float64)

    def rebind(self, scalars: Dict[str, float], tensors: Dict[str, torch.Tensor]) -> "ScoreMod":
        """This mod with new parameter values (the compiled path binds them per call). Default: self
        for a mod without parameters; a mod with parameters and no rebind cannot be compiled."""
        if scalars or tensors:
            raise NotImplementedError(f"score_mod {self.name!r} has parameters but no rebind(scalars, tensors); it "
                                      "cannot be used under torch.compile")
        return self

    def compile_structure(self) -> Optional[Tuple[str, tuple]]:
        """What a compiled graph's spec depends on, as constants (see TracedMod), or None: the mod
        crosses torch.compile as itself. Default: None."""
        return None

    @property
    @abc.abstractmethod
    def cache_key(self) -> Hashable:
        """Structural key: equal for the same math and parameter *kinds*, different otherwise.

        Never contains float parameter values (those are bound per call), never id() or
        source text. Tensor parameters contribute dtype and rank, not values.
        """

    @property
    def uses_lengths(self) -> bool:
        """True if the expression reads q_len / kv_len (the backend then supplies them)."""
        return False

    @property
    def needs_dims(self) -> bool:
        """True if `cudnn_operands` needs `dims` (the mod materializes index subexpressions)."""
        return False

    @property
    def cudnn_unsupported(self) -> Optional[str]:
        """None if the cuDNN lowering can run this mod, else why not (NotImplementedError text)."""
        return None

    @property
    def has_reference(self) -> bool:
        """True if `eager` is available (raw cuDNN callbacks without `reference=` have none)."""
        return True

    @property
    def has_backward(self) -> bool:
        """True if `lower_backward` can produce the cuDNN backward callback."""
        return True

    @property
    def irregular_mask(self) -> bool:
        """True when a mask condition reads a graph input that varies along kv_idx (document ids,
        2-D neighbourhoods): a backend may refuse such masks' backward (see the cuDNN quirks)."""
        return False

    def check(self, *, device: torch.device, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> None:
        """Validate tensor parameters against the problem; raise ValueError/TypeError naming them."""

    def structural_values(self) -> Hashable:
        """Parameter values a backend turns into structure (a window into a native band, ...):
        hashable, in every call-plan key, so a new value gets its own plan (values that reach
        the kernel per call stay out). Default: none."""
        return ()

    def structure_only(self) -> "ScoreMod":
        """This mod with the same structure, shapes, strides and dtypes and no user data: what
        caches (specs, plans, graphs) keep. Tensor parameters become meta tensors. Default: self
        (a mod holding no tensors)."""
        return self

    def scalars(self) -> Dict[str, float]:
        """Float parameters by name (values bound per call; changing them never rebuilds)."""
        return {}

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Tensor parameters by name (graph inputs bound per call)."""
        return {}

    @abc.abstractmethod
    def eager(
        self,
        score: torch.Tensor,
        b: torch.Tensor,
        h: torch.Tensor,
        q_idx: torch.Tensor,
        kv_idx: torch.Tensor,
        q_len: torch.Tensor,
        kv_len: torch.Tensor,
    ) -> torch.Tensor:
        """Apply the modifier with torch ops (reference semantics).

        score: fp32, broadcastable against the int64 index tensors b, h, q_idx, kv_idx and the
        int64 per-sequence lengths q_len, kv_len (e.g. score (B, H, Sq_blk, Skv),
        b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, Sq_blk, 1), kv_idx (1, 1, 1, Skv),
        q_len / kv_len (B, 1, 1, 1)). Masked positions are returned as -inf. Must be
        differentiable by torch.autograd with respect to score.
        """

    def cudnn_operands(self, dims: Optional[Tuple[int, int, int, int]] = None, *,
                       device: Optional[torch.device] = None) -> Dict[str, torch.Tensor]:
        """Named 4-D torch tensors the cuDNN graph takes as extra inputs, bound at every execute.

        dims: the graph's logical (B, H, Sq, Skv) (bucketed dims for thd); device: the inputs'
        device. Scalars: CPU fp32 tensors of shape (1, 1, 1, 1) (pass-by-value). Tensor
        parameters: 4-D views on the device, size 1 on the axes they are not indexed by (for
        instance slopes[h] -> (1, H, 1, 1)). Materialized subexpressions: fp32 device tensors
        of shape (B|1, H|1, Sq|1, Skv|1), memoized across calls (needs dims). Dims, strides,
        dtypes and which are CPU go into the graph key; values never do. The backend adds
        LENGTH_OPERANDS itself.
        """
        return {}

    @property
    def needs_host_lengths(self) -> bool:
        """True if the cuDNN lowering needs `length_operands` (q_len/kv_len folded on the host).

        Only dense problems without padding can supply them; for packed (thd) or padded batches
        the backend should refuse the cuDNN path (NotImplementedError naming backend='reference').
        """
        return False

    def length_operands(self, q_len: int, kv_len: int) -> Dict[str, torch.Tensor]:
        """Extra CPU fp32 (1, 1, 1, 1) pass-by-value operands derived from dense Sq / Skv.

        Dense problems: the backend adds these to the `cudnn_operands()` graph inputs (values
        bound per call, names/shapes in the graph key like the others).
        """
        return {}

    @abc.abstractmethod
    def lower_forward(self, graph: Any, score: Any, operands: Dict[str, Any], memo: Dict[Any, Any]) -> Any:
        """Emit the forward score_mod into a cuDNN graph; return the modified score tensor.

        graph: the object the frontend hands the score_mod callback; score: its score tensor;
        operands: graph tensors for every `cudnn_operands()` name plus LENGTH_OPERANDS;
        memo: a dict private to this graph build, shared with `lower_backward` (the backward
        graph re-runs the forward callback first, so intermediates can be reused).
        """

    def lower_backward(self, graph: Any, dscore: Any, operands: Dict[str, Any], memo: Dict[Any, Any]) -> Any:
        """Emit d(loss)/d(score) given dscore = d(loss)/d(modified score); see lower_forward."""
        raise NotImplementedError(f"score_mod {self.name!r} has no cuDNN backward")

    def score_scale(self) -> float:
        """The factor c that `lower_scaled_forward` expects the score to arrive multiplied by
        (the backend folds it into cuDNN's attention scale); 1.0: none."""
        return 1.0

    def lower_scaled_forward(self, graph: Any, score: Any, operands: Dict[str, Any], memo: Dict[Any, Any]) -> Any:
        """`lower_forward` for a callback whose score arrives multiplied by `score_scale()`: the
        backend's entry point (it binds attention scale x score_scale()); see lower_forward."""
        return self.lower_forward(graph, score, operands, memo)

    def lower_scaled_backward(self, graph: Any, dscore: Any, operands: Dict[str, Any], memo: Dict[Any, Any]) -> Any:
        """d(loss)/d(score x score_scale()) for `lower_scaled_forward`; see lower_backward."""
        return self.lower_backward(graph, dscore, operands, memo)

    def __repr__(self) -> str:
        return f"<ScoreMod {self.name}>"


def describe_operands(operands: Dict[str, torch.Tensor]) -> tuple:
    """Structural description of `cudnn_operands()` for graph keys: no values, no ids."""
    return tuple(
        sorted(
            (name, tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type == "cpu")
            for name, t in operands.items()
        )
    )


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `t`'s shape, strides and dtype (no storage): structure, not data."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
