import time, traceback, math
import torch, cudnn
exec(open("benchmarks/frontend_probe_common.py").read())

# 1. left bound semantics: native band left=L (cudnn), right=0, compare to masks with window W
def band_mask(S, left, right):
    i = torch.arange(S, device=dev)[:, None]; j = torch.arange(S, device=dev)[None, :]
    m = torch.ones(S, S, dtype=torch.bool, device=dev)
    if left is not None: m &= (j >= i - left)
    if right is not None: m &= (j <= i + right)
    return m
def lb():
    S = 256
    for lbv in (1, 2, 16):
        g, pack, ws, T = fwd_case(S=S, sdpa_kw=dict(diagonal_band_left_bound=lbv, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT), label=f"cudnn left_bound={lbv} vs flash left={lbv}", mask=band_mask(S, lbv, 0))
        ro, _ = ref_attn(T["q"].transpose(1,2), T["k"].transpose(1,2), T["v"].transpose(1,2), 1/8, mask=band_mask(S, lbv - 1, 0))
        print(f"   vs flash left={lbv-1}: rel {rel(T['out'].transpose(1,2), ro):.2e}")
    fwd_case(S=S, sdpa_kw=dict(diagonal_band_left_bound=16, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT), label="left only 16 (no right)", mask=band_mask(S, 15, None))
    fwd_case(S=S, sdpa_kw=dict(diagonal_band_right_bound=3, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT), label="right only 3", mask=band_mask(S, None, 3))
section("left bound", lb)

