#!/usr/bin/env python3
"""Fourth probe of the cuDNN frontend (nvidia-cudnn-frontend 1.32.0, cuDNN 9.19) for fused_attn's design.

Run from the repository root on a GPU machine (about 4 minutes on an H100):
    python3 benchmarks/frontend_probe4.py --out $OUT [--only sinks,dropout]
Writes $OUT/probe4.md (a markdown table per probe, refusals verbatim, a summary) and $OUT/probe4.csv (long
format: section,table,row,column,value); both are rewritten after every section. Each section runs in its
own try/except. Every numeric result is compared with a float64 reference (timed shapes: float32 on a slice)
computed on the GPU from the same inputs: a cell `x/y` reads rel err / max abs err, `nan=n` counts
non-finite values where the reference is finite (or the reverse), over the rows real tokens occupy.
Sections run in a safe order (the ones that call private or shape-overriding entry points last) and the run
stops if the CUDA context is lost.
--dry-run (no GPU): builds every graph up to build_operation_graph, runs the score_mod callbacks on a stand-in
for the C++ graph that checks op names and arguments, checks every variant pack against its graph, and skips
execution (numbers meaningless). It is how this script was checked on a CPU-only machine.
"""
import argparse, copy, csv, ctypes, math, os, random, re, statistics, subprocess, sys, tempfile, time, traceback, zlib
from types import SimpleNamespace as NS

import torch
import cudnn
from cudnn.graph_types import Tensor as IRTensor

DT = cudnn.data_type
TL, BR = cudnn.diagonal_alignment.TOP_LEFT, cudnn.diagonal_alignment.BOTTOM_RIGHT
CAUSAL = dict(diagonal_alignment=TL, diagonal_band_right_bound=0)
PAD = dict(use_padding_mask=True)
TDT = {torch.bfloat16: DT.BFLOAT16, torch.float16: DT.HALF, torch.float32: DT.FLOAT, torch.bool: DT.BOOLEAN,
       torch.uint8: DT.UINT8, torch.int32: DT.INT32, torch.int64: DT.INT64}
NAN = float("nan")
G = NS(dry=False, dev=None, h=None, rep=None)

def window(L): return dict(diagonal_alignment=TL, diagonal_band_left_bound=L, diagonal_band_right_bound=0)
def m_causal(c): return c["J"] <= c["I"]
def m_window(L): return lambda c: (c["J"] <= c["I"]) & (c["J"] > c["I"] - L)  # cuDNN left bound L = flash window L-1
def m_br(c): return (c["J"] - c["I"]) <= (c["lk"] - c["lq"])  # bottom-right causal per sequence
def SZ(real, dry): return dry if G.dry else real
def sync(): None if G.dry else torch.cuda.synchronize()
def short(e, n=240): return f"{type(e).__name__}: {e}".replace("\n", " ")[:n]
def pbv(v, dt=torch.float32): return torch.full((1, 1, 1, 1), v, dtype=dt)  # a CPU tensor: pass-by-value scalar
def NEG(): return pbv(float("-inf"))
def val(x): return x[1] if isinstance(x, tuple) else float(x.flatten()[0])
def rm(shape): return [int(math.prod(shape[i + 1:])) for i in range(len(shape))]  # row-major strides

# ------------------------------------------------------------------------------------------------ report
class Report:
    def __init__(self, out):
        self.out, self.md, self.rows, self.stats, self.refusals, self.sec, self.facts = out, [], [], {}, [], "", []
    def emit(self, text):
        print(text, flush=True)
        self.md.append(text + "\n")
    def refuse(self, label, e):
        self.refusals.append(f"- `{label}`: {type(e).__name__}: {str(e).strip()[:1500]}")
    def table(self, title, rows):
        """Markdown for people (X_rel/X_max/X_nan merged into one cell X), every raw value to the CSV."""
        cols = []
        for r in rows:
            cols += [c for c in r if c not in cols]
        shown = [c[:-4] if c.endswith("_rel") and c[:-4] + "_max" in cols else c for c in cols
                 if not (c.endswith(("_max", "_nan")) and c[:-4] + "_rel" in cols)]
        lines = [f"**{title}**", "", "| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
        for r in rows:
            lines.append("| " + " | ".join(
                (f"{r[c + '_rel']:.1e}/{r.get(c + '_max', NAN):.1e}" + (f" nan={r[c + '_nan']}" if r.get(c + "_nan") else ""))
                if c + "_rel" in r else fmt(r.get(c, "")) for c in shown) + " |")
        self.emit("\n".join(lines if rows else lines[:2] + ["(no rows)"]) + "\n")
        st = self.stats.setdefault(self.sec, NS(n=0, bad=[], err=[]))
        for i, r in enumerate(rows):
            lab, st.n = label(r), st.n + 1
            if any(k.endswith("error") for k in r):
                st.err.append(lab)
            elif r.get("ok") is False:
                st.bad.append(lab)
            self.rows += [(self.sec, title, i, c, r[c]) for c in r]
    def flush_refusals(self):
        if self.refusals:
            self.emit("Refusals and failures, verbatim:\n\n" + "\n".join(self.refusals) + "\n")
        self.refusals = []
    def save(self):
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "probe4.md"), "w") as f:
            f.write("".join(self.md))
        with open(os.path.join(self.out, "probe4.csv"), "w", newline="") as f:
            csv.writer(f).writerows([("section", "table", "row", "column", "value")] + self.rows)

def fmt(v):
    if isinstance(v, float):
        return "nan" if v != v else (f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 or v == 0 else f"{v:.2e}")
    return str(v).replace("|", "/").replace("\n", " ")

def trial(row, fn):
    """Run one case; a failure becomes the row's `error` and its full message goes to the refusals list."""
    try:
        row.update(fn() or {})
    except Exception as e:  # noqa: BLE001 -- every failure is a result here
        row["error"] = short(e)
        G.rep.refuse(label(row), e)
    return row

def label(row):  # the leading str/int columns (at most 3)
    v = []
    for x in list(row.values())[:3]:
        if isinstance(x, bool) or not isinstance(x, (str, int)):
            break
        v.append(str(x))
    return " ".join(v) or "?"

# -------------------------------------------------------------------------------------------- score mods
def F(x): x.set_data_type(DT.FLOAT); return x  # noqa: E702
def Bo(x): x.set_data_type(DT.BOOLEAN); return x  # noqa: E702
def cmpf(gr, op, a, b): return Bo(getattr(gr, op)(a, b, compute_data_type=DT.FLOAT))

def idx(gr, s, axis, dt=DT.FLOAT):
    r = gr.gen_index(s, axis=axis) if dt == DT.INT32 else gr.gen_index(s, axis=axis, compute_data_type=DT.FLOAT)
    r.set_data_type(dt)
    return r

class Mod:
    """A score_mod: fwd(gr, s, T, M) / bwd(gr, dS, T, M) (None = identity) over IR tensors T made from `ext` (CPU
    tensors -> pass-by-value, device tensors -> inputs, ('scalar', v, kind) -> graph-owned tensor_scalar); M is a
    per-graph memo the two callbacks share. eager(s, ctx) and mask(ctx) define the reference."""
    def __init__(self, fwd, bwd=None, ext=None, eager=None, mask=None):
        self.fwd, self.bwd, self.ext, self.eager, self.mask = fwd, bwd, dict(ext or {}), eager, mask

def masked(gr, x, T, M, conds):  # nested selects (logical_and is declined); conds kept for a select bprop
    M.setdefault("conds", []).extend(conds)
    for c in conds:
        x = gr.binary_select(x, T["neg"], c)
    return x

def sel_bprop(gr, ds, T, M):
    for c in M["conds"]:
        ds = gr.binary_select(ds, T["zero"], c)
    return ds

def softcap_mod(cap=2.0, scalars=False):
    ext = (dict(cap=("scalar", cap, "RUNTIME_PARAM"), inv_cap=("scalar", 1 / cap, "COMPILE_TIME_CONST")) if scalars
           else dict(cap=pbv(cap), inv_cap=pbv(1 / cap)))
    def fwd(gr, s, T, M):
        M["x"] = x = F(gr.mul(s, T["inv_cap"]))
        return F(gr.mul(F(gr.tanh(x)), T["cap"]))
    def bwd(gr, ds, T, M):  # chain rule: (dS * cap) -> tanh_backward(., x) -> * inv_cap
        return F(gr.mul(F(gr.tanh_backward(F(gr.mul(ds, T["cap"])), M["x"])), T["inv_cap"]))
    return Mod(fwd, bwd, ext, eager=lambda s, c: val(ext["cap"]) * torch.tanh(s / val(ext["cap"])))

def bias_mod(bias):
    return Mod(lambda gr, s, T, M: F(gr.add(s, T["bias"])), None, dict(bias=bias), eager=lambda s, c: s + bias.to(s.dtype))

def causal_mod():
    return Mod(lambda gr, s, T, M: masked(gr, s, T, M, [cmpf(gr, "cmp_le", F(gr.sub(idx(gr, s, 3), idx(gr, s, 2))), T["zero"])]),
               None, dict(neg=NEG(), zero=pbv(0.0)), mask=m_causal)

# ------------------------------------------------------------------------------------------------- specs
class Spec:
    """One attention configuration. Dense buffers are BSHD (B,S,H,D); thd buffers packed (T,H,D), sequence b at
    starts(lens, gap)[b]. Graph dims are logical (B,H,S,D), S = the bucket (S_max) for thd."""
    def __init__(self, **kw):
        self.B, self.Sq, self.Skv, self.H, self.Hkv, self.D, self.dt = 2, 256, None, 4, None, 64, torch.bfloat16
        self.thd, self.lens_q, self.lens_kv, self.gap, self.kw, self.mod, self.mask = False, None, None, 0, {}, None, None
        self.bias, self.dbias, self.sink, self.drop, self.fwd_in, self.fill, self.scale = None, False, None, None, {}, NAN, None
        self.dyn, self.kc, self.override = False, None, False
        self.__dict__.update(kw)
        self.Skv, self.Hkv, self.scale = self.Skv or self.Sq, self.Hkv or self.H, self.scale or 1 / math.sqrt(self.D)
    def copy(self, **kw):
        c = copy.copy(self)
        c.__dict__.update(kw)
        return c

def starts(lens, gap):
    st, s = [], 0
    for L in lens:
        st.append(s)
        s += L + gap
    return st, s  # s = buffer rows (a trailing gap included)

def spec_kind(kind, B, S, D=64, H=4, **kw):
    if kind == "thd_causal":
        lens = [S] + [random.Random(B * 7919 + S + i).randint(1, S) for i in range(B - 1)]
        return Spec(B=B, Sq=S, H=H, D=D, thd=True, lens_q=lens, lens_kv=lens, kw=dict(**PAD, **CAUSAL), mask=m_causal, **kw)
    extra = dict(nomask={}, causal=dict(kw=CAUSAL, mask=m_causal), softcap=dict(mod=softcap_mod(2.0)))[kind]
    return Spec(B=B, Sq=S, H=H, D=D, **extra, **kw)

