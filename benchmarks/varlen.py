"""Variable-length benchmark: fused_attn.varlen_attn vs torch's varlen_attn vs padded SDPA,
doc_packed_attn vs flex_attention with a document block mask, and a training loop over random
lengths counting graph builds.

Shape legend: N sequences, T total tokens, H heads, D head dim; packed tensors are (T, H, D).
FLOPs count real tokens only: sum_i 4*H*D*s_i^2 (half for causal).
"""

from __future__ import annotations

import time
from typing import Callable, List, Sequence

import torch
import torch.nn.functional as F

from .common import Impl, check_impl, reference_and_bounds, synchronize, varlen_flops
from .packed import cu_seqlens, packed_tensors, random_lengths, reference_packed
from .runner import SuiteResult, run_config

N, MAX_LEN, H = 8, 2048, 16


def _autograd_impl(name: str, fn: Callable, ins, do, required: bool, to_packed=None, note: str = "") -> Impl:
    unpack = to_packed or (lambda t: t)

    def outputs():
        out = fn(*ins)
        grads = torch.autograd.grad(out, ins, do)
        return {"out": unpack(out.detach()), "dq": unpack(grads[0]), "dk": unpack(grads[1]), "dv": unpack(grads[2])}

    return Impl(name, lambda: fn(*ins), lambda: torch.autograd.grad(fn(*ins), ins, do), outputs, required, note)


def _padded_impl(q, k, v, do, lengths, causal: bool) -> Impl:
    """torch SDPA on the zero-padded (N, L, H, D) batch with a boolean key-padding (and causal) mask."""
    n, lmax, dev = len(lengths), max(lengths), q.device
    valid = torch.arange(lmax, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]  # (N, L)

    def pad(t):
        out = t.new_zeros(n, lmax, *t.shape[1:])
        out[valid] = t.detach()
        return out

    qp, kp, vp = [pad(t).requires_grad_() for t in (q, k, v)]
    mask = valid[:, None, None, :]
    if causal:
        mask = mask & torch.ones(lmax, lmax, dtype=torch.bool, device=dev).tril()

    def fn(a, b, c):
        o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), attn_mask=mask)
        return o.transpose(1, 2)

    return _autograd_impl("sdpa_padded", fn, (qp, kp, vp), pad(do), False, to_packed=lambda t: t[valid],
                          note="inputs padded outside the timed call")


def _varlen_impls(q, k, v, do, lengths, causal: bool, device) -> List[Impl]:
    import fused_attn

    cu, mx = cu_seqlens(lengths, device), max(lengths)
    win = (-1, 0) if causal else (-1, -1)
    impls = [_autograd_impl("fused_attn", lambda a, b, c: fused_attn.varlen_attn(a, b, c, cu, cu, mx, mx,
                                                                                 window_size=win),
                            (q, k, v), do, True)]
    if device.type == "cuda":
        from torch.nn.attention.varlen import varlen_attn as torch_varlen

        impls.append(_autograd_impl("torch_varlen", lambda a, b, c: torch_varlen(a, b, c, cu, cu, mx, mx,
                                                                                 window_size=win),
                                    (q, k, v), do, False))
        impls.append(_padded_impl(q, k, v, do, lengths, causal))
    return impls


def run_varlen_config(lengths: Sequence[int], h: int, d: int, causal: bool, device, quick: bool,
                      seed: int = 0) -> SuiteResult:
    """One packed batch: check then time fused_attn / torch varlen / padded SDPA."""
    q, k, v, do = packed_tensors(sum(lengths), h, d, device, seed)
    expected, bounds = reference_and_bounds(lambda dt: reference_packed(q, k, v, do, lengths, causal, dt), q.dtype)
    flops = {m: varlen_flops(lengths, h, d, causal=causal, mode=m) for m in ("fwd", "fwd_bwd")}
    config = f"varlen N{len(lengths)} max{max(lengths)} T{sum(lengths)} H{h} D{d}" + (" causal" if causal else "")
    return run_config("varlen", config, _varlen_impls(q, k, v, do, lengths, causal, device), expected, bounds,
                      lambda key, t: t, flops, device, rep_ms=40.0 if quick else 80.0, split_times=True)