# 2. fully masked rows: native bottom-right causal with Sq > Skv
def fm():
    B, H, D, Sq, Skv = 2, 4, 64, 256, 128
    q = torch.randn(B, Sq, H, D, device=dev, dtype=torch.bfloat16); k = torch.randn(B, Skv, H, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    g = mkg()
    qt = g.tensor(dim=[B,H,Sq,D], stride=[Sq*H*D, D, H*D, 1], data_type=DT.BFLOAT16)
    kt = g.tensor(dim=[B,H,Skv,D], stride=[Skv*H*D, D, H*D, 1], data_type=DT.BFLOAT16)
    vt = g.tensor(dim=[B,H,Skv,D], stride=[Skv*H*D, D, H*D, 1], data_type=DT.BFLOAT16)
    o, st = g.sdpa(q=qt, k=kt, v=vt, attn_scale=0.125, generate_stats=True, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    o.set_output(True); o.set_dim([B,H,Sq,D]); o.set_stride([Sq*H*D, D, H*D, 1]); o.set_data_type(DT.BFLOAT16); st.set_output(True); st.set_data_type(DT.FLOAT)
    build(g)
    out = torch.full_like(q, 7.0); lse = torch.full((B,H,Sq,1), 7.0, device=dev)
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    g.execute({qt:q,kt:k,vt:v,o:out,st:lse}, ws, handle=handle); torch.cuda.synchronize()
    print("bottom-right Sq>Skv: rows 0..127 out values", out[:, :128].float().abs().max().item(), "nan", out.isnan().any().item(), "lse rows0..127 sample", lse[0,0,:3,0].tolist(), "lse row 128", lse[0,0,128,0].item())
    i = torch.arange(Sq, device=dev)[:, None]; j = torch.arange(Skv, device=dev)[None, :]
    m = j <= i + (Skv - Sq)
    ro, _ = ref_attn(q.transpose(1,2), k.transpose(1,2), v.transpose(1,2), 0.125, mask=m)
    print("   rows 128.. rel", rel(out[:,128:].transpose(1,2), ro[:,:,128:]))
section("fully masked rows native", fm)
def fm_mod():  # score_mod masking everything in rows < 64
    S = 256
    def mod(gr, sc, ext, rest):
        r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
        m = gr.cmp_ge(r, ext["c64"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
        return gr.binary_select(sc, ext["neg"], m)
    m = (torch.arange(S, device=dev)[:, None] >= 64).expand(S, S)
    g, pack, ws, T = fwd_case(S=S, score_mod=mod, extra={"neg": neg, "c64": torch.full((1,1,1,1), 64.0)}, label="score_mod fully masked rows<64 (rows>=64 compared)", mask=None)
    print("  rows<64 out max", T["out"][:, :64].float().abs().max().item(), "nan", T["out"].isnan().any().item(), "lse rows<64", T["lse"][0,0,:2,0].tolist())
section("fully masked rows score_mod", fm_mod)

# 3. leaf-only workarounds
S = 256
def br_reassoc(gr, sc, ext, rest):  # (q_idx + kv_len) - q_len >= kv_idx
    r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    a = gr.add(r, ext["kvlen"], compute_data_type=DT.FLOAT); a.set_data_type(DT.FLOAT)
    rr = gr.sub(a, ext["qlen"], compute_data_type=DT.FLOAT); rr.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(rr, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
msk = torch.ones(S, S, dtype=torch.bool, device=dev).tril(64)
section("bottom-right reassoc pbv float lengths", lambda: fwd_case(score_mod=br_reassoc, extra={"neg": neg, "kvlen": torch.full((1,1,1,1), 320.0), "qlen": torch.full((1,1,1,1), 256.0)}, mask=msk, label="reassoc"))
docs_f = torch.sort(torch.randint(0, 4, (S,), device=dev)).values
dm = docs_f[:, None] == docs_f[None, :]
def doc_zero(gr, sc, ext, rest):
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    z = gr.sub(c, c, compute_data_type=DT.FLOAT); z.set_data_type(DT.FLOAT)
    a = gr.add(z, ext["dq"], compute_data_type=DT.FLOAT); a.set_data_type(DT.FLOAT)
    m = gr.cmp_eq(a, ext["dk"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
section("doc mask zero trick fp32", lambda: fwd_case(score_mod=doc_zero, extra={"dq": docs_f.float().view(1,1,S,1), "dk": docs_f.float().view(1,1,1,S), "neg": neg}, mask=dm, label="doc zero fp32"))
section("doc mask zero trick int32", lambda: fwd_case(score_mod=doc_zero, extra={"dq": docs_f.int().view(1,1,S,1), "dk": docs_f.int().view(1,1,1,S), "neg": neg}, mask=dm, label="doc zero int32"))
def doc_scoreadd(gr, sc, ext, rest):
    a = gr.sub(sc, sc, compute_data_type=DT.FLOAT); a.set_data_type(DT.FLOAT)
    b = gr.add(a, ext["dq"], compute_data_type=DT.FLOAT); b.set_data_type(DT.FLOAT)
    m = gr.cmp_eq(b, ext["dk"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
section("doc mask score-zero fp32", lambda: fwd_case(score_mod=doc_scoreadd, extra={"dq": docs_f.float().view(1,1,S,1), "dk": docs_f.float().view(1,1,1,S), "neg": neg}, mask=dm, label="doc score-zero"))
def doc_direct_f(gr, sc, ext, rest):
    m = gr.cmp_eq(ext["dq"], ext["dk"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
section("doc mask direct fp32", lambda: fwd_case(score_mod=doc_direct_f, extra={"dq": docs_f.float().view(1,1,S,1), "dk": docs_f.float().view(1,1,1,S), "neg": neg}, mask=dm, label="doc direct fp32"))

# 4. bprop patterns
MEMO = {}
def expmod_f(gr, sc, ext, rest):  # s + 0.1*exp(s*0.1)
    x = gr.mul(sc, ext["a"]); x.set_data_type(DT.FLOAT)
    e = gr.exp(x); e.set_data_type(DT.FLOAT); MEMO["e"] = e
    y = gr.mul(e, ext["a"]); y.set_data_type(DT.FLOAT)
    o = gr.add(sc, y); o.set_data_type(DT.FLOAT); return o
def expmod_b(gr, ds, ext, rest):  # ds * (1 + a*a*e) = ds + ds*a*a*e
    t = gr.mul(ds, ext["a"]); t.set_data_type(DT.FLOAT)
    t2 = gr.mul(t, MEMO["e"]); t2.set_data_type(DT.FLOAT)
    t3 = gr.mul(t2, ext["a"]); t3.set_data_type(DT.FLOAT)
    o = gr.add(ds, t3); o.set_data_type(DT.FLOAT); return o
section("exp mod bwd", lambda: bwd_case(fwd_cb=expmod_f, bwd_cb=expmod_b, extra={"a": torch.full((1,1,1,1), 0.1)}, mod=lambda s: s + 0.1 * torch.exp(0.1 * s), label="exp"))
def sig_f(gr, sc, ext, rest):
    x = gr.mul(sc, ext["a"]); x.set_data_type(DT.FLOAT); MEMO["x"] = x
    y = gr.sigmoid(x); y.set_data_type(DT.FLOAT)
    o = gr.mul(y, ext["c"]); o.set_data_type(DT.FLOAT); return o
def sig_b(gr, ds, ext, rest):
    a = gr.mul(ds, ext["c"]); a.set_data_type(DT.FLOAT)
    b = gr.sigmoid_backward(a, MEMO["x"]); b.set_data_type(DT.FLOAT)
    o = gr.mul(b, ext["a"]); o.set_data_type(DT.FLOAT); return o
section("sigmoid bwd", lambda: bwd_case(fwd_cb=sig_f, bwd_cb=sig_b, extra={"a": torch.full((1,1,1,1), 0.5), "c": torch.full((1,1,1,1), 4.0)}, mod=lambda s: 4.0 * torch.sigmoid(0.5 * s), label="sigmoid"))
def abs_f(gr, sc, ext, rest):
    o = gr.abs(sc); o.set_data_type(DT.FLOAT); return o
def abs_b(gr, ds, ext, rest):
    m = gr.cmp_ge(MEMO_S["s"], ext["zero"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    n = gr.neg(ds); n.set_data_type(DT.FLOAT)
    return gr.binary_select(ds, n, m)
MEMO_S = {}
def abs_f2(gr, sc, ext, rest):
    MEMO_S["s"] = sc; return abs_f(gr, sc, ext, rest)
section("abs bwd (select neg)", lambda: bwd_case(fwd_cb=abs_f2, bwd_cb=abs_b, extra={"zero": torch.zeros(1,1,1,1)}, mod=lambda s: s.abs(), label="abs"))
def sc_first_f(gr, sc, ext, rest):  # cap*tanh(s/cap) with division by pbv
    x = gr.div(sc, ext["cap"]); x.set_data_type(DT.FLOAT); MEMO["x"] = x
    t = gr.tanh(x); t.set_data_type(DT.FLOAT)
    o = gr.mul(t, ext["cap"]); o.set_data_type(DT.FLOAT); return o
def sc_first_b(gr, ds, ext, rest):
    a = gr.mul(ds, ext["cap"]); a.set_data_type(DT.FLOAT)
    b = gr.tanh_backward(a, MEMO["x"]); b.set_data_type(DT.FLOAT)
    o = gr.div(b, ext["cap"]); o.set_data_type(DT.FLOAT); return o
section("softcap div form bwd", lambda: bwd_case(fwd_cb=sc_first_f, bwd_cb=sc_first_b, extra={"cap": torch.full((1,1,1,1), 2.0)}, mod=lambda s: 2.0 * torch.tanh(s / 2.0), label="softcap div"))
def scal_first_b(gr, ds, ext, rest):  # pbv first in mul
    a = gr.mul(ext["cap"], ds); a.set_data_type(DT.FLOAT)
    b = gr.tanh_backward(a, MEMO["x"]); b.set_data_type(DT.FLOAT)
    o = gr.div(b, ext["cap"]); o.set_data_type(DT.FLOAT); return o
section("softcap pbv-first mul bwd", lambda: bwd_case(fwd_cb=sc_first_f, bwd_cb=scal_first_b, extra={"cap": torch.full((1,1,1,1), 2.0)}, mod=lambda s: 2.0 * torch.tanh(s / 2.0), label="pbv first"))
def causal_bwd_gen(gr, ds, ext, rest):  # mask recomputed in bprop with gen_index of ds
    r = gr.gen_index(ds, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(ds, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(r, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(ds, ext["zero"], m)
def causal_memo_f(gr, sc, ext, rest):
    r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(r, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN); MEMO["m"] = m
    return gr.binary_select(sc, ext["neg"], m)
section("causal bwd reuse fwd mask from memo", lambda: bwd_case(fwd_cb=causal_memo_f, bwd_cb=lambda gr, ds, ext, rest: gr.binary_select(ds, ext["zero"], MEMO["m"]), extra={"neg": neg, "zero": torch.zeros(1,1,1,1)}, mask=tri, label="memo mask"))

# 5. padding mask: rows past length
def pad():
    B, H, D, S = 2, 4, 64, 256
    q = bshd(B, S, H, D); k = bshd(B, S, H, D); v = bshd(B, S, H, D)
    g = mkg(); st = [S*H*D, D, H*D, 1]
    qt, kt, vt = [g.tensor(dim=[B,H,S,D], stride=st, data_type=DT.BFLOAT16) for _ in range(3)]
    sq = g.tensor(dim=[B,1,1,1], stride=[1,1,1,1], data_type=DT.INT32); sk = g.tensor(dim=[B,1,1,1], stride=[1,1,1,1], data_type=DT.INT32)
    o, stt = g.sdpa(q=qt, k=kt, v=vt, attn_scale=0.125, generate_stats=True, use_padding_mask=True, seq_len_q=sq, seq_len_kv=sk)
    o.set_output(True); o.set_dim([B,H,S,D]); o.set_stride(st); o.set_data_type(DT.BFLOAT16); stt.set_output(True); stt.set_data_type(DT.FLOAT)
    build(g)
    out = torch.full_like(q, 7.0); lse = torch.full((B,H,S,1), 7.0, device=dev)
    lq = torch.tensor([100, 256], dtype=torch.int32, device=dev).view(B,1,1,1); lk = torch.tensor([50, 200], dtype=torch.int32, device=dev).view(B,1,1,1)
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    g.execute({qt:q,kt:k,vt:v,o:out,stt:lse,sq:lq,sk:lk}, ws, handle=handle); torch.cuda.synchronize()
    print("padding: out rows past len (b0 rows 100..) values:", out[0, 100:].float().abs().max().item(), "lse there", lse[0,0,100:102,0].tolist())
    ro, _ = ref_attn(q[0:1,:100].transpose(1,2), k[0:1,:50].transpose(1,2), v[0:1,:50].transpose(1,2), 0.125)
    print("   b0 real rows rel", rel(out[0:1,:100].transpose(1,2), ro))
section("padding rows", pad)

# 6. dynamic shapes variants
def dyn2():
    kc = None
    for S_ in (512, 1024):
        fwd_case(S=S_, dyn=True, kc=None, label=f"dyn no-kc S={S_}")
    kc = cudnn.create_kernel_cache()
    g, pack, ws, T = fwd_case(S=512, dyn=True, kc=kc, label="dyn kc S=512 (first)")
    fwd_case(S=512, dyn=True, kc=kc, label="dyn kc S=512 again (same shape)")
    fwd_case(B=4, S=512, dyn=True, kc=kc, label="dyn kc B=4 S=512")
    fwd_case(S=1024, dyn=True, kc=kc, label="dyn kc S=1024")
section("dynamic variants", dyn2)

# 7. faster execute paths
def fast():
    g, pack, ws, T = fwd_case(B=1, S=128, H=1, D=64, label="tiny")
    uids = [T[n].get_uid() for n in ("qt","kt","vt","o","stats")]
    bufs = [T[n] for n in ("q","k","v","out","lse")]
    n = 3000
    def tm(name, f):
        for _ in range(50): f()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(n): f()
        t1 = time.perf_counter(); torch.cuda.synchronize(); print(f"{name}: {(t1-t0)/n*1e6:.2f} us")
    tm("execute tensor_uids", lambda: g.execute(bufs, ws, handle=handle, tensor_uids=uids))
    lg = g._lowered_graph
    print("lowered graph methods", [m for m in dir(lg) if not m.startswith('__')][:80])
    tm("torch raw stream", lambda: torch._C._cuda_getCurrentRawStream(0))
    tm("torch.empty_like out", lambda: torch.empty_like(T["out"]))
    tm("torch.empty lse", lambda: torch.empty((1,1,128,1), device=dev, dtype=torch.float32))
    try:
        from cudnn._pygraph import pygraph
        vp = g._normalize({u: b for u, b in zip(uids, bufs)}, ws)
        tm("_normalize", lambda: g._normalize({u: b for u, b in zip(uids, bufs)}, ws))
    except Exception as e: print("normalize", e)
    try:
        ptrs = [b.data_ptr() for b in bufs]
        import inspect
        print("_execute sig", getattr(lg._execute, "__nb_signature__", None) or lg._execute.__doc__)
        print("_execute_with_raw_ptrs sig", getattr(lg._execute_with_raw_ptrs, "__nb_signature__", None) or lg._execute_with_raw_ptrs.__doc__)
        bh = handle.backend_handle
        vpd = {u: b.data_ptr() for u, b in zip(uids, bufs)}
        tm("lowered._execute(dict uid->ptr)", lambda: lg._execute({u: b.data_ptr() for u, b in zip(uids, bufs)}, ws.data_ptr(), bh, None, None, None))
        g.execute(bufs, ws, handle=handle, tensor_uids=uids)
    except Exception as e: print("lowered exec failed", type(e).__name__, str(e)[:500])
section("fast execute", fast)
print("PROBE2 DONE")