def make_bufs(sp):
    d, B, H, Hkv, D = G.dev, sp.B, sp.H, sp.Hkv, sp.D
    if sp.thd:
        shq, shk = (max(starts(sp.lens_q, sp.gap)[1], 1), H, D), (max(starts(sp.lens_kv, sp.gap)[1], 1), Hkv, D)
    else:
        shq, shk = (B, sp.Sq, H, D), (B, sp.Skv, Hkv, D)
    b = {n: torch.randn(s, device=d, dtype=sp.dt) for n, s in (("q", shq), ("k", shk), ("v", shk), ("do", shq))}
    b.update({n: torch.full(s, sp.fill, device=d, dtype=sp.dt) for n, s in (("o", shq), ("dq", shq), ("dk", shk), ("dv", shk))})
    b["lse"] = torch.full((B, H, sp.Sq, 1), sp.fill, device=d)
    for n, lens, hh in ((("rag_q", sp.lens_q, H), ("rag_k", sp.lens_kv, Hkv)) if sp.thd else ()):
        st = starts(lens, sp.gap)[0]
        b[n] = (torch.tensor(st + [st[-1] + lens[-1]], dtype=torch.int32) * hh * D).to(d).view(B + 1, 1, 1, 1)
    if sp.lens_q is not None:
        b["sl_q"], b["sl_k"] = (torch.tensor(x, dtype=torch.int32, device=d).view(B, 1, 1, 1) for x in (sp.lens_q, sp.lens_kv))
    if sp.bias is not None:
        b["bias"], b["dbias"] = sp.bias, torch.full_like(sp.bias, NAN)
    if sp.sink is not None:
        b["sink"], b["dsink"] = sp.sink, torch.full_like(sp.sink, NAN)
    if sp.drop:
        where = "cpu" if sp.drop.get("cpu") else d
        b["seed"], b["offset"] = (torch.full((1, 1, 1, 1), sp.drop[n], dtype=torch.int64, device=where) for n in ("seed", "offset"))
        b["rng"] = torch.full((B, H, sp.Sq, sp.Skv), NAN, device=d)
    b.update({"x:" + n: t for n, t in (sp.mod.ext.items() if sp.mod else ()) if not isinstance(t, tuple)})
    b.update({"in:" + n: t for n, t in sp.fwd_in.items()})
    return b

# ------------------------------------------------------------------------------------------------ graphs
def dims(sp, side):
    S, Hx = (sp.Sq, sp.H) if side == "q" else (sp.Skv, sp.Hkv)
    return [sp.B, Hx, S, sp.D], [S * Hx * sp.D, sp.D, Hx * sp.D, 1]

def _setup(sp, bwd):
    """A graph with the inputs forward and backward share. Returns (graph, sdpa kwargs, q/k/v-like tensor maker,
    names); `names` maps every IR tensor the caller binds to its buffer name in make_bufs()."""
    gkw = dict(is_dynamic_shape_enabled=True) if sp.dyn else {}
    gkw.update(dict(kernel_cache=sp.kc) if sp.kc is not None else {}, **(dict(is_override_shape_enabled=True) if sp.override else {}))
    g = cudnn.pygraph(io_data_type=TDT[sp.dt], intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT, handle=G.h, **gkw)
    names = {}
    def new(n, shape, dt):
        t = g.tensor(dim=list(shape), stride=rm(list(shape)), data_type=dt, name=n)
        names[t] = n
        return t
    rag = {n: new(n, (sp.B + 1, 1, 1, 1), DT.INT32) for n in ("rag_q", "rag_k")} if sp.thd else {}
    def mk(n, side, out=None):
        (d, st), r = dims(sp, side), rag.get("rag_q" if side == "q" else "rag_k")
        t = out or g.tensor(dim=d, stride=st, data_type=TDT[sp.dt], name=n, ragged_offset=r)
        if out is not None:
            t.set_output(True).set_dim(d).set_stride(st).set_data_type(TDT[sp.dt])
            None if r is None else t.set_ragged_offset(r)
        names[t] = n
        return t
    kw = dict(sp.kw)
    if sp.lens_q is not None:
        kw["seq_len_q"], kw["seq_len_kv"] = new("sl_q", (sp.B, 1, 1, 1), DT.INT32), new("sl_k", (sp.B, 1, 1, 1), DT.INT32)
    if sp.bias is not None:
        kw["bias"] = new("bias", sp.bias.shape, TDT[sp.bias.dtype])
        if bwd and sp.dbias:
            kw["dBias"] = new("dbias", sp.bias.shape, TDT[sp.bias.dtype])
    if sp.sink is not None:
        kw["sink_token"] = new("sink", (1, sp.H, 1, 1), DT.FLOAT)
        if bwd:
            kw["dSink_token"] = new("dsink", (1, sp.H, 1, 1), DT.FLOAT)
    if sp.drop:
        if sp.drop.get("cpu"):  # pass-by-value seed/offset
            seed, off = (g.tensor_like(pbv(0, torch.int64), name=n) for n in ("seed", "offset"))
            names.update({seed: "seed", off: "offset"})
        else:
            seed, off = new("seed", (1, 1, 1, 1), DT.INT64), new("offset", (1, 1, 1, 1), DT.INT64)
        kw["dropout"] = (sp.drop["p"], seed, off)
        if not bwd and sp.drop.get("dump", True):
            kw["rng_dump"] = new("rng", (sp.B, sp.H, sp.Sq, sp.Skv), DT.FLOAT)
    for n, t in (() if bwd else sp.fwd_in.items()):
        kw[n] = new("in:" + n, t.shape, TDT[t.dtype])
    if sp.mod:
        T, M = {}, {}
        for n, t in sp.mod.ext.items():
            if isinstance(t, tuple):
                T[n] = g.tensor_scalar(t[1], getattr(cudnn.scalar_type, t[2]), name=n)
            elif t.device.type == "cpu" and (t.numel() == 1 or not G.dry):  # (dry run: every tensor is on the CPU)
                T[n] = g.tensor_like(t, name=n)
                names[T[n]] = "x:" + n
            else:
                T[n] = new("x:" + n, t.shape, TDT[t.dtype])
        T.update(_sl_q=kw.get("seq_len_q"), _sl_k=kw.get("seq_len_kv"))
        kw["score_mod"] = lambda gr, s, *r: sp.mod.fwd(gr, s, T, M)
        if bwd:
            kw["score_mod_bprop"] = lambda gr, ds, *r: (sp.mod.bwd or (lambda g_, d_, T_, M_: d_))(gr, ds, T, M)
    return g, kw, mk, names

def build_fwd(sp):
    g, kw, mk, names = _setup(sp, bwd=False)
    o, st = g.sdpa(q=mk("q", "q"), k=mk("k", "kv"), v=mk("v", "kv"), attn_scale=sp.scale, generate_stats=True, **kw)
    mk("o", "q", out=o)
    names[st.set_output(True).set_data_type(DT.FLOAT)] = "lse"
    return g, names, build(g)

def build_bwd(sp):
    g, kw, mk, names = _setup(sp, bwd=True)
    st = g.tensor(dim=[sp.B, sp.H, sp.Sq, 1], stride=[sp.H * sp.Sq, sp.Sq, 1, 1], data_type=DT.FLOAT, name="lse")
    names[st] = "lse"
    dq, dk, dv = g.sdpa_backward(q=mk("q", "q"), k=mk("k", "kv"), v=mk("v", "kv"), o=mk("o", "q"), dO=mk("do", "q"),
                                 stats=st, attn_scale=sp.scale, **kw)
    mk("dq", "q", out=dq), mk("dk", "kv", out=dk), mk("dv", "kv", out=dv)
    return g, names, build(g)

def build(g):
    t0 = time.perf_counter()
    g.validate()
    g.build_operation_graph()
    if G.dry:
        _dry_callbacks(g)
    else:
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    return (time.perf_counter() - t0) * 1e3

def alloc_ws(g, **ov): return torch.empty(0 if G.dry else g.get_workspace_size(**ov), dtype=torch.uint8, device=G.dev)

def check_pack(g, pack, cover=True):
    """Every non-virtual IR tensor bound, with its dtype, its pass-by-value-ness and (cover) a buffer covering its dims."""
    missing = [t.name for t in g._tensor_by_uid.values() if not t.is_virtual and t.pass_by_value is None and t not in pack]
    if missing:
        raise RuntimeError(f"variant pack lacks {missing}")
    for t, x in pack.items():
        if TDT.get(x.dtype) != t.data_type:
            raise TypeError(f"{t.name}: buffer {x.dtype} vs graph {t.data_type}")
        if cover and t.ragged_offset is None and not t.is_pass_by_value and x.numel() < 1 + sum((a - 1) * s for a, s in zip(t.dim, t.stride)):
            raise ValueError(f"{t.name}: {x.numel()} elements do not cover dims {list(t.dim)} strides {list(t.stride)}")
        if not G.dry and t.is_pass_by_value != (x.device.type == "cpu"):
            raise ValueError(f"{t.name}: pass-by-value {t.is_pass_by_value} but buffer on {x.device}")

def execute(g, names, b, ws, **kw):
    pack = {t: b[n] for t, n in names.items()}
    check_pack(g, pack, cover=not kw)  # shape overrides: buffers smaller than the declaration
    None if G.dry else g.execute(pack, ws, handle=G.h, **kw)

def plan_name(g):
    try:
        return "python:" + g.selected_engine.name if g.selected_engine is not None else g.get_plan_name_at_index(g._plan_index)
    except Exception as e:  # noqa: BLE001
        return "? " + short(e, 60)

class _FakeT:  # dry run: what the callbacks get instead of C++ tensors
    def __getattr__(self, a):
        if a.startswith("set_"):
            return lambda *x, **k: self
        raise AttributeError(a)

class _FakeG:  # dry run: checks op names and keyword names against the C++ graph's signatures
    def __getattr__(self, name):
        real = getattr(cudnn._pybind_module.backend_graph, name, None)
        if real is None:
            raise AttributeError(f"the C++ graph has no op {name!r}")
        params = set().union(*[re.findall(r"(\w+):", ln.split("->")[0]) for ln in (real.__doc__ or "").splitlines()
                               if ln.strip().lstrip("0123456789. `").startswith(name + "(self")])
        def op(*a, **k):
            if set(k) - params:
                raise TypeError(f"{name}() has no argument {set(k) - params}; it has {sorted(params)}")
            if any(not isinstance(x, (_FakeT, IRTensor)) for x in list(a) + [v for n, v in k.items() if n not in ("compute_data_type", "name", "axis")]):
                raise TypeError(f"{name}() got a non-tensor where a tensor is needed")
            return _FakeT()
        return op

def _dry_callbacks(g):
    for node in g._nodes:
        for key in ("score_mod", "score_mod_bprop"):
            fn = node.params.get(key)
            if fn is not None and not isinstance(fn(_FakeG(), _FakeT()), (_FakeT, IRTensor)):
                raise TypeError(f"{key} returned no tensor")

