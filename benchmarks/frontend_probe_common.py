import time, traceback, math, sys
import torch, cudnn
print("torch", torch.__version__, "cudnn backend", cudnn.backend_version_string(), "fe", getattr(cudnn, "__version__", "?"), torch.cuda.get_device_name())
dev = torch.device("cuda")
DT = cudnn.data_type
handle = cudnn.create_handle()
cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
torch.manual_seed(0)

def ref_attn(q, k, v, scale, mod=None, mask=None):  # q (B,H,S,D)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mod is not None: s = mod(s)
    if mask is not None: s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v.float(), torch.logsumexp(s, -1)

def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()

def mkg(**kw):
    return cudnn.pygraph(io_data_type=DT.BFLOAT16, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT, handle=handle, **kw)

def build(g):
    t0 = time.perf_counter()
    g.validate(); g.build_operation_graph(); g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]); g.check_support(); g.build_plans()
    return time.perf_counter() - t0

def bshd(B, S, H, D): return torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)

def section(name, fn):
    print(f"=== {name}", flush=True)
    try:
        fn()
    except Exception as e:
        print("FAILED:", type(e).__name__, str(e)[:1500])
        traceback.print_exc(limit=3)

def fwd_case(B=2, S=256, H=4, D=64, score_mod=None, extra=None, sdpa_kw=None, mod=None, mask=None, label="", dyn=False, kc=None):
    q, k, v = bshd(B, S, H, D), bshd(B, S, H, D), bshd(B, S, H, D)
    g = mkg(is_dynamic_shape_enabled=dyn, kernel_cache=kc)
    st = [S * H * D, D, H * D, 1]
    qt = g.tensor(dim=[B, H, S, D], stride=st, data_type=DT.BFLOAT16, name="q")
    kt = g.tensor(dim=[B, H, S, D], stride=st, data_type=DT.BFLOAT16, name="k")
    vt = g.tensor(dim=[B, H, S, D], stride=st, data_type=DT.BFLOAT16, name="v")
    ext = {}
    if extra:
        for n, t in extra.items(): ext[n] = (g.tensor_like(t, name=n), t)
    scale = 1 / math.sqrt(D)
    kw = dict(sdpa_kw or {})
    if score_mod is not None: kw["score_mod"] = (lambda gr, sc, *rest: score_mod(gr, sc, {n: e[0] for n, e in ext.items()}, rest))
    o, stats = g.sdpa(q=qt, k=kt, v=vt, attn_scale=scale, generate_stats=True, name="sdpa", **kw)
    o.set_output(True); o.set_dim([B, H, S, D]); o.set_stride(st); o.set_data_type(DT.BFLOAT16)
    stats.set_output(True); stats.set_data_type(DT.FLOAT)
    bt = build(g)
    out = torch.empty_like(q); lse = torch.empty(B, H, S, 1, device=dev, dtype=torch.float32)
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    pack = {qt: q, kt: k, vt: v, o: out, stats: lse}
    for n, e in ext.items(): pack[e[0]] = e[1]
    g.execute(pack, ws, handle=handle); torch.cuda.synchronize()
    ro, rl = ref_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, mod, mask)
    print(f"{label}: build {bt*1e3:.1f} ms, out rel {rel(out.transpose(1,2), ro):.2e}, lse maxdiff {(lse.squeeze(-1)-rl).abs().nan_to_num(0).max().item():.2e} nan_out={out.isnan().any().item()} nan_lse={lse.isnan().any().item()} lse_inf={lse.isinf().sum().item()}")
    return g, pack, ws, dict(q=q, k=k, v=v, out=out, lse=lse, qt=qt, kt=kt, vt=vt, o=o, stats=stats)


# backward softcap
def bwd_case(B=2, S=256, H=4, D=64, fwd_cb=None, bwd_cb=None, extra=None, mod=None, label="", sdpa_kw=None, mask=None):
    MEMO.clear()
    g0, pack, ws, T = fwd_case(B, S, H, D, score_mod=fwd_cb, extra=extra, mod=mod, label=label + " (fwd)", sdpa_kw=sdpa_kw, mask=mask)
    q, k, v, out, lse = T["q"], T["k"], T["v"], T["out"], T["lse"]
    do = torch.randn_like(out)
    g = mkg()
    st = [S * H * D, D, H * D, 1]
    mk = lambda n: g.tensor(dim=[B, H, S, D], stride=st, data_type=DT.BFLOAT16, name=n)
    qt, kt, vt, ot, dot = mk("q"), mk("k"), mk("v"), mk("o"), mk("dO")
    stt = g.tensor(dim=[B, H, S, 1], stride=[H * S, S, 1, 1], data_type=DT.FLOAT, name="stats")
    ext = {n: (g.tensor_like(t, name=n), t) for n, t in (extra or {}).items()}
    kw = dict(sdpa_kw or {})
    if fwd_cb is not None:
        kw["score_mod"] = lambda gr, sc, *rest: fwd_cb(gr, sc, {n: e[0] for n, e in ext.items()}, rest)
        kw["score_mod_bprop"] = lambda gr, ds, *rest: bwd_cb(gr, ds, {n: e[0] for n, e in ext.items()}, rest)
    dq, dk, dv = g.sdpa_backward(q=qt, k=kt, v=vt, o=ot, dO=dot, stats=stt, attn_scale=1 / math.sqrt(D), name="bwd", **kw)
    for t in (dq, dk, dv): t.set_output(True); t.set_dim([B, H, S, D]); t.set_stride(st); t.set_data_type(DT.BFLOAT16)
    bt = build(g)
    gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    pack = {qt: q, kt: k, vt: v, ot: out, dot: do, stt: lse, dq: gq, dk: gk, dv: gv}
    for n, e in ext.items(): pack[e[0]] = e[1]
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    g.execute(pack, ws, handle=handle); torch.cuda.synchronize()
    qr, kr, vr = [x.transpose(1, 2).float().requires_grad_() for x in (q, k, v)]
    ro, _ = ref_attn(qr, kr, vr, 1 / math.sqrt(D), mod, mask)
    ro.backward(do.transpose(1, 2).float())
    print(f"{label}: bwd build {bt*1e3:.1f} ms dq {rel(gq.transpose(1,2), qr.grad):.2e} dk {rel(gk.transpose(1,2), kr.grad):.2e} dv {rel(gv.transpose(1,2), vr.grad):.2e} nan={gq.isnan().any().item() or gk.isnan().any().item()}")


S = 256
tri = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
neg = torch.full((1, 1, 1, 1), float('-inf'))
MEMO = {}
