"""The dense runner's workaround for quirk `nan_dq_kv_64_mod_128` (NaN in dQ at key lengths
64 mod 128 with a row's lse below about -88.7): the backward graph over keys padded by 64 and
masked past the real length, planned once per plan and run per backward call.

A mixin of `dense.DenseRunner` (it uses the runner's dims, format, lowering, operands and graphs).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...cache import GraphKey
from . import lowering as L
from . import quirks
from .common import operand_description
from .dense_layout import _contiguous_strides, _format_axis, _format_shape, _logical_strides, normalized

__all__ = ["PaddedKeysBackward"]


class PaddedKeysBackward:
    def _padded_backward(self, common: dict, bias_desc: Optional[tuple], version: int):
        """Quirk `nan_dq_kv_64_mod_128` (NaN in dQ when the key length is 64 mod 128 and a row's
        lse is below about -88.7). Measured exact instead: keys padded by 64 to a multiple of 128
        and masked past the real length (cuDNN's padding mask, or the padding score_mod next to a
        score_mod). The forward is unaffected and stays unpadded; the backward copies K, V (and
        the bias) into padded buffers. Where the padded form crashes the planner (a bias next to
        a score_mod; a score_mod without a causal mask, measured with softcap, ALiBi and
        relative-position mods; lengths folded on the host) the plan is refused."""
        from ...static import Refusal

        spec, p = self.static.spec, self.static
        quirk = quirks.QUIRKS["nan_dq_kv_64_mod_128"]
        if self.into is not None and self.into.grads[0] is not None:
            raise Refusal("a caller-owned dQ layout with the padded-key backward (keys 64 mod 128)")
        if self.lowering.bias is not None and self.has_mod:
            quirk = quirks.QUIRKS["nan_dq_kv_64_mod_128_score_mod_bias"]
            raise Refusal(quirk.refusal(version, "a key length 64 mod 128 with a bias next to a score_mod (the "
                                                 "padded-key backward with a score_mod and a bias input crashes the "
                                                 "planner)"))
        band = spec.band
        if self.has_mod and not (band is not None and band.left is None and band.right == 0):
            raise Refusal(quirk.refusal(version, "a key length 64 mod 128 with a score_mod and no causal mask (the "
                                                 "padded-key backward crashes the planner unless the mask is "
                                                 "causal)"))
        if self.has_mod and self.lowering.user_mod is not None and self.lowering.user_mod.needs_host_lengths:
            raise Refusal(quirk.refusal(version, "a key length 64 mod 128 with a score_mod that folds q_len / kv_len "
                                                 "(the padded-key backward cannot fold the lengths)"))
        b, h, sq, d = self.dims[0]
        hkv, skv, dv = self.dims[1][1], self.dims[1][2], self.dims[2][3]
        self.kv_pad = 64
        skv2 = skv + 64
        padded_spec = dataclasses.replace(spec, padding=True)
        self.bwd_lowering = L.plan_lowering(padded_spec, spec.score_mod, (b, h, sq, skv2), has_lengths=True,
                                            trained=self.trained)
        dims = ((b, hkv, skv2, d), (b, hkv, skv2, dv))
        strides = tuple(normalized(dm, _logical_strides(self.fmt, _contiguous_strides(_format_shape(self.fmt, dm))))
                        for dm in dims)
        self.padded_shapes = tuple(_format_shape(self.fmt, dm) for dm in dims)
        self.seq_axis = _format_axis(self.fmt, 2)
        dev = self.static.device
        self.full_lengths = (torch.full((b, 1, 1, 1), sq, dtype=torch.int32, device=dev),
                             torch.full((b, 1, 1, 1), skv, dtype=torch.int32, device=dev))
        operands = self._operands(spec.score_mod, backward=True)
        bwd_mod = self.bwd_lowering.graph_mod
        if bias_desc is not None:
            shape = bias_desc[0][:3] + (skv2,)
            bias_desc = (shape, normalized(shape, _contiguous_strides(shape)), bias_desc[2], bias_desc[3])
        key = GraphKey(direction="bwd", deterministic=spec.deterministic,
                       **{**common, "k_dims": dims[0], "v_dims": dims[1], "k_strides": strides[0],
                          "v_strides": strides[1], "band": self.bwd_lowering.band, "padding": True,
                          "grad_strides": None,  # dK, dV go to padded buffers; dQ stays dense (Into.grads[0] None)
                          "score_mod": None if bwd_mod is None else bwd_mod.cache_key,
                          "operands": operand_description(operands), "bias": bias_desc})
        del p, version
        return key, (bwd_mod, operands)

    def _padded_backward_run(self, bind_fwd, mod, q, k, v, out, stats, extra, has_bias, has_sinks, d_o):
        """The backward on keys padded by 64 (see _padded_backward)."""
        skv = self.dims[1][2]
        padded = []
        for t, shape in zip((k, v), self.padded_shapes):
            buf = torch.zeros(shape, dtype=t.dtype, device=t.device)
            buf.narrow(self.seq_axis, 0, skv).copy_(t)
            padded.append(buf)
        bind = self._operands(mod, backward=True)
        bind.update(q=q, k=padded[0], v=padded[1], o=out, dO=d_o, stats=stats)
        bind["seq_q"], bind["seq_kv"] = self.full_lengths
        for name in ("sink", "dropout_seed", "dropout_offset"):
            if name in bind_fwd:
                bind[name] = bind_fwd[name]
        dq = torch.empty_strided(q.shape, self.grad_strides[0], dtype=q.dtype, device=q.device)
        dk_p, dv_p = (torch.empty(shape, dtype=t.dtype, device=t.device) for t, shape in zip((k, v), self.padded_shapes))
        bind.update(dQ=dq, dK=dk_p, dV=dv_p)
        extra_grads = []
        d_bias = None
        if has_bias:
            bias = extra.pop(0)
            src = bind_fwd["bias"]
            shape = tuple(src.shape[:3]) + (skv + self.kv_pad,)
            bias_p = torch.zeros(shape, dtype=src.dtype, device=src.device)
            bias_p[..., :skv].copy_(src)
            bind["bias"] = bias_p
            if self.bias_grad:
                d_bias = bind["dBias"] = torch.empty(shape, dtype=src.dtype, device=src.device)
        if self.sinks is not None:
            d_sink = bind["dSink"] = torch.empty((1, self.dims[0][1], 1, 1), dtype=torch.float32, device=q.device)
        self.graphs.run("bwd", bind)
        if has_bias:
            extra_grads.append(None if d_bias is None else d_bias[..., :skv].to(bias.dtype))
        if has_sinks:
            extra_grads.append(d_sink.view(-1).to(extra.pop(0).dtype))
        dk, dv = (g.narrow(self.seq_axis, 0, skv) for g in (dk_p, dv_p))
        return (dq, dk, dv) + tuple(extra_grads)