# --------------------------------------------------------------------------------------------- reference
def to_bhsd(sp, x, side):
    if not sp.thd:
        return x.permute(0, 2, 1, 3)
    S, lens = (sp.Sq, sp.lens_q) if side == "q" else (sp.Skv, sp.lens_kv)
    out = x.new_zeros(sp.B, S, x.shape[1], x.shape[2])
    for b, (s0, L) in enumerate(zip(starts(lens, sp.gap)[0], lens)):
        out[b, :L] = x[s0:s0 + L]
    return out.permute(0, 2, 1, 3)

def from_bhsd(sp, y, side, like):
    if not sp.thd:
        return y.permute(0, 2, 1, 3)
    lens, out = sp.lens_q if side == "q" else sp.lens_kv, torch.zeros(like.shape, dtype=y.dtype, device=y.device)
    for b, (s0, L) in enumerate(zip(starts(lens, sp.gap)[0], lens)):
        out[s0:s0 + L] = y[b, :, :L].transpose(0, 1)
    return out

def rows_mask(sp, side, like, seq=None):
    """Bool over a buffer's leading dims: the rows a real query (side q) / key (side kv) occupies [of sequence seq]."""
    S, lens, dev = (sp.Sq, sp.lens_q, like.device) if side == "q" else (sp.Skv, sp.lens_kv, like.device)
    if not sp.thd:
        m = torch.arange(S, device=dev)[None] < torch.tensor(lens if lens is not None else [S] * sp.B, device=dev)[:, None]
        return m if seq is None else m & (torch.arange(sp.B, device=dev)[:, None] == seq)
    m = torch.zeros(like.shape[0], dtype=torch.bool, device=dev)
    for b, (s0, L) in enumerate(zip(starts(lens, sp.gap)[0], lens)):
        m[s0:s0 + L] |= seq is None or seq == b
    return m

def ref_core(q, k, v, do, scale, eager=None, ctx=None, bias=None, mask=None, sink=None, drop=None, p=0.0, grads=True):
    """softmax([score_mod(scale QK^T) + bias, masked; sink logit]) [* dropout mask / (1-p)] V, with autograd."""
    for x in (q, k, v, bias, sink):
        None if x is None else x.requires_grad_(grads)
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    s = eager(s, ctx) if eager is not None else s
    s = s + bias if bias is not None else s
    s = s.masked_fill(~mask, float("-inf")) if mask is not None else s
    if sink is not None:
        z = torch.cat([s, sink.expand(s.shape[0], -1, s.shape[2], 1)], -1)
        lse = torch.logsumexp(z, -1)
        pr = torch.exp(z - lse[..., None])[..., :-1]
    else:  # a row with every key masked: output 0, LSE -inf (no NaN, also in the gradients)
        ok = torch.isfinite(s).any(-1, keepdim=True)
        s2 = torch.where(ok, s, torch.zeros_like(s))
        lse = torch.logsumexp(s2, -1)
        pr = torch.where(ok, torch.exp(s2 - lse[..., None]), torch.zeros_like(s2))
        lse = lse.masked_fill(~ok[..., 0], float("-inf"))
    o = (pr * drop / (1 - p) if drop is not None else pr) @ vv
    r = dict(o=o.detach(), lse=lse.detach())
    if grads:
        o.backward(do)
        r.update(dq=q.grad, dk=k.grad, dv=v.grad, dbias=bias.grad if bias is not None else None, dsink=sink.grad if sink is not None else None)
    return r

def cmp(name, got, ref, rows=None):
    g, r = got.double(), ref.double()
    g, r = (g[rows], r[rows]) if rows is not None else (g, r)
    bad = int(torch.isnan(g).sum()) + int(((torch.isinf(g) != torch.isinf(r)) & ~torch.isnan(g)).sum())
    fin = torch.isfinite(g) & torch.isfinite(r)
    d, den = (g - r)[fin], r[fin].norm()
    return {f"{name}_rel": (d.norm() / den).item() if den > 0 else d.norm().item(),
            f"{name}_max": d.abs().max().item() if d.numel() else NAN, f"{name}_nan": bad}

def evaluate(sp, b, bwd=True, rdt=torch.float64, sanitize=False, per_seq=False):
    """Errors of the buffers' outputs against ref_core on the same inputs (sanitize: NaN inputs -> 0 first)."""
    B, dev = sp.B, b["q"].device
    X = {n: to_bhsd(sp, b[n], side).to(rdt, copy=True) for n, side in (("q", "q"), ("k", "kv"), ("v", "kv"), ("do", "q"))}
    X = {n: x.nan_to_num(0.0) for n, x in X.items()} if sanitize else X
    lq, lk = (torch.tensor(ls if ls is not None else [S] * B, device=dev).view(B, 1, 1, 1) for ls, S in ((sp.lens_q, sp.Sq), (sp.lens_kv, sp.Skv)))
    ctx = dict(I=torch.arange(sp.Sq, device=dev)[:, None], J=torch.arange(sp.Skv, device=dev)[None, :], lq=lq, lk=lk)
    mask = (ctx["I"] < lq) & (ctx["J"] < lk)
    for extra in (sp.mask, sp.mod.mask if sp.mod else None):
        mask = mask & extra(ctx) if extra is not None else mask
    r = ref_core(X["q"], X["k"], X["v"], X["do"], sp.scale, eager=sp.mod.eager if sp.mod else None, ctx=ctx,
                 bias=b["bias"].to(rdt, copy=True) if sp.bias is not None else None, mask=mask,
                 sink=b["sink"].to(rdt, copy=True) if sp.sink is not None else None,
                 drop=(b["rng"] != 0).to(rdt) if sp.drop else None, p=sp.drop["p"] if sp.drop else 0.0, grads=bwd)
    r["out"] = r["o"]
    outs = [("out", "o", "q")] + ([("dq", "dq", "q"), ("dk", "dk", "kv"), ("dv", "dv", "kv")] if bwd else [])
    res = {}
    for n, bn, side in outs:
        res.update(cmp(n, b[bn], from_bhsd(sp, r[n], side, b[bn]), rows_mask(sp, side, b[bn])))
        if n == "out":
            res.update(cmp("lse", b["lse"][..., 0], r["lse"], (ctx["I"][:, 0][None] < lq.view(B, 1))[:, None].expand(B, sp.H, sp.Sq)))
    if bwd and sp.bias is not None and sp.dbias:
        res.update(cmp("dbias", b["dbias"], r["dbias"]))
    if bwd and sp.sink is not None:
        res.update(cmp("dsink", b["dsink"], r["dsink"]))
    for n, bn, side in (outs if per_seq else ()):
        ref = from_bhsd(sp, r[n], side, b[bn])
        res["seq_" + n] = " ".join("%.0e" % cmp(n, b[bn], ref, rows_mask(sp, side, b[bn], seq=s))[n + "_rel"] for s in range(B))
    res["ok"] = all((v < 2e-2 if k.endswith("_rel") else v == 0) for k, v in res.items() if k.endswith(("_rel", "_nan")))
    return res

# ---------------------------------------------------------------------------------------- run and time
def attn(sp, bwd=True, per_seq=False):
    """Build, run and check the forward (and backward) graphs of a Spec; a backward refusal is recorded, not raised."""
    R = NS(sp=sp, bufs=make_bufs(sp), res={}, gb=None)
    R.gf, R.nf, bt = build_fwd(sp)
    R.wsf = alloc_ws(R.gf)
    R.res.update(build_f_ms=bt, ws_f=R.wsf.numel())
    execute(R.gf, R.nf, R.bufs, R.wsf)
    try:
        if bwd:
            R.gb, R.nb, bt = build_bwd(sp)
            R.wsb = alloc_ws(R.gb)
            R.res.update(build_b_ms=bt, ws_b=R.wsb.numel())
            execute(R.gb, R.nb, R.bufs, R.wsb)
    except Exception as e:  # noqa: BLE001
        R.res["bwd_error"], R.gb = short(e), None
        G.rep.refuse("backward", e)
    sync()
    R.res.update(evaluate(sp, R.bufs, bwd=R.gb is not None, per_seq=per_seq))
    return R

def rerun(R, sp, prep=None, sanitize=True):
    """R's graphs on fresh buffers for another Spec with the same graph dims (lengths, offsets, values differ)."""
    b = make_bufs(sp)
    None if prep is None else prep(b)
    execute(R.gf, R.nf, b, R.wsf)
    None if R.gb is None else execute(R.gb, R.nb, b, R.wsb)
    sync()
    return b, evaluate(sp, b, bwd=R.gb is not None, sanitize=sanitize)

def host_us(fn, n=2000, chunk=100):
    """Median host time of one call; the queue is drained every `chunk` calls (outside the timed region)."""
    for _ in range(50):
        fn()
    sync()
    ts = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
        None if i % chunk < chunk - 1 else sync()
    sync()
    return statistics.median(ts) / 1e3

def gpu_ms(fn, n=20, warm=3):
    """Median of n CUDA-event timings (host clock in a dry run)."""
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(n):
        e = [NS(t=time.perf_counter(), record=lambda: None) if G.dry else torch.cuda.Event(enable_timing=True) for _ in range(2)]
        e[0].record(), fn(), e[1].record(), sync()
        ts.append((time.perf_counter() - e[0].t) * 1e3 if G.dry else e[0].elapsed_time(e[1]))
    return statistics.median(ts)

