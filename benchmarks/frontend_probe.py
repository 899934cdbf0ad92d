"""Probe of cuDNN frontend behaviour (run on a GPU from the repository root); results in
benchmarks/results/frontend_probe_h100.md. Shared helpers: frontend_probe_common.py."""
exec(open("benchmarks/frontend_probe_common.py").read())

S = 256
tri = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
neg = torch.full((1, 1, 1, 1), float("-inf"))
MEMO = {}

def cb_info(gr, sc, ext, rest):
    print("callback: graph type", type(gr).__name__, "score type", type(sc).__name__, "extra args", len(rest), "score dim", sc.get_dim(), "dtype", sc.get_data_type())
    return sc
section("plain + callback signature", lambda: (fwd_case(label="plain"), fwd_case(score_mod=cb_info, label="identity mod")))

def causal_int(gr, sc, ext, rest):
    r = gr.gen_index(sc, axis=2); print("gen_index dtype default", r.get_data_type())
    c = gr.gen_index(sc, axis=3)
    m = gr.cmp_ge(r, c, compute_data_type=DT.BOOLEAN); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
def causal_int2(gr, sc, ext, rest):
    r = gr.gen_index(sc, axis=2); r.set_data_type(DT.INT32)
    c = gr.gen_index(sc, axis=3); c.set_data_type(DT.INT32)
    m = gr.cmp_ge(r, c, compute_data_type=DT.BOOLEAN); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