def _doc_bounds(b: int, s: int, docs: int, seed: int) -> torch.Tensor:
    """(b, docs+1) int32 document offsets per row: 0, sorted distinct multiples of 64, s."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        cuts = (torch.randperm(s // 64 - 1, generator=gen)[: docs - 1] + 1).sort().values * 64
        rows.append([0] + cuts.tolist() + [s])
    return torch.tensor(rows, dtype=torch.int32)


def run_doc_packed(device, quick: bool, *, b: int = 2, s: int = 8192, docs: int = 16, h: int = H, d: int = 64,
                   causal: bool = False) -> SuiteResult:
    """doc_packed_attn (q (B, S, H, D), cu_seq (B, docs+1)) vs flex_attention with a document block mask."""
    import fused_attn

    doc_bounds = _doc_bounds(b, s, docs, seed=11)
    lengths = (doc_bounds[:, 1:] - doc_bounds[:, :-1]).flatten().tolist()
    cu_seq = doc_bounds.to(device)
    q, k, v, do = [t.view(b, s, h, d) if i == 3 else t.detach().view(b, s, h, d).requires_grad_()
                   for i, t in enumerate(packed_tensors(b * s, h, d, device, seed=5))]
    flat = lambda t: t.reshape(b * s, h, d)
    expected, bounds = reference_and_bounds(
        lambda dt: reference_packed(flat(q), flat(k), flat(v), flat(do), lengths, causal, dt), q.dtype)
    longest = max(lengths)  # known on the host, like flex's block mask built outside the timing
    impls = [_autograd_impl("fused_attn", lambda a, bb, c: fused_attn.doc_packed_attn(a, bb, c, cu_seq,
                                                                                      is_causal=causal),
                            (q, k, v), do, True, to_packed=flat,
                            note="device table read on the host by the first call only (as a model's layers share "
                                 "it)"),
             _autograd_impl("fused_attn_maxdoc", lambda a, bb, c: fused_attn.doc_packed_attn(
                 a, bb, c, cu_seq, is_causal=causal, max_doc_len=longest), (q, k, v), do, True, to_packed=flat),
             _autograd_impl("fused_attn_host_table", lambda a, bb, c: fused_attn.doc_packed_attn(
                 a, bb, c, doc_bounds, is_causal=causal), (q, k, v), do, True, to_packed=flat,
                 note="cu_seq on the CPU: longest document read there")]
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        from .mods import _compiled_flex

        doc_id = torch.zeros(b, s, dtype=torch.int32, device=device)
        for row in range(b):
            doc_id[row] = torch.bucketize(torch.arange(s, device=device), doc_bounds[row, 1:].to(device), right=True)

        def mask_mod(bi, hi, qi, ki):
            same = doc_id[bi, qi] == doc_id[bi, ki]
            return (same & (qi >= ki)) if causal else same

        block_mask = create_block_mask(mask_mod, b, None, s, s, device=device)
        flex = _compiled_flex()
        fn = lambda a, bb, c: flex(a.transpose(1, 2), bb.transpose(1, 2), c.transpose(1, 2),
                                   block_mask=block_mask).transpose(1, 2)
        impls.append(_autograd_impl("flex_docmask", fn, (q, k, v), do, False, to_packed=flat,
                                    note="block mask built outside the timed call"))
    # last: its host reads idle the GPU between calls, which would disturb the rows timed after it
    impls.append(_autograd_impl("fused_attn_new_table", lambda a, bb, c: fused_attn.doc_packed_attn(
        a, bb, c, cu_seq.clone(), is_causal=causal), (q, k, v), do, False, to_packed=flat,
        note="a new device table every call: each call reads it on the host (one sync per call; a model's "
             "layers share one per step)"))
    flops = {m: varlen_flops(lengths, h, d, causal=causal, mode=m) for m in ("fwd", "fwd_bwd")}
    config = f"doc_packed B{b} S{s} docs{docs} H{h} D{d}" + (" causal" if causal else "")
    return run_config("varlen", config, impls, expected, bounds, lambda key, t: t, flops, device,
                      rep_ms=40.0 if quick else 80.0, split_times=True)


def run_chunked_prefill(device, quick: bool, *, n: int = N, chunk: int = 512, max_cached: int = 3072, h: int = H,
                        d: int = 128, cap: float = 30.0, seed: int = 21) -> SuiteResult:
    """Chunked prefill with a logit softcap (Gemma 2 style): each sequence's `chunk` new queries
    attend its cached keys and, causally, its own (bottom-right per sequence). fused_attn.varlen_attn
    (on cuDNN as a padded dense batch with the bounds as a bias) vs flex_attention with the same
    mask as a block mask (built outside the timed call) and the reference backend."""
    import fused_attn
    import score_mods as sm

    cached = random_lengths(n, max_cached, 64, seed)
    lens_q, lens_k = [chunk] * n, [chunk + c for c in cached]
    q, _, _, do = packed_tensors(sum(lens_q), h, d, device, seed)
    _, k, v, _ = packed_tensors(sum(lens_k), h, d, device, seed + 1)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    softcap = lambda s, b, hh, i, j: cap * torch.tanh(s / cap)
    expected, bounds = reference_and_bounds(lambda dt: reference_packed(
        q, k, v, do, lens_q, True, dt, lengths_kv=lens_k, score_fn=softcap), q.dtype)
    mod = sm.softcap(cap)
    impls = [_autograd_impl("fused_attn", lambda a, b, c: fused_attn.varlen_attn(
        a, b, c, cu_q, cu_k, chunk, max(lens_k), window_size=(-1, 0), score_mod=mod), (q, k, v), do, True)]
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        from .mods import _compiled_flex

        doc_q = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens_q, device=device))
        doc_k = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lens_k, device=device))
        pos_q = torch.arange(sum(lens_q), device=device) - cu_q[:-1].long()[doc_q]
        pos_k = torch.arange(sum(lens_k), device=device) - cu_k[:-1].long()[doc_k]
        shift = torch.tensor(cached, device=device)

        def mask_mod(bi, hi, qi, ki):
            return (doc_q[qi] == doc_k[ki]) & (pos_k[ki] <= pos_q[qi] + shift[doc_q[qi]])

        def softcap_mod(score, bi, hi, qi, ki):
            return cap * torch.tanh(score / cap)

        block_mask = create_block_mask(mask_mod, 1, None, sum(lens_q), sum(lens_k), device=device)
        flex = _compiled_flex()
        fn = lambda a, b, c: flex(a.transpose(0, 1)[None], b.transpose(0, 1)[None], c.transpose(0, 1)[None],
                                  score_mod=softcap_mod, block_mask=block_mask)[0].transpose(0, 1)
        impls.append(_autograd_impl("flex_attention", fn, (q, k, v), do, False,
                                    note="block mask built outside the timed call"))
        impls.append(_autograd_impl("reference", lambda a, b, c: fused_attn.dot_product_attention(
                a, b, c, qkv_format="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=chunk,
                max_seqlen_kv=max(lens_k), attn_mask_type="causal_bottom_right", score_mod=mod, backend="reference"),
            (q, k, v), do, False, note="the backend such calls ran on before"))
    pairs = sum(nq * (nk - nq) + nq * (nq + 1) // 2 for nq, nk in zip(lens_q, lens_k))
    flops = {"fwd": 4.0 * h * d * pairs, "fwd_bwd": 4.0 * h * d * pairs * 3.5}
    config = f"chunked prefill N{n} chunk{chunk} kv{min(lens_k)}-{max(lens_k)} H{h} D{d} softcap{cap:g}"
    return run_config("varlen", config, impls, expected, bounds, lambda key, t: t, flops, device,
                      rep_ms=40.0 if quick else 80.0, split_times=True)


def run_training_loop(device, steps: int, *, n: int = N, max_len: int = MAX_LEN, h: int = H, d: int = 64,
                      seed: int = 3) -> SuiteResult:
    """fwd+bwd of varlen_attn over `steps` random-length batches vs the same count at fixed shapes.

    Reports ms per step (host loop, one synchronize at the end, builds included) and the graph
    builds of each run (graph cache cleared first).
    """
    import fused_attn

    result = SuiteResult()
    gen = torch.Generator().manual_seed(seed)
    lens = [torch.randint(1, max_len + 1, (n,), generator=gen).tolist() for _ in range(steps)]
    cus = [cu_seqlens(x, device) for x in lens]
    qb, kb, vb, dob = packed_tensors(n * max_len, h, d, device, seed)
    # correctness on the first random batch (odd lengths, not multiples of 64)
    t0 = sum(lens[0])
    ins = [t[:t0] for t in (qb, kb, vb)]
    expected, bounds = reference_and_bounds(lambda dt: reference_packed(*ins, dob[:t0], lens[0], False, dt), qb.dtype)
    impl = _autograd_impl("fused_attn", lambda a, b, c: fused_attn.varlen_attn(a, b, c, cus[0], cus[0], max(lens[0]),
                                                                               max(lens[0])), ins, dob[:t0], True)
    try:
        check_impl(impl, expected, bounds, lambda key, t: t)
    except Exception as exc:
        result.failures.append(f"varlen / training loop first batch: {type(exc).__name__}: {exc}")
        return result
    del expected

    def step(fn, x, cu):
        t = sum(x)
        a, b, c = qb[:t], kb[:t], vb[:t]
        out = fn(a, b, c, cu, cu, max(x), max(x))
        torch.autograd.grad(out, (a, b, c), dob[:t])

    runs = [("fused_attn", fused_attn.varlen_attn, "random lengths", lens, cus),
            ("fused_attn", fused_attn.varlen_attn, "fixed shape", [lens[0]] * steps, [cus[0]] * steps)]
    if device.type == "cuda":
        from torch.nn.attention.varlen import varlen_attn as torch_varlen

        runs.append(("torch_varlen", torch_varlen, "random lengths", lens, cus))
        runs.append(("torch_varlen", torch_varlen, "fixed shape", [lens[0]] * steps, [cus[0]] * steps))
    for name, fn, label, xs, cs in runs:
        fused_attn.graph_cache.clear()
        info0 = fused_attn.graph_cache.cache_info()
        synchronize(device)
        start = time.perf_counter()
        for x, cu in zip(xs, cs):
            step(fn, x, cu)
        synchronize(device)
        ms = (time.perf_counter() - start) / steps * 1e3
        info1 = fused_attn.graph_cache.cache_info()
        builds = info1.builds - info0.builds if name == "fused_attn" else None
        build_s = info1.build_seconds - info0.build_seconds if name == "fused_attn" else None
        result.rows.append({"suite": "varlen", "config": f"train loop {steps} steps N{n} max{max_len} H{h} D{d}",
                            "mode": label, "impl": name, "ms_per_step": ms, "builds": builds,
                            "build_seconds": build_s, "note": "graph cache cleared first; builds included"})
    return result


def run(quick: bool, device: torch.device) -> SuiteResult:
    """The varlen suite on `device`."""
    result = SuiteResult(notes=["lengths: seeded random multiples of 64 up to 2048 (torch varlen_attn "
                                "announcement setup: N=8, 16 heads, D=64, bf16)",
                                "TFLOP/s over real tokens: sum_i 4*H*D*s_i^2, half for causal",
                                "checked against the float64 reference on every token (one sequence at a time)"])
    lengths = random_lengths(N, MAX_LEN, 64, seed=0)
    variants = [(64, False), (64, True), (128, False), (128, True)]
    for i, (d, causal) in enumerate(variants):
        result.extend(run_varlen_config(lengths, H, d, causal, device, quick, seed=i))
    result.extend(run_chunked_prefill(device, quick))
    for causal in ((False,) if quick else (False, True)):
        for docs in (1, 4, 16, 64):  # documents per row
            result.extend(run_doc_packed(device, quick, docs=docs, causal=causal))
    result.extend(run_training_loop(device, 200 if quick else 1000))
    from .steps import run_varlen_step

    result.extend(run_varlen_step(device, quick))
    return result