def check_fwd(sp, b, nh=2, **over):
    """float32 check of a timed forward: three sequences (thd) or batch 0, heads [0, nh) (dense)."""
    if sp.thd:
        seqs = [0, len(sp.lens_q) // 3, len(sp.lens_q) - 1]
        (sq, _), (sk, _) = starts(sp.lens_q, sp.gap), starts(sp.lens_kv, sp.gap)
        lq, lk = [sp.lens_q[i] for i in seqs], [sp.lens_kv[i] for i in seqs]
        b2 = {n: torch.cat([b[n][sq[i]:sq[i] + sp.lens_q[i]] for i in seqs]) for n in ("q", "o", "do")}
        b2.update({n: torch.cat([b[n][sk[i]:sk[i] + sp.lens_kv[i]] for i in seqs]) for n in ("k", "v")}, lse=b["lse"][seqs][:, :, :max(lq)])
        sp2 = sp.copy(B=3, lens_q=lq, lens_kv=lk, Sq=max(lq), Skv=max(lk), gap=0)
    else:
        b2 = {n: b[n][:1, :, :nh] for n in ("q", "k", "v", "o", "do")}
        b2["lse"] = b["lse"][:1, :nh]
        if sp.bias is not None:
            b2["bias"] = over.setdefault("bias", sp.bias[:1, :nh])
        sp2 = sp.copy(B=1, H=nh, Hkv=nh, **over)
    return {k: v for k, v in evaluate(sp2, b2, bwd=False, rdt=torch.float32).items() if k.startswith(("out", "lse", "ok"))}

def time_fb(sp, flops=None, check=check_fwd, bwd=True):
    """CUDA-event medians of the forward and of forward+backward, plus a float32 check of the forward output."""
    b, res = make_bufs(sp), {}
    runs = []
    for kind, build_ in (("f", build_fwd), ("b", build_bwd))[:2 if bwd else 1]:
        try:
            g, names, res["build_%s_ms" % kind] = build_(sp)
            ws = alloc_ws(g)
            pack = {t: b[n] for t, n in names.items()}
            check_pack(g, pack)
            runs.append((lambda: None) if G.dry else (lambda g=g, pack=pack, ws=ws: g.execute(pack, ws, handle=G.h)))
            res["ws_" + kind] = ws.numel()
            ms = res["fwd_ms" if kind == "f" else "fwd_bwd_ms"] = gpu_ms(lambda: [r() for r in runs])
            if flops:
                res["fwd_TFLOPs" if kind == "f" else "fwd_bwd_TFLOPs"] = (1 if kind == "f" else 3.5) * flops / ms / 1e9
            res.update(check(sp, b) if kind == "f" else {})
        except Exception as e:  # noqa: BLE001
            if kind == "f":
                raise
            res["bwd_error"] = short(e)
            G.rep.refuse("backward (timed)", e)
    return res

# ============================================================================================== sections
def sec_execute_paths():
    """1. Host time of execute(dict) / execute(list, tensor_uids) / _execute_with_raw_ptrs; pass-by-value slots."""
    rows, uids = [], []
    for label, mod in (("plain", None), ("softcap cap=pbv", softcap_mod(1.0)), ("softcap cap=tensor_scalar", softcap_mod(2.0, scalars=True))):
        sp = Spec(B=1, Sq=128, H=1, D=64, mod=mod)
        R = attn(sp)
        for kind in ("fwd", "bwd"):
            row = {"graph": f"{label} {kind}", **{k: v for k, v in R.res.items() if k.startswith(("out", "dq", "ok"))}}
            rows.append(trial(row, lambda: _paths(sp, R, kind, row, uids)))
    G.rep.table("execute paths, B=1 S=128 H=1 D=64 bf16: median host us per call over 2000 calls; `X==dict`: outputs bit-identical "
                "to execute(dict); `X cap 4/1`: out (fwd) or dQ (bwd) rel err after setting the CPU cap tensor to 4, then 1, in place", rows)
    G.rep.table("variant-pack uids: the IR tensors the caller binds vs the lowered graph's sorted uid list", uids)
    for r in rows[:2]:
        G.rep.facts.append(f"{r['graph']}: " + ", ".join(f"{k} {fmt(r[k])}" for k in r if k.endswith(("_us", "==dict"))))
    G.rep.facts += [f"{u['graph']}: pass-by-value in the sorted uid list: {u['pass-by-value listed']}" for u in uids if u["pass-by-value listed"] != "-"]
    s = 0 if G.dry else torch.cuda.current_stream().cuda_stream
    arr8, ts8 = (ctypes.c_int64 * 8)(), [torch.empty(16, device=G.dev) for _ in range(8)]
    def fill8():
        for i, t in enumerate(ts8):
            arr8[i] = t.data_ptr()
    G.rep.table("host cost of the pieces around execute (median us)", [
        dict(call="cudnn.set_stream(h, same stream)", us=host_us(lambda: None if G.dry else cudnn.set_stream(G.h, s))),
        dict(call="torch._C._cuda_getCurrentRawStream(0)", us=host_us(lambda: None if G.dry else torch._C._cuda_getCurrentRawStream(0))),
        dict(call="torch.cuda.current_stream().cuda_stream", us=host_us(lambda: None if G.dry else torch.cuda.current_stream().cuda_stream)),
        dict(call="fill (c_int64*8) from 8 tensor.data_ptr()", us=host_us(fill8))])

def _paths(sp, R, kind, row, uids):
    (g, names, ws), b = ((R.gf, R.nf, R.wsf) if kind == "fwd" else (R.gb, R.nb, R.wsb)), R.bufs
    pack = {t: b[n] for t, n in names.items()}
    bl, ul = list(pack.values()), [t.get_uid() for t in pack]
    row["plan"], lg = plan_name(g), g._lowered_graph
    lg._prepare_variant_pack_template()
    order = list(lg._get_variant_pack_uids_sorted())
    cfg = g._materialize_backend_plan(g._plan_index)
    cpp = -1 if cfg.cpp_index is None else cfg.cpp_index
    byuid = {t.get_uid(): n for t, n in names.items()}
    listed = [byuid.get(u) for u in order]
    uids.append({"graph": row["graph"], "bound by caller (name:uid)": " ".join(f"{n}:{t.get_uid()}" for t, n in names.items()),
                 "sorted uid list": " ".join(f"{byuid.get(u, '?')}:{u}" for u in order), "bound, not listed": " ".join(set(names.values()) - set(listed)) or "-",
                 "pass-by-value listed": " ".join(f"{n}:{n in listed}" for t, n in names.items() if t.is_pass_by_value) or "-",
                 "graph-owned scalars": " ".join(f"{t.name}:{t.uid}:{t.uid in order}" for t in g._tensor_by_uid.values() if t.pass_by_value is not None) or "-",
                 "cpp_index": cpp})
    arr = (ctypes.c_int64 * len(order))(*[b[byuid[u]].data_ptr() if u in byuid else 0 for u in order])
    addr, bh, wsp = ctypes.addressof(arr), G.h.backend_handle, ws.data_ptr()
    paths = {"dict": lambda: g.execute(pack, ws, handle=G.h), "tensor_uids": lambda: g.execute(bl, ws, handle=G.h, tensor_uids=ul)}
    if None in listed:  # a listed slot nobody binds: a raw call would hand the kernel a null pointer
        row["raw_ptrs"] = "skipped: the sorted list holds a uid the caller does not bind"
    else:
        paths["raw_ptrs"] = lambda: lg._execute_with_raw_ptrs(addr, len(order), wsp, bh, cpp)
    outs, first = (["o", "lse"] if kind == "fwd" else ["dq", "dk", "dv"]), None
    for p, fn in paths.items():
        for n in outs:
            b[n].fill_(NAN)
        fn()
        sync()
        got = [b[n].clone() for n in outs]
        first = first or got
        row[f"{p}==dict"] = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, first))  # bitwise
        row[f"{p}_us"] = host_us(fn)
    def fill():
        for i, u in enumerate(order):
            arr[i] = b[byuid[u]].data_ptr()
    if "raw_ptrs" in paths:
        row["fill+raw_ptrs_us"] = host_us(lambda: (fill(), paths["raw_ptrs"]()))
    for p, fn in (paths.items() if sp.mod is not None and not isinstance(sp.mod.ext["cap"], tuple) else ()):
        errs = []
        for cap in (4.0, 1.0):
            sp.mod.ext["cap"].fill_(cap), sp.mod.ext["inv_cap"].fill_(1 / cap)
            None if kind == "fwd" else R.gf.execute({t: b[n] for t, n in R.nf.items()}, R.wsf, handle=G.h)
            for n in outs:
                b[n].fill_(NAN)
            fn()
            sync()
            errs.append(evaluate(sp, b, bwd=kind == "bwd")["out_rel" if kind == "fwd" else "dq_rel"])
        row[f"{p} cap 4/1"] = "%.1e/%.1e" % tuple(errs)

def sec_dynamic_shapes():
    """2. Dynamic shapes with a shared kernel cache, own workspace per graph; override shapes on one graph."""
    kc, rows = None if G.dry else cudnn.create_kernel_cache(), []
    for kind in ("nomask", "causal", "softcap", "thd_causal"):
        for B, S, D in ((2, 256, 64), (1, 384, 64), (3, 1000, 64), (2, 640, 64), (4, 128, 64), (2, 256, 128)):
            rows.append(trial(dict(kind=kind, B=B, S=S, D=D), lambda: attn(spec_kind(kind, B, S, D, dyn=True, kc=kc)).res))
    G.rep.table("is_dynamic_shape_enabled=True, one shared kernel cache, a graph per shape, each with its own get_workspace_size() "
                "workspace (H=4; thd: random lengths, the first = S), in this order", rows)
    G.rep.facts.append("dynamic shapes: ok for " + ", ".join(f"{r['kind']} {r['B']}x{r['S']}x{r['D']}" for r in rows if r.get("ok")) + "; not ok for "
                       + ", ".join(f"{r['kind']} {r['B']}x{r['S']}x{r['D']}" for r in rows if not r.get("ok")))
    rows = []
    for kind in ("nomask", "causal"):
        try:
            big = spec_kind(kind, 4, 1024, dyn=True, kc=None if G.dry else cudnn.create_kernel_cache(), override=True)
            (gf, nf, _), (gb, nb, _) = build_fwd(big), build_bwd(big)
        except Exception as e:  # noqa: BLE001
            rows.append(dict(kind=kind, error=short(e)))
            G.rep.refuse(f"override graphs {kind}", e)
            continue
        for B, S in ((4, 1024), (2, 256), (1, 384), (3, 1000)):
            rows.append(trial(dict(kind=kind, built="4x1024", run=f"{B}x{S}"), lambda: _override_run(spec_kind(kind, B, S), gf, nf, gb, nb)))
    G.rep.table("one graph pair built for 4x1024 (dynamic + is_override_shape_enabled), run at shapes no larger through "
                "execute(override_uids/shapes/strides), workspace from get_workspace_size(override_...) per call", rows)

def _override_run(sp, gf, nf, gb, nb):
    b, res = make_bufs(sp), {}
    for k, g, names in (("f", gf, nf), ("b", gb, nb)):
        ov = dict(override_uids=[], override_shapes=[], override_strides=[])
        for t, n in names.items():
            if n in ("q", "o", "do", "dq", "k", "v", "dk", "dv", "lse"):
                d, s = ([sp.B, sp.H, sp.Sq, 1], [sp.H * sp.Sq, sp.Sq, 1, 1]) if n == "lse" else dims(sp, "q" if n in ("q", "o", "do", "dq") else "kv")
                ov["override_uids"].append(t.get_uid()), ov["override_shapes"].append(d), ov["override_strides"].append(s)
        ws = alloc_ws(g, **ov)
        res["ws_" + k] = ws.numel()
        execute(g, names, b, ws, **ov)
    sync()
    return {**res, **evaluate(sp, b)}