def causal_float(gr, sc, ext, rest):
    r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(r, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
S = 256
tri = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
neg = torch.full((1, 1, 1, 1), float("-inf"))
for nm, f in [("causal int default", causal_int), ("causal int32", causal_int2), ("causal float", causal_float)]:
    section(nm, lambda f=f, nm=nm: fwd_case(score_mod=f, extra={"neg": neg}, mask=tri, label=nm))
section("native causal", lambda: fwd_case(sdpa_kw=dict(diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT), mask=tri, label="native causal"))

def bottom_right_float(gr, sc, ext, rest):  # q_idx + (kv_len - q_len) >= kv_idx; with Sq=256 Skv=256 -> same as causal; use lengths pass-by-value
    r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    sh = gr.sub(ext["kvlen"], ext["qlen"], compute_data_type=DT.FLOAT); sh.set_data_type(DT.FLOAT)
    rr = gr.add(r, sh, compute_data_type=DT.FLOAT); rr.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(rr, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)
section("pbv float lengths (shift 128 -> rows 0..127 partly masked)", lambda: fwd_case(score_mod=bottom_right_float, extra={"neg": neg, "kvlen": torch.full((1,1,1,1), 128.0), "qlen": torch.full((1,1,1,1), 256.0)}, mask=torch.ones(S,S,dtype=torch.bool,device=dev).tril(-128), label="shifted causal fully-masked rows"))

cap = 1.0
def softcap_fwd(gr, sc, ext, rest):
    x = gr.mul(sc, ext["inv_cap"]); x.set_data_type(DT.FLOAT)
    t = gr.tanh(x); t.set_data_type(DT.FLOAT)
    o = gr.mul(t, ext["cap"]); o.set_data_type(DT.FLOAT)
    MEMO["x"] = x; MEMO["t"] = t
    return o
MEMO = {}
section("softcap fwd", lambda: fwd_case(score_mod=softcap_fwd, extra={"cap": torch.full((1,1,1,1), cap), "inv_cap": torch.full((1,1,1,1), 1/cap)}, mod=lambda s: cap * torch.tanh(s / cap), label="softcap"))
def bias_fwd(gr, sc, ext, rest):
    o = gr.add(sc, ext["bias"]); o.set_data_type(DT.FLOAT); return o
biasT = torch.randn(1, 4, S, S, device=dev)
section("bias fwd", lambda: fwd_case(score_mod=bias_fwd, extra={"bias": biasT}, mod=lambda s: s + biasT, label="bias"))
slopes = torch.rand(4, device=dev)
def alibi_view(gr, sc, ext, rest):  # slopes viewed as (1,H,1,1) + (1,1,S,1) index of doc via two views of the same buffer
    r = gr.gen_index(sc, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(sc, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    d = gr.sub(c, r, compute_data_type=DT.FLOAT); d.set_data_type(DT.FLOAT)
    m = gr.mul(d, ext["slopes"], compute_data_type=DT.FLOAT); m.set_data_type(DT.FLOAT)
    o = gr.add(sc, m, compute_data_type=DT.FLOAT); o.set_data_type(DT.FLOAT); return o
ii = torch.arange(S, device=dev).float()
section("alibi fwd", lambda: fwd_case(score_mod=alibi_view, extra={"slopes": slopes.view(1, 4, 1, 1)}, mod=lambda s: s + slopes.view(1,4,1,1) * (ii[None, :] - ii[:, None]), label="alibi"))
docs = torch.sort(torch.randint(0, 4, (S,), device=dev)).values.to(torch.int32)
def docmask(gr, sc, ext, rest):
    m = gr.cmp_eq(ext["dq"], ext["dk"], compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(sc, ext["neg"], m)  # select input0 where mask true?
section("doc mask two views int32", lambda: fwd_case(score_mod=docmask, extra={"dq": docs.view(1,1,S,1), "dk": docs.view(1,1,1,S), "neg": neg}, mask=(docs[:, None] == docs[None, :]), label="docmask"))

capx = {"cap": torch.full((1,1,1,1), cap), "inv_cap": torch.full((1,1,1,1), 1/cap)}
def softcap_bwd_tb(gr, ds, ext, rest):
    return gr.tanh_backward(ds, MEMO["x"])
def softcap_bwd_chain(gr, ds, ext, rest):  # autodiff form: ds*cap -> tanh_backward(.,x) -> *inv_cap
    a = gr.mul(ds, ext["cap"]); a.set_data_type(DT.FLOAT)
    b = gr.tanh_backward(a, MEMO["x"]); b.set_data_type(DT.FLOAT)
    c = gr.mul(b, ext["inv_cap"]); c.set_data_type(DT.FLOAT); return c
def softcap_bwd_tout(gr, ds, ext, rest):  # ds * (1 - t*t) via sub from pbv one
    tt = gr.mul(MEMO["t"], MEMO["t"]); tt.set_data_type(DT.FLOAT)
    om = gr.sub(ext["one"], tt); om.set_data_type(DT.FLOAT)
    r = gr.mul(ds, om); r.set_data_type(DT.FLOAT); return r
sm = lambda s: cap * torch.tanh(s / cap)
section("softcap bwd tanh_backward", lambda: bwd_case(fwd_cb=softcap_fwd, bwd_cb=softcap_bwd_tb, extra=capx, mod=sm, label="softcap tb"))
section("softcap bwd chain", lambda: bwd_case(fwd_cb=softcap_fwd, bwd_cb=softcap_bwd_chain, extra=capx, mod=sm, label="softcap chain"))
section("softcap bwd 1-t*t", lambda: bwd_case(fwd_cb=softcap_fwd, bwd_cb=softcap_bwd_tout, extra=dict(capx, one=torch.ones(1,1,1,1)), mod=sm, label="softcap 1-tt"))
section("causal float bwd (select)", lambda: bwd_case(fwd_cb=causal_float, bwd_cb=lambda gr, ds, ext, rest: ds, extra={"neg": neg}, mask=tri, label="causal-mod bwd identity"))
def causal_bwd_select(gr, ds, ext, rest):
    r = gr.gen_index(ds, axis=2, compute_data_type=DT.FLOAT); r.set_data_type(DT.FLOAT)
    c = gr.gen_index(ds, axis=3, compute_data_type=DT.FLOAT); c.set_data_type(DT.FLOAT)
    m = gr.cmp_ge(r, c, compute_data_type=DT.FLOAT); m.set_data_type(DT.BOOLEAN)
    return gr.binary_select(ds, ext["zero"], m)
section("causal float bwd (explicit select zero)", lambda: bwd_case(fwd_cb=causal_float, bwd_cb=causal_bwd_select, extra={"neg": neg, "zero": torch.zeros(1,1,1,1)}, mask=tri, label="causal-mod bwd select"))
section("bias bwd", lambda: bwd_case(fwd_cb=bias_fwd, bwd_cb=lambda gr, ds, ext, rest: ds, extra={"bias": biasT}, mod=lambda s: s + biasT, label="bias bwd"))
section("native causal bwd", lambda: bwd_case(sdpa_kw=dict(diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT), mask=tri, label="native causal bwd"))

# dynamic shapes + kernel cache build times
def dyn():
    kc = cudnn.create_kernel_cache()
    for S_ in (512, 1024, 1536, 2048):
        fwd_case(S=S_, dyn=True, kc=kc, label=f"dyn S={S_}")
    for S_ in (640, 768):
        fwd_case(S=S_, label=f"static S={S_}")
section("dynamic shapes", dyn)

# host overhead
def overhead():
    g, pack, ws, T = fwd_case(B=1, S=128, H=1, D=64, label="tiny")
    for _ in range(50): g.execute(pack, ws, handle=handle)
    torch.cuda.synchronize(); n = 2000
    t0 = time.perf_counter()
    for _ in range(n): g.execute(pack, ws, handle=handle)
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"execute(dict): {(t1-t0)/n*1e6:.1f} us/call host")
    uids = [T[n_].get_uid() for n_ in ("qt","kt","vt","o","stats")]
    bufs = [T[n_] for n_ in ("q","k","v","out","lse")]
    try:
        g.execute(bufs, ws, handle=handle, tensor_uids=uids)
        t0 = time.perf_counter()
        for _ in range(n): g.execute(bufs, ws, handle=handle, tensor_uids=uids)
        t1 = time.perf_counter(); torch.cuda.synchronize()
        print(f"execute(tensor_uids): {(t1-t0)/n*1e6:.1f} us/call host")
    except Exception as e: print("tensor_uids failed", e)
    udict = {u: b for u, b in zip(uids, bufs)}
    t0 = time.perf_counter()
    for _ in range(n): g.execute(udict, ws, handle=handle)
    t1 = time.perf_counter(); torch.cuda.synchronize()
    print(f"execute(uid dict): {(t1-t0)/n*1e6:.1f} us/call host")
    s = torch.cuda.current_stream().cuda_stream
    t0 = time.perf_counter()
    for _ in range(n): cudnn.set_stream(handle, s)
    t1 = time.perf_counter()
    print(f"set_stream(same): {(t1-t0)/n*1e6:.2f} us/call")
    t0 = time.perf_counter()
    for _ in range(n): torch.cuda.current_stream().cuda_stream
    t1 = time.perf_counter()
    print(f"torch current_stream: {(t1-t0)/n*1e6:.2f} us/call")
    # cuda graph capture
    cg = torch.cuda.CUDAGraph(); st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        cudnn.set_stream(handle, st.cuda_stream)
        for _ in range(3): g.execute(pack, ws, handle=handle)
        with torch.cuda.graph(cg, stream=st):
            g.execute(pack, ws, handle=handle)
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    T["q"].copy_(torch.randn_like(T["q"])); cg.replay(); torch.cuda.synchronize()
    ro, _ = ref_attn(T["q"].transpose(1,2), T["k"].transpose(1,2), T["v"].transpose(1,2), 1/8)
    print("cuda graph replay rel after input change", rel(T["out"].transpose(1,2), ro))
section("overhead", overhead)

# THD ragged with causal float mod
def thd():
    H, D = 4, 64
    lens = torch.tensor([0, 1, 37, 128, 200], dtype=torch.int32)
    B = len(lens); Smax = 256
    cu = torch.zeros(B + 1, dtype=torch.int32); cu[1:] = torch.cumsum(lens, 0)
    Tn = int(cu[-1])
    q = torch.randn(Tn, H, D, device=dev, dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
    g = mkg()
    st = [Smax * H * D, D, H * D, 1]
    ro_t = g.tensor(dim=[B + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32, name="ragged")
    mk = lambda n: g.tensor(dim=[B, H, Smax, D], stride=st, data_type=DT.BFLOAT16, name=n, ragged_offset=ro_t)
    qt, kt, vt = mk("q"), mk("k"), mk("v")
    sq = g.tensor(dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32, name="sq")
    sk = g.tensor(dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=DT.INT32, name="sk")
    ngt = g.tensor_like(neg, name="neg")
    o, stats = g.sdpa(q=qt, k=kt, v=vt, attn_scale=0.125, generate_stats=True, seq_len_q=sq, seq_len_kv=sk, score_mod=lambda gr, sc, *r: causal_float(gr, sc, {"neg": ngt}, r))
    o.set_output(True); o.set_dim([B, H, Smax, D]); o.set_stride(st); o.set_data_type(DT.BFLOAT16); o.set_ragged_offset(ro_t)
    stats.set_output(True); stats.set_data_type(DT.FLOAT)
    build(g)
    out = torch.full_like(q, float("nan")); lse = torch.full((B, H, Smax, 1), float("nan"), device=dev)
    rag = (cu * H * D).to(dev).view(B + 1, 1, 1, 1)
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    g.execute({qt: q, kt: k, vt: v, o: out, stats: lse, ro_t: rag, sq: lens.to(dev).view(B,1,1,1), sk: lens.to(dev).view(B,1,1,1), ngt: neg}, ws, handle=handle)
    torch.cuda.synchronize()
    errs = []
    for i in range(B):
        a, b_ = int(cu[i]), int(cu[i + 1])
        if b_ == a: continue
        L = b_ - a
        r, _ = ref_attn(q[a:b_].transpose(0, 1)[None], k[a:b_].transpose(0, 1)[None], v[a:b_].transpose(0, 1)[None], 0.125, mask=torch.ones(L, L, dtype=torch.bool, device=dev).tril())
        errs.append(rel(out[a:b_].transpose(0, 1)[None], r))
    print("thd causal-mod rel errs", ["%.1e" % e for e in errs], "nan in out", out.isnan().any().item(), "lse nan count (padding rows)", lse.isnan().sum().item())
section("thd", thd)
print("PROBE DONE")