CHILD = r'''
import sys, time
t0 = time.perf_counter()
import torch, cudnn
imp, t0 = time.perf_counter() - t0, time.perf_counter()
h = cudnn.create_handle()
cudnn.set_stream(h, torch.cuda.current_stream().cuda_stream)
th, out = time.perf_counter() - t0, []
for e in torch.load(sys.argv[1], weights_only=False):
    b, gs = {n: (t if n in e["cpu"] else t.cuda()) for n, t in e["bufs"].items()}, []
    for blob, uid2name in e["graphs"]:
        r = {}
        try:
            g, t0 = cudnn.pygraph(handle=h), time.perf_counter()
            g.deserialize(h, blob)
            r["deser_ms"] = (time.perf_counter() - t0) * 1e3
            try:
                g._lowered_graph._prepare_variant_pack_template()
                r["uids"] = list(g._lowered_graph._get_variant_pack_uids_sorted())
            except Exception as ex:
                r["uids"] = repr(ex)[:100]
            ws = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device="cuda")
            r["ws"], t0 = ws.numel(), time.perf_counter()
            g.execute({u: b[n] for u, n in uid2name.items()}, ws, handle=h)
            torch.cuda.synchronize()
            r["exec1_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as ex:
            r["error"] = (type(ex).__name__ + ": " + str(ex))[:1500]
        gs.append(r)
    out.append(dict(label=e["label"], graphs=gs, bufs={n: t.cpu() for n, t in b.items()}))
torch.save(dict(import_s=imp, handle_s=th, entries=out), sys.argv[2])
'''

def sec_serialize():
    """3. serialize() here, deserialize + execute on fresh inputs in a fresh process."""
    if G.dry:
        raise RuntimeError("dry run: nothing is planned, so nothing can be serialized")
    rows, entries, keep = [], [], []
    for label, sp in (("plain", Spec()), ("causal band", spec_kind("causal", 2, 256)), ("softcap score_mod", spec_kind("softcap", 2, 256)),
                      ("thd causal band", spec_kind("thd_causal", 3, 256))):
        row = dict(case=label)
        rows.append(row)
        try:
            R = attn(sp)
            row.update(build_f_ms=R.res["build_f_ms"], build_b_ms=R.res.get("build_b_ms", NAN), parent_ok=R.res["ok"])
            blobs = []
            for k, g, names in (("f", R.gf, R.nf), ("b", R.gb, R.nb)):
                t0 = time.perf_counter()
                blob = bytes(g.serialize(as_bytes=True))
                row["serialize_%s_ms" % k], row["bytes_" + k] = (time.perf_counter() - t0) * 1e3, len(blob)
                blobs.append((blob, {t.get_uid(): n for t, n in names.items()}))
            fresh = make_bufs(sp)  # new random inputs, NaN outputs
            cpu = [n for n, t in fresh.items() if t.device.type == "cpu"]
            entries.append(dict(label=label, graphs=blobs, bufs={n: t.cpu() for n, t in fresh.items()}, cpu=cpu))
            keep.append((row, sp, cpu))
        except Exception as e:  # noqa: BLE001
            row["error"] = short(e)
            G.rep.refuse(label, e)
    with tempfile.TemporaryDirectory() as td:
        pin, pout, script = (os.path.join(td, n) for n in ("in.pt", "out.pt", "child.py"))
        torch.save(entries, pin)
        with open(script, "w") as f:
            f.write(CHILD)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, script, pin, pout], capture_output=True, text=True, timeout=240)
        wall = time.perf_counter() - t0
        if r.returncode != 0 or not os.path.exists(pout):
            raise RuntimeError(f"child exited {r.returncode}: {r.stderr[-1500:]}")
        res = torch.load(pout, weights_only=False)
    for (row, sp, cpu), e in zip(keep, res["entries"]):
        for k, gi in zip("fb", e["graphs"]):
            row["deser_%s_ms" % k], row["exec1_%s_ms" % k] = gi.get("deser_ms", NAN), gi.get("exec1_ms", NAN)
            if "error" in gi:
                row["child_%s_error" % k] = gi["error"][:200]
                G.rep.refuse(f"deserialize {row['case']} {k}", RuntimeError(gi["error"]))
        row.update(evaluate(sp, {n: t if n in cpu else t.to(G.dev) for n, t in e["bufs"].items()}))
    G.rep.table("serialize(as_bytes=True) in this process; pygraph(handle=h).deserialize(h, blob) + execute on fresh inputs in a "
                "fresh process (errors: the child's outputs vs the reference; build ms here are not first builds)", rows)
    G.rep.emit(f"Child process: wall {wall:.1f} s, `import torch, cudnn` {res['import_s']:.2f} s, create_handle+set_stream "
               f"{res['handle_s'] * 1e3:.0f} ms; sorted uids of the deserialized graphs: "
               + "; ".join(f"{e['label']}: {[gi.get('uids') for gi in e['graphs']]}" for e in res["entries"]) + "\n")

def sec_sinks():
    """4. sink_token forward, sink_token + dSink_token backward."""
    lens, rows = [256, 100, 37], []
    for label, kw in (("dense", {}), ("causal band", dict(kw=CAUSAL, mask=m_causal)), ("window band left 64", dict(kw=window(64), mask=m_window(64))),
                      ("softcap score_mod", dict(mod=softcap_mod(2.0))), ("causal score_mod", dict(mod=causal_mod())), ("gqa 8/2", dict(H=8, Hkv=2)),
                      ("thd padding", dict(B=3, thd=True, lens_q=lens, lens_kv=lens, kw=PAD)),
                      ("thd causal band", dict(B=3, thd=True, lens_q=lens, lens_kv=lens, kw=dict(**PAD, **CAUSAL), mask=m_causal))):
        sp = Spec(**{**dict(B=2, Sq=256, H=4, D=64), **kw})
        sp.sink = torch.randn(1, sp.H, 1, 1, device=G.dev) * 1.5
        rows.append(trial(dict(case=label), lambda: attn(sp).res))
    G.rep.table("sink_token (1,H,1,1) fp32; reference: softmax over [scores, sink], LSE includes the sink (B=2 S=256 H=4 D=64 bf16)", rows)

def sec_dropout():
    """5. dropout=(p, seed, offset) with rng_dump; the backward against the dumped mask; determinism."""
    D0, lens, rows = dict(p=0.1, seed=1234, offset=77), [256, 100, 37], []
    for label, kw in (("p=0.1 seed/offset GPU int64", dict(drop=D0)), ("p=0.1 seed/offset CPU int64 pass-by-value", dict(drop={**D0, "cpu": True})),
                      ("p=0.5", dict(drop={**D0, "p": 0.5})), ("p=0.1 causal band", dict(drop=D0, kw=CAUSAL, mask=m_causal)),
                      ("p=0.1 softcap score_mod", dict(drop=D0, mod=softcap_mod(2.0))),
                      ("p=0.1 thd padding", dict(drop=D0, B=3, thd=True, lens_q=lens, lens_kv=lens, kw=PAD))):
        rows.append(trial(dict(case=label), lambda: _dropout_case(Spec(**{**dict(B=2, Sq=256, H=4, D=64), **kw}))))
    G.rep.table("dropout with rng_dump (B,H,Sq,Skv) fp32; reference keeps rng != 0 scaled 1/(1-p); the backward (same seed/offset) "
                "against the same mask; then the forward again with the same and with offset+1", rows)

def _dropout_case(sp):
    R = attn(sp)
    b, res = R.bufs, dict(R.res)
    fin = b["rng"][torch.isfinite(b["rng"])]
    res.update({"rng values": " ".join("%.4g" % v for v in torch.unique(fin)[:4].tolist()) or "none", "rng unwritten (NaN)": int(torch.isnan(b["rng"]).sum()),
                "kept fraction": (fin != 0).double().mean().item() if fin.numel() else NAN})
    o0, r0 = b["o"].clone(), b["rng"].clone()
    execute(R.gf, R.nf, b, R.wsf)
    sync()
    res["same seed/offset: identical"] = torch.equal(o0, b["o"]) and torch.equal(r0.nan_to_num(), b["rng"].nan_to_num())
    b["offset"].add_(1)
    execute(R.gf, R.nf, b, R.wsf)
    sync()
    res["offset+1: rng entries changed"] = ((r0 != b["rng"]) & torch.isfinite(r0)).double().mean().item()
    b["offset"].sub_(1)
    return res

def sec_bias():
    """6. bias input + dBias per broadcast shape and dtype; score_mod/bias order; timing of the bias forms."""
    B, H, S, rows = 2, 4, 256, []
    for shape in ((1, H, S, S), (B, 1, S, S), (B, H, S, S), (1, 1, S, S)):
        for dt in (torch.float32, torch.bfloat16):
            sp = Spec(B=B, Sq=S, H=H, D=64, bias=torch.randn(shape, device=G.dev).to(dt), dbias=True)
            rows.append(trial(dict(bias=str(list(shape)), dtype=str(dt)[6:]), lambda: _bias_case(sp)))
    for dt in (torch.float32, torch.bfloat16):
        bias = (torch.randn(1, H, S, S, device=G.dev) * 2).to(dt)
        sp = Spec(B=B, Sq=S, H=H, D=64, bias=bias, dbias=True, mod=softcap_mod(2.0))
        def run(sp=sp, bias=bias):
            R = attn(sp)
            alt = sp.copy(bias=None, mod=Mod(None, eager=lambda s, c: 2.0 * torch.tanh((s + bias.to(s.dtype)) / 2.0)))
            return {**R.res, "out_rel if bias were applied before the mod": evaluate(alt, R.bufs, bwd=False)["out_rel"]}
        rows.append(trial(dict(bias=f"[1,{H},S,S] + softcap score_mod", dtype=str(dt)[6:]), run))
    G.rep.table("bias input + dBias output (B=2 H=4 S=256 D=64 bf16); the reference applies the score_mod, then the bias", rows)
    B, H, S = SZ(2, 1), SZ(16, 2), SZ(4096, 256)
    base, b16 = Spec(B=B, Sq=S, H=H, D=128), torch.randn(1, H, S, S, device=G.dev, dtype=torch.bfloat16)
    b32, rows = b16.float(), []
    for label, sp, over in (("no bias", base, {}), ("bias input bf16", base.copy(bias=b16), {}), ("bias input bf16 + dBias", base.copy(bias=b16, dbias=True), {}),
                            ("bias input fp32", base.copy(bias=b32), {}), ("bias input fp32 + dBias", base.copy(bias=b32, dbias=True), {}),
                            ("add(score, bias) in score_mod, bf16", base.copy(mod=bias_mod(b16)), dict(mod=bias_mod(b16[:1, :2]))),
                            ("add(score, bias) in score_mod, fp32", base.copy(mod=bias_mod(b32)), dict(mod=bias_mod(b32[:1, :2])))):
        rows.append(trial(dict(config=label), lambda: time_fb(sp, 4 * B * H * S * S * 128, check=lambda s, b: check_fwd(s, b, **over))))
    G.rep.table(f"bias timing B={B} H={H} S={S} D=128 bf16, bias [1,H,S,S], CUDA events, median of 20; out = float32 check of batch 0 "
                "heads 0-1; TFLOP/s count 4BHS^2D forward, 3.5x that forward+backward", rows)

def _bias_case(sp):
    R = attn(sp)
    res = dict(R.res)
    if "bwd_error" in res:  # dBias refused: does the backward run without it?
        R2 = attn(sp.copy(dbias=False))
        res["bwd without dBias"] = R2.res.get("bwd_error") or "dq %.1e ok=%s" % (R2.res.get("dq_rel", NAN), R2.res["ok"])
    return res

def sec_nan_dq():
    """7. dQ NaN when Skv = 64 mod 128 and a row's LSE < -88.7; mitigations."""
    def nb(Sq, Skv):
        bias = torch.zeros(1, 1, Sq, Skv, device=G.dev)
        bias[..., Sq // 2:, :] = -200.0  # the LSE of those rows is about -200
        return bias
    def pad_mod(bias, skv):
        return Mod(lambda gr, s, T, M: gr.binary_select(F(gr.add(s, T["bias"])), T["neg"], cmpf(gr, "cmp_lt", idx(gr, s, 3), T["skv"])),
                   None, dict(bias=bias, neg=NEG(), skv=pbv(float(skv))), eager=lambda s, c: s + bias.to(s.dtype), mask=lambda c: c["J"] < skv)
    def clamp_mod(bias):
        def fwd(gr, s, T, M):
            M["x"] = x = F(gr.add(s, T["bias"]))
            return F(gr.max(x, T["lo"]))
        return Mod(fwd, lambda gr, ds, T, M: gr.binary_select(ds, T["zero"], cmpf(gr, "cmp_gt", M["x"], T["lo"])),
                   dict(bias=bias, lo=pbv(-80.0), zero=pbv(0.0)), eager=lambda s, c: torch.clamp(s + bias.to(s.dtype), min=-80.0))
    rows = []
    for Skv in (128, 192, 256, 320, 384, 448):
        for Sq in sorted({Skv, 128}):
            bias, P, base = nb(Sq, Skv), -(-Skv // 128) * 128, Spec(B=1, Sq=Sq, Skv=Skv, H=2, D=64)
            cases = [("a bias input", base.copy(bias=bias)), ("b add(bias) in score_mod", base.copy(mod=bias_mod(bias)))]
            if Skv in (192, 320):
                cases += [(f"c keys padded to {P} + padding mask, seq_len_kv {Skv}", base.copy(Skv=P, bias=nb(Sq, P), lens_q=[Sq], lens_kv=[Skv], kw=PAD)),
                          (f"d keys padded to {P}, score_mod mask kv < {Skv}", base.copy(Skv=P, mod=pad_mod(nb(Sq, P), Skv))),
                          ("e score_mod max(s + bias, -80)", base.copy(mod=clamp_mod(bias)))]
            for label, sp in cases:
                rows.append(trial(dict(Sq=Sq, Skv=Skv, case=label), lambda: attn(sp).res))
    G.rep.table("dQ NaN fault: bias -200 on the lower half of the query rows (B=1 H=2 D=64 bf16)", rows)

def _natten_ref(c, r=3, w=16):
    I, J = c["I"], c["J"]
    return ((I // w - J // w).abs() <= r) & ((I % w - J % w).abs() <= r)

def natten_mod(S, inline, bprop, alive=None, r=3, w=16):
    """2-D neighbourhood on a w x w grid, |dy| <= r and |dx| <= r; coordinates in-graph (floor(div)) or precomputed
    (1,1,S,1)/(1,1,1,S) tensors added to an index-derived zero; `alive` (S,) bool kills query rows."""
    i = torch.arange(S, device=G.dev)
    ext = dict(neg=NEG(), zero=pbv(0.0), w=pbv(float(w)), lo=pbv(-float(r)), hi=pbv(float(r)), half=pbv(0.5))
    if not inline:
        ext.update(qy=(i // w).float().view(1, 1, S, 1), qx=(i % w).float().view(1, 1, S, 1), ky=(i // w).float().view(1, 1, 1, S), kx=(i % w).float().view(1, 1, 1, S))
    if alive is not None:
        ext["aq"] = alive.float().view(1, 1, S, 1)
    def fwd(gr, s, T, M):
        r_, conds = idx(gr, s, 2), []
        z = F(gr.sub(r_, r_)) if not inline or alive is not None else None  # no dangling ops
        if inline:
            def yx(t):
                y = F(gr.floor(F(gr.div(t, T["w"]))))
                return y, F(gr.sub(t, F(gr.mul(y, T["w"]))))
            (qy, qx), (ky, kx) = yx(r_), yx(idx(gr, s, 3))
            ds = [F(gr.sub(qy, ky)), F(gr.sub(qx, kx))]
        else:
            ds = [F(gr.sub(F(gr.add(z, T[a])), T[b_])) for a, b_ in (("qy", "ky"), ("qx", "kx"))]
        for d in ds:
            conds += [cmpf(gr, "cmp_ge", d, T["lo"]), cmpf(gr, "cmp_le", d, T["hi"])]
        if alive is not None:
            conds.append(cmpf(gr, "cmp_ge", F(gr.add(z, T["aq"])), T["half"]))
        return masked(gr, s, T, M, conds)
    return Mod(fwd, sel_bprop if bprop == "sel" else None, ext, mask=lambda c: _natten_ref(c, r, w) & (True if alive is None else alive[c["I"]]))

def doc_mod(ids_q, ids_k, bprop):
    S = ids_q.numel()
    def fwd(gr, s, T, M):
        c = idx(gr, s, 3)
        return masked(gr, s, T, M, [cmpf(gr, "cmp_eq", F(gr.add(F(gr.sub(c, c)), T["iq"])), T["ik"])])
    return Mod(fwd, sel_bprop if bprop == "sel" else None, dict(neg=NEG(), zero=pbv(0.0), iq=ids_q.float().view(1, 1, S, 1), ik=ids_k.float().view(1, 1, 1, S)),
               mask=lambda c: ids_q[c["I"]] == ids_k[c["J"]])

def _dead(m):  # fully masked query rows and 128x128 tiles of a (S,S) keep-mask
    m = m.reshape(m.shape[-2], m.shape[-1])
    return dict(dead_rows=int((~m.any(-1)).sum()), dead_tiles=int((~m.view(m.shape[0] // 128, 128, -1, 128).any(3).any(1)).sum()))

def sec_mask_dq():
    """8. Irregular masks: forward vs dQ/dK/dV per formulation, dtype, bprop, fully masked rows / tiles."""
    S, gen = 256, torch.Generator().manual_seed(4)
    ids = torch.zeros(S, dtype=torch.long)
    for cpos in sorted(torch.randperm(S - 1, generator=gen)[:4].add(1).tolist()):
        ids[cpos:] += 1
    ids = ids.to(G.dev)
    dead_q, alive = ids.clone(), torch.arange(S, device=G.dev) >= 16
    dead_q[:16] = 99  # query rows 0-15 match no key
    cases = []
    for dt in (torch.float16, torch.bfloat16):
        for bp in ("id", "sel"):
            if dt == torch.float16:
                cases += [("natten in-graph floor(div)", dt, bp, lambda bp=bp: natten_mod(S, True, bp)),
                          ("natten precomputed coords, rows 0-15 dead", dt, bp, lambda bp=bp: natten_mod(S, False, bp, alive)),
                          ("doc ids, rows 0-15 dead", dt, bp, lambda bp=bp: doc_mod(dead_q, ids, bp))]
            cases += [("natten precomputed coords", dt, bp, lambda bp=bp: natten_mod(S, False, bp)), ("doc ids", dt, bp, lambda bp=bp: doc_mod(ids, ids, bp))]
    rows, ctx = [], dict(I=torch.arange(S, device=G.dev)[:, None], J=torch.arange(S, device=G.dev)[None, :])
    for label, dt, bp, mk in cases:
        def run(dt=dt, mk=mk):
            sp = Spec(B=1, Sq=S, H=2, D=64, dt=dt, mod=mk())
            return {**_dead(sp.mod.mask(ctx)), **attn(sp).res}
        rows.append(trial(dict(mask=label, dtype=str(dt)[6:], bprop=bp), run))
    keep = (torch.rand(S // 64, S // 64, generator=gen) < 0.5) | torch.eye(S // 64, dtype=torch.bool)
    blk = keep.repeat_interleave(64, 0).repeat_interleave(64, 1).to(G.dev)
    for dt, neg, dead in ((torch.float16, -math.inf, False), (torch.float16, -1e9, False), (torch.bfloat16, -math.inf, False), (torch.bfloat16, -1e9, False),
                          (torch.float16, -math.inf, True), (torch.float16, -1e9, True)):
        m = blk.clone()
        m[:16] = m[:16] & (not dead)
        sp = Spec(B=1, Sq=S, H=2, D=64, dt=dt, bias=torch.zeros(1, 1, S, S, device=G.dev).masked_fill(~m, neg))
        rows.append(trial(dict(mask=f"block-sparse 64x64 bias 0/{neg:g}" + (", rows 0-15 dead" if dead else ""), dtype=str(dt)[6:], bprop="(bias input)"),
                          lambda sp=sp, m=m: {**_dead(m), **attn(sp).res}))
    G.rep.table("irregular masks (B=1 H=2 S=256 D=64) by score_mod select(-inf) or additive bias; bprop id: dS passes through, sel: "
                "binary_select(dS, 0, mask); dead_* = query rows / 128x128 tiles with no visible key (-1e9 rows are not dead: uniform)", rows)

def _int_mods():
    w = lambda: dict(neg=NEG(), w=pbv(16.0))  # noqa: E731
    def eqmask(f):
        return lambda gr, s, T, M: gr.binary_select(s, T["neg"], cmpf(gr, "cmp_eq", f(gr, idx(gr, s, 2), T), f(gr, idx(gr, s, 3), T)))
    def booleq(cdt):
        def fwd(gr, s, T, M):
            r, c = idx(gr, s, 2), idx(gr, s, 3)
            a, b = cmpf(gr, "cmp_le", c, r), cmpf(gr, "cmp_lt", F(gr.sub(r, c)), T["w32"])
            return gr.binary_select(s, T["neg"], Bo(gr.cmp_eq(a, b, compute_data_type=cdt)))
        return Mod(fwd, None, dict(neg=NEG(), w32=pbv(32.0)), mask=lambda c: (c["J"] <= c["I"]) & (c["I"] - c["J"] < 32))
    def gelu_f(gr, s, T, M):
        M["s"], a = s, F(gr.mul(s, T["half"]))
        M["e"] = e = F(gr.erf(F(gr.mul(s, T["isq2"]))))
        return F(gr.add(a, F(gr.mul(a, e))))
    def gelu_b(gr, ds, T, M):  # d/ds = 0.5 (1 + erf(s/sqrt2)) + s exp(-s^2/2) / sqrt(2 pi)
        t1, ex = F(gr.mul(ds, T["half"])), F(gr.exp(F(gr.mul(F(gr.mul(M["s"], M["s"])), T["mhalf"]))))
        return F(gr.add(F(gr.add(t1, F(gr.mul(t1, M["e"])))), F(gr.mul(F(gr.mul(ds, M["s"])), F(gr.mul(ex, T["c2"]))))))
    def pow_f(gr, s, T, M):
        M["s"] = s
        return F(gr.add(F(gr.mul(s, T["half"])), F(gr.mul(F(gr.pow(s, T["two"])), T["c01"]))))
    def rec_f(gr, s, T, M):
        M["s"] = s
        M["r"] = r = F(gr.reciprocal(F(gr.add(F(gr.mul(s, s)), T["one"]))))
        return F(gr.add(s, r))
    return [
        ("floor(div(idx, 16)) block-diagonal", Mod(eqmask(lambda gr, i, T: F(gr.floor(F(gr.div(i, T["w"]))))), None, w(), mask=lambda c: c["I"] // 16 == c["J"] // 16)),
        ("idx - mod(idx, 16) block-diagonal", Mod(eqmask(lambda gr, i, T: F(gr.sub(i, F(gr.mod(i, T["w"]))))), None, w(), mask=lambda c: c["I"] // 16 == c["J"] // 16)),
        ("ceil(div(idx, 16)) blocks", Mod(eqmask(lambda gr, i, T: F(gr.ceil(F(gr.div(i, T["w"]))))), None, w(), mask=lambda c: (c["I"] + 15) // 16 == (c["J"] + 15) // 16)),
        ("cmp_eq(bool, bool) compute FLOAT", booleq(DT.FLOAT)), ("cmp_eq(bool, bool) compute BOOLEAN", booleq(DT.BOOLEAN)),
        ("logical_not(kv > q) causal", Mod(lambda gr, s, T, M: gr.binary_select(s, T["neg"], Bo(gr.logical_not(cmpf(gr, "cmp_gt", idx(gr, s, 3), idx(gr, s, 2))))),
                                           None, dict(neg=NEG()), mask=m_causal)),
        ("erf GELU 0.5 s (1 + erf(s/sqrt2)), chain-rule bprop", Mod(gelu_f, gelu_b, dict(half=pbv(0.5), isq2=pbv(2 ** -0.5), mhalf=pbv(-0.5), c2=pbv((2 * math.pi) ** -0.5)),
                                                                    eager=lambda s, c: 0.5 * s * (1 + torch.erf(s * 2 ** -0.5)))),
        ("pow: 0.5 s + 0.1 pow(s, 2)", Mod(pow_f, lambda gr, ds, T, M: F(gr.add(F(gr.mul(ds, T["half"])), F(gr.mul(F(gr.mul(ds, M["s"])), T["c02"])))),
                                           dict(half=pbv(0.5), two=pbv(2.0), c01=pbv(0.1), c02=pbv(0.2)), eager=lambda s, c: 0.5 * s + 0.1 * s * s)),
        ("reciprocal: s + 1/(s^2 + 1)", Mod(rec_f, lambda gr, ds, T, M: F(gr.sub(ds, F(gr.mul(F(gr.mul(F(gr.mul(F(gr.mul(ds, M["s"])), M["r"])), M["r"])), T["two"])))),
                                            dict(one=pbv(1.0), two=pbv(2.0)), eager=lambda s, c: s + 1 / (s * s + 1))),
        ("neg: neg(s * -0.5)", Mod(lambda gr, s, T, M: F(gr.neg(F(gr.mul(s, T["mh"])))), lambda gr, ds, T, M: F(gr.neg(F(gr.mul(ds, T["mh"])))),
                                   dict(mh=pbv(-0.5)), eager=lambda s, c: 0.5 * s))]

def sec_int_ops():
    """9. Which pointwise ops the engines accept in score_mod forward and backward graphs."""
    rows = [trial(dict(score_mod=label), lambda: attn(Spec(B=1, Sq=256, H=2, D=64, mod=mod)).res) for label, mod in _int_mods()]
    G.rep.table("pointwise ops inside score_mod, forward and backward (the backward re-runs the forward callback; mask mods: bprop = "
                "identity), B=1 H=2 S=256 D=64 bf16", rows)

def pack_bits(tiles):  # (..., nk) bool -> (..., ceil(nk/8)) uint8; bit j of byte i = tile 8i+j, 1 = keep
    t = torch.nn.functional.pad(tiles.to(torch.uint8), (0, -tiles.shape[-1] % 8)).view(*tiles.shape[:-1], -1, 8)
    return (t * (1 << torch.arange(8, device=t.device, dtype=torch.uint8))).sum(-1).to(torch.uint8)

def sec_block_mask():
    """10. What sdpa(block_mask=...) accepts on this GPU, and whether it skips tiles."""
    B, H, S = 1, 2, 1024
    nt, UNI = S // 128, dict(implementation=cudnn.attention_implementation.UNIFIED)
    tiles = ((torch.rand(B, H, nt, nt, generator=torch.Generator().manual_seed(1)) < 0.5) | torch.eye(nt, dtype=torch.bool)).to(G.dev)
    full = lambda t: t.repeat_interleave(128, -2).repeat_interleave(128, -1)  # noqa: E731
    rows, good = [], None
    for label, bm, t, extra in (("bit-packed uint8 (B,H,nq,ceil(nk/8)), AUTO", pack_bits(tiles), tiles, {}),
                                ("bit-packed uint8, implementation=UNIFIED", pack_bits(tiles), tiles, UNI),
                                ("bit-packed uint8 broadcast (1,1,nq,ceil(nk/8))", pack_bits(tiles[:1, :1]), tiles[:1, :1], {}),
                                ("unpacked BOOLEAN (B,H,nq,nk)", tiles, tiles, {}), ("unpacked UINT8 (B,H,nq,nk)", tiles.to(torch.uint8), tiles, {}),
                                ("unpacked INT32 (B,H,nq,nk)", tiles.int(), tiles, {}), ("unpacked BOOLEAN, UNIFIED", tiles, tiles, UNI)):
        sp = Spec(B=B, Sq=S, H=H, D=64, kw=extra, fwd_in=dict(block_mask=bm), mask=lambda c, t=t: full(t))
        rows.append(trial(dict(block_mask=label, shape=str(list(bm.shape)), dtype=str(bm.dtype)[6:]), lambda: attn(sp, bwd=False).res))
        good = good or (rows[-1].get("ok") and (bm, extra, label))
    G.rep.table("sdpa(block_mask=...) forward, B=1 H=2 S=1024 D=64 bf16, random 128x128 tiles kept (the diagonal always)", rows)
    if not good:
        return G.rep.emit("No block_mask form was accepted and correct: the timing is skipped.\n")
    _block_mask_timing(*good)

def _block_mask_timing(bm0, extra, label):
    B, H, S = SZ(2, 1), SZ(16, 2), SZ(8192, 2048)
    nt = S // 128
    tl = torch.block_diag(*[torch.ones(nt // 16, nt // 16, dtype=torch.bool)] * 16).to(G.dev).expand(B, H, nt, nt).contiguous()
    bm = pack_bits(tl) if bm0.dtype == torch.uint8 and bm0.shape[-1] != bm0.shape[-2] else tl.to(bm0.dtype)
    fl, rows = 4 * B * H * S * S * 64, []
    for name, sp, f in (("no mask", Spec(B=B, Sq=S, H=H, D=64), fl), ("causal band", Spec(B=B, Sq=S, H=H, D=64, kw=CAUSAL, mask=m_causal), fl / 2),
                        (f"block_mask, 16 documents ({label})", Spec(B=B, Sq=S, H=H, D=64, kw=extra, fwd_in=dict(block_mask=bm),
                                                                     mask=lambda c: c["I"] // (S // 16) == c["J"] // (S // 16)), fl / 16)):
        rows.append(trial(dict(config=name), lambda: time_fb(sp, f, bwd=False)))
    G.rep.table(f"block_mask timing, B={B} H={H} S={S} D=64 bf16, forward, median of 20 (TFLOP/s over the unmasked work)", rows)

def br_mod(kind, shift):
    """Softcap + bottom-right causal per sequence (kv_idx - q_idx <= kv_len - q_len) in one of several formulations."""
    sc = softcap_mod(2.0)
    def fwd(gr, s, T, M):
        x = sc.fwd(gr, s, T, M)
        if kind == "a2":
            r, c = idx(gr, s, 2, DT.INT32), idx(gr, s, 3, DT.INT32)
            d = gr.sub(c, r)
            d.set_data_type(DT.INT32)
            return gr.binary_select(x, T["neg"], cmpf(gr, "cmp_le", d, T["si"]))
        r, c = idx(gr, s, 2), idx(gr, s, 3)
        if kind == "d":
            return gr.binary_select(x, T["neg"], cmpf(gr, "cmp_ge", F(gr.add(r, T["si"])), c))
        rhs = T["si"] if kind == "a" else T["sf"] if kind == "b" else F(gr.sub(T["_sl_k"], T["_sl_q"]))
        return gr.binary_select(x, T["neg"], cmpf(gr, "cmp_le", F(gr.sub(c, r)), rhs))
    ext = dict(sc.ext, neg=NEG(), si=shift.int().view(-1, 1, 1, 1), sf=shift.float().view(-1, 1, 1, 1))
    return Mod(fwd, sc.bwd, ext, eager=sc.eager, mask=m_br)

def sec_bottom_right_thd():
    """11. THD with q_len != kv_len per sequence: bottom-right causal together with a softcap score_mod."""
    lq, lk = [5, 1, 37, 128, 64], [9, 3, 37, 200, 64]
    shift, base = torch.tensor(lk, device=G.dev) - torch.tensor(lq, device=G.dev), dict(B=5, Sq=256, H=2, D=64, thd=True, lens_q=lq, lens_kv=lk)
    rows = [trial(dict(variant=label + " + softcap"), lambda: attn(Spec(**base, mod=br_mod(kind, shift)), per_seq=True).res)
            for label, kind in (("a: fp32 kv-q <= shift (B,1,1,1) int32 device", "a"), ("a2: int32 gen_index kv-q <= shift int32", "a2"),
                                ("b: fp32 kv-q <= shift fp32 device", "b"), ("c: kv-q <= sub(seq_len_kv, seq_len_q) in graph", "c"),
                                ("d: q + shift int32 >= kv", "d"))]
    sp = Spec(**base, kw=dict(**PAD, diagonal_alignment=BR, diagonal_band_right_bound=0), mask=m_br)
    rows.append(trial(dict(variant="e: native bottom-right band + padding mask, no softcap"), lambda: attn(sp, per_seq=True).res))
    G.rep.table(f"THD bottom-right causal, (q, kv) lengths {list(zip(lq, lk))}, S_max 256, H=2 D=64 bf16; seq_X = rel err of X per sequence", rows)

def _desc(x):
    x = x.float()
    fin, nan, ninf = x[torch.isfinite(x)], int(torch.isnan(x).sum()), int((x == -math.inf).sum())
    s = f"{x.numel()} values" + (f", finite {fin.min().item():.3g}..{fin.max().item():.3g} (7.0 = unwritten: {int((fin == 7.0).sum())})" if fin.numel() else "")
    return s + (f", nan {nan}" if nan else "") + (f", -inf {ninf}" if ninf else "") + (f", +inf {int((x == math.inf).sum())}" if (x == math.inf).any() else "")

def sec_empty_rows_nan():
    """12. Rows with no visible key; NaN planted where no query can look."""
    rows, Rd, Rt = [], None, None
    sp = Spec(B=3, Sq=256, H=2, D=64, lens_q=[100, 256, 50], lens_kv=[0, 200, 256], kw=PAD, fill=7.0)
    tq, tk = [37, 20, 64], [50, 0, 64]
    spt = Spec(B=3, Sq=64, H=2, D=64, thd=True, lens_q=tq, lens_kv=tk, kw=PAD, fill=7.0)
    try:
        Rd = attn(sp)
        b = Rd.bufs
        rows.append(dict(case="dense padded, b0: q_len 100 kv_len 0", **Rd.res, b0_out=_desc(b["o"][0, :100]), b0_lse=_desc(b["lse"][0, :, :100]),
                         b0_dq=_desc(b["dq"][0, :100]), out_past_q_len=_desc(b["o"][0, 100:]), lse_past_q_len=_desc(b["lse"][0, :, 100:])))
        Rt = attn(spt)
        b, s1 = Rt.bufs, starts(tq, 0)[0][1]
        rows.append(dict(case="thd, seq 1: q_len 20 kv_len 0", **Rt.res, seq1_out=_desc(b["o"][s1:s1 + 20]), seq1_lse=_desc(b["lse"][1, :, :20]),
                         seq1_dq=_desc(b["dq"][s1:s1 + 20]), lse_past_q_len=_desc(b["lse"][0, :, 37:])))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(case="dense padded" if Rd is None else "thd", error=short(e)))
        G.rep.refuse(rows[-1]["case"], e)
    G.rep.table("rows whose keys are all masked (kv length 0); outputs prefilled with 7.0, so unwritten values show", rows)
    def plant(names, sp_):
        def prep(b):
            for n in names:
                b[n][~rows_mask(sp_, "q" if n in ("q", "do") else "kv", b[n])] = NAN
        return prep
    def nan_case(R, sp_, prep):
        b, res = rerun(R, sp_, prep)
        res["nan_outside"] = sum(int((~torch.isfinite(b[n][~rows_mask(sp_, side, b[n])].float())).sum())
                                 for n, side in (("o", "q"), ("dq", "q"), ("dk", "kv"), ("dv", "kv")))
        return res
    rows, sp2, spg = [], sp.copy(lens_kv=[130, 200, 256], fill=0.0), spt.copy(lens_kv=[50, 10, 64], gap=16, fill=0.0)
    if Rd is not None:
        rows.append(trial(dict(case="dense padded: NaN in K, V past seq_len_kv"), lambda: nan_case(Rd, sp2, plant(("k", "v"), sp2))))
    if Rt is not None:
        rows.append(trial(dict(case="thd: NaN in Q, K, V, dO in 16-token gaps between sequences and past the end"),
                          lambda: nan_case(Rt, spg, plant(("q", "k", "v", "do"), spg))))
    for label, extra in (("causal band", dict(kw=CAUSAL, mask=m_causal)), ("causal score_mod", dict(mod=causal_mod()))):
        def prep(b):
            for n in ("k", "v"):
                b[n][:, [110, 130] + list(range(192, 256))] = NAN  # 110: in the diagonal tile, 130+: in tiles no query reaches
        def run(spc=Spec(B=1, Sq=100, Skv=256, H=2, D=64, fill=0.0, **extra)):
            return nan_case(attn(spc), spc, prep)
        rows.append(trial(dict(case=f"{label}, Sq=100 Skv=256: NaN in K, V rows 110, 130, 192-255 (seen by no query)"), run))
    G.rep.table("NaN planted where no query can look: does it reach the outputs? (reference: those inputs zeroed; nan_outside = "
                "non-finite values written to rows outside the real tokens, prefilled 0)", rows)

def _doc_lens(nrows, ndocs, slots, S, seed):
    r, lens = random.Random(seed), []
    for _ in range(nrows):
        cuts = sorted(r.sample(range(1, S), ndocs - 1))
        lens += [b - a for a, b in zip([0] + cuts, cuts + [S])] + [0] * (slots - ndocs)
    return lens

def sec_workspace():
    """13. Workspace of THD doc-packed graphs (6 sequence slots per row, unused slots of length 0)."""
    rows = []
    for nrows in (1, 2, 3, 4):
        for mname, kw, mask in (("causal", CAUSAL, m_causal), ("full", {}, None), ("window 64", window(64), m_window(64))):
            l1, l6 = _doc_lens(nrows, 1, 6, 256, nrows), _doc_lens(nrows, 6, 6, 256, nrows)
            sp = Spec(B=nrows * 6, Sq=256, H=8, Hkv=4, D=64, thd=True, lens_q=l1, lens_kv=l1, kw=dict(**PAD, **kw), mask=mask)
            def run(sp=sp, l6=l6):
                R = attn(sp)
                res = {k: v for k, v in R.res.items() if k.startswith(("ws", "build", "bwd_error"))}
                res.update(plan_f=plan_name(R.gf), plan_b=plan_name(R.gb) if R.gb is not None else "-", ok_1doc=R.res["ok"],
                           err_1doc=f"out {R.res['out_rel']:.1e} dq {R.res.get('dq_rel', NAN):.1e}")
                e6 = rerun(R, sp.copy(lens_q=l6, lens_kv=l6), sanitize=False)[1]
                return {**res, "err_6docs": f"out {e6['out_rel']:.1e} dq {e6.get('dq_rel', NAN):.1e}", "ok": R.res["ok"] and e6["ok"]}
            rows.append(trial(dict(rows=nrows, graph_B=nrows * 6, mask=mname), run))
    G.rep.table("workspace bytes of THD doc-packed graphs: rows of S=256, 6 sequence slots per row (unused: length 0), H=8 Hkv=4 D=64 "
                "bf16, each graph run with 1 and with 6 documents per row", rows)

def sec_docs_speed():
    """14. Doc-packed batch as THD (two buckets) vs dense causal of the same size."""
    B, S, H, D, nd = SZ(2, 1), SZ(8192, 1024), SZ(16, 2), 64, 16
    lens = _doc_lens(B, nd, nd, S, 11)
    mx = max(lens)
    p2, fl = 1 << (mx - 1).bit_length(), sum(2 * L * L * H * D for L in lens)  # causal: half of 4 L^2 H D
    thd = lambda Sb: Spec(B=B * nd, Sq=Sb, H=H, D=D, thd=True, lens_q=lens, lens_kv=lens, kw=dict(**PAD, **CAUSAL), mask=m_causal)  # noqa: E731
    rows = [trial(dict(config=label), lambda: time_fb(sp, f)) for label, sp, f in (
        (f"thd {B * nd} seqs, S_bucket={S}", thd(S), fl), (f"thd {B * nd} seqs, S_bucket={p2} (longest doc {mx})", thd(p2), fl),
        (f"dense causal B={B} S={S} (no documents)", Spec(B=B, Sq=S, H=H, D=D, kw=CAUSAL, mask=m_causal), 2 * B * S * S * H * D))]
    G.rep.table(f"doc-packed speed: B={B} rows of S={S}, {nd} random-length causal documents per row, H={H} D={D} bf16; CUDA events, median "
                "of 20; out = float32 check of 3 sequences (thd) or batch 0 heads 0-1 (dense); TFLOP/s over the causal work", rows)

SECTIONS = {"execute_paths": (1, sec_execute_paths), "dynamic_shapes": (2, sec_dynamic_shapes), "serialize": (3, sec_serialize),
            "sinks": (4, sec_sinks), "dropout": (5, sec_dropout), "bias": (6, sec_bias), "nan_dq": (7, sec_nan_dq), "mask_dq": (8, sec_mask_dq),
            "int_ops": (9, sec_int_ops), "block_mask": (10, sec_block_mask), "bottom_right_thd": (11, sec_bottom_right_thd),
            "empty_rows_nan": (12, sec_empty_rows_nan), "workspace": (13, sec_workspace), "docs_speed": (14, sec_docs_speed)}
RUN_ORDER = ["sinks", "dropout", "bias", "nan_dq", "mask_dq", "int_ops", "bottom_right_thd", "empty_rows_nan", "workspace", "docs_speed",
             "serialize", "block_mask", "dynamic_shapes", "execute_paths"]  # private / shape-overriding entry points last

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe4_out")
    ap.add_argument("--only", default="", help="comma-separated sections: " + ",".join(SECTIONS))
    ap.add_argument("--dry-run", action="store_true", help="CPU self-check: build up to build_operation_graph, execute nothing")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    if set(only) - set(SECTIONS):
        sys.exit(f"unknown section(s) {sorted(set(only) - set(SECTIONS))}; known: {', '.join(SECTIONS)}")
    G.dry, G.rep = args.dry_run, Report(args.out)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if G.dry:
        G.dev, env = torch.device("cpu"), "DRY RUN on a CPU: graphs built up to build_operation_graph, nothing executed, numbers meaningless"
    else:
        G.dev, G.h = torch.device("cuda"), cudnn.create_handle()
        cudnn.set_stream(G.h, torch.cuda.current_stream().cuda_stream)
        env = (f"torch {torch.__version__}, cuDNN {cudnn.backend_version_string()}, frontend {getattr(cudnn, '__version__', '?')}, "
               f"{torch.cuda.get_device_name()}, Python {sys.version.split()[0]}")
    G.rep.emit(f"# cuDNN frontend probe 4\n\n{env}. Cells `x/y` = rel err / max abs err against a float64 reference (float32 for timed "
               "shapes); `nan=n` = non-finite mismatches; `ok` = every rel err < 2e-2 and no mismatch. Sections in run order.\n")
    t_all = time.perf_counter()
    for name in RUN_ORDER:
        if only and name not in only:
            continue
        num, fn = SECTIONS[name]
        G.rep.sec = name
        G.rep.emit(f"## {num}. {name}\n\n{fn.__doc__.split('. ', 1)[1]}\n")
        torch.manual_seed(zlib.crc32(name.encode()))
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            G.rep.emit(f"SECTION FAILED: {short(e, 2000)}\n\n```\n{traceback.format_exc()[-3000:]}```\n")
            G.rep.stats.setdefault(name, NS(n=0, bad=[], err=[])).err.append("(section)")
        G.rep.flush_refusals()
        G.rep.emit(f"_{name}: {time.perf_counter() - t0:.1f} s_\n")
        G.rep.save()
        try:
            sync()
            None if G.dry else torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            G.rep.emit(f"CUDA context lost after {name} ({short(e)}): stopping; rerun the rest with --only.\n")
            break
    lines = ["## Summary\n\n" + "".join(f"- {f}\n" for f in G.rep.facts) + f"\nTotal {time.perf_counter() - t_all:.0f} s. Per section: rows, ok, not ok (wrong or NaN), refused or failed "
             "(rows named by their leading columns).\n"]
    for name, st in G.rep.stats.items():
        lines.append(f"- **{SECTIONS[name][0]}. {name}**: {st.n} rows, {max(0, st.n - len(st.bad) - len(st.err))} ok; not ok: {', '.join(st.bad) or '-'}; "
                     f"refused/failed: {', '.join(st.err) or '-'}")
    G.rep.emit("\n".join(lines) + "\n")
    G.rep.save()

if __name__ == "__main__":
    main()
