import time, traceback, math
import torch, cudnn
exec(open("benchmarks/frontend_probe_common.py").read())
S = 256
i_ = torch.arange(S, device=dev)[:, None]; j_ = torch.arange(S, device=dev)[None, :]
def F(x): x.set_data_type(DT.FLOAT); return x
def Bo(x): x.set_data_type(DT.BOOLEAN); return x
def idx(gr, sc, a): return F(gr.gen_index(sc, axis=a, compute_data_type=DT.FLOAT))
variants = {
 "cmp_ge(add(r, s64), c)": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.cmp_ge(F(gr.add(idx(gr, sc, 2), e["s64"], compute_data_type=DT.FLOAT)), idx(gr, sc, 3), compute_data_type=DT.FLOAT))), j_ <= i_ + 64),
 "cmp_le(sub(c, r), s64)": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.cmp_le(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), e["s64"], compute_data_type=DT.FLOAT))), j_ - i_ <= 64),
 "cmp_ge(r, sub(c, s64))": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.cmp_ge(idx(gr, sc, 2), F(gr.sub(idx(gr, sc, 3), e["s64"], compute_data_type=DT.FLOAT)), compute_data_type=DT.FLOAT))), i_ >= j_ - 64),
 "cmp_ge(add(r, c64const-int), c)": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.cmp_ge(F(gr.add(idx(gr, sc, 2), e["s64i"], compute_data_type=DT.FLOAT)), idx(gr, sc, 3), compute_data_type=DT.FLOAT))), j_ <= i_ + 64),
 "window and: (d >= -16) & (d <= 0)": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.logical_and(Bo(gr.cmp_ge(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), e["m16"], compute_data_type=DT.FLOAT)), Bo(gr.cmp_le(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), e["z"], compute_data_type=DT.FLOAT)), compute_data_type=DT.BOOLEAN))), ((j_ - i_) >= -16) & ((j_ - i_) <= 0)),
 "nested select window": (lambda gr, sc, e: gr.binary_select(gr.binary_select(sc, e["neg"], Bo(gr.cmp_ge(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), e["m16"], compute_data_type=DT.FLOAT))), e["neg"], Bo(gr.cmp_le(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), e["z"], compute_data_type=DT.FLOAT))), ((j_ - i_) >= -16) & ((j_ - i_) <= 0)),
 "mul(r, two) >= c": (lambda gr, sc, e: gr.binary_select(sc, e["neg"], Bo(gr.cmp_ge(F(gr.mul(idx(gr, sc, 2), e["two"], compute_data_type=DT.FLOAT)), idx(gr, sc, 3), compute_data_type=DT.FLOAT))), 2 * i_ >= j_),
}
ext = {"neg": neg, "s64": torch.full((1,1,1,1), 64.0), "s64i": torch.full((1,1,1,1), 64, dtype=torch.int32), "m16": torch.full((1,1,1,1), -16.0), "z": torch.zeros(1,1,1,1), "two": torch.full((1,1,1,1), 2.0)}
for name, (f, m) in variants.items():
    section(name, lambda f=f, m=m, name=name: fwd_case(score_mod=lambda gr, sc, e, rest: f(gr, sc, e), extra=ext, mask=m, label=name))

# THD bottom-right per sequence: native band vs score_mod with (B,1,1,1) fp32 shift tensor
def thd_br(use_mod):
    H, D = 4, 64
    lq = torch.tensor([5, 1, 37, 128, 64], dtype=torch.int32); lk = torch.tensor([9, 3, 37, 200, 64], dtype=torch.int32)
    B = len(lq); Smax = 256
    cq = torch.zeros(B + 1, dtype=torch.int32); cq[1:] = torch.cumsum(lq, 0)
    ck = torch.zeros(B + 1, dtype=torch.int32); ck[1:] = torch.cumsum(lk, 0)
    q = torch.randn(int(cq[-1]), H, D, device=dev, dtype=torch.bfloat16); k = torch.randn(int(ck[-1]), H, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    g = mkg(); st = [Smax * H * D, D, H * D, 1]
    rq = g.tensor(dim=[B+1,1,1,1], stride=[1,1,1,1], data_type=DT.INT32); rk = g.tensor(dim=[B+1,1,1,1], stride=[1,1,1,1], data_type=DT.INT32)
    qt = g.tensor(dim=[B,H,Smax,D], stride=st, data_type=DT.BFLOAT16, ragged_offset=rq)
    kt = g.tensor(dim=[B,H,Smax,D], stride=st, data_type=DT.BFLOAT16, ragged_offset=rk)
    vt = g.tensor(dim=[B,H,Smax,D], stride=st, data_type=DT.BFLOAT16, ragged_offset=rk)
    sq = g.tensor(dim=[B,1,1,1], stride=[1,1,1,1], data_type=DT.INT32); sk = g.tensor(dim=[B,1,1,1], stride=[1,1,1,1], data_type=DT.INT32)
    shift = (lk - lq).float().to(dev).view(B,1,1,1)
    sht = g.tensor_like(shift); ngt = g.tensor_like(neg)
    kw = {}
    if use_mod == "shift":
        kw["score_mod"] = lambda gr, sc: gr.binary_select(sc, ngt, Bo(gr.cmp_le(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), sht, compute_data_type=DT.FLOAT)))
    elif use_mod == "lens":
        kw["score_mod"] = lambda gr, sc: gr.binary_select(sc, ngt, Bo(gr.cmp_le(F(gr.sub(idx(gr, sc, 3), idx(gr, sc, 2), compute_data_type=DT.FLOAT)), F(gr.sub(sk, sq, compute_data_type=DT.FLOAT)), compute_data_type=DT.FLOAT)))
    else:
        kw = dict(use_padding_mask=True, diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT)
    o, stt = g.sdpa(q=qt, k=kt, v=vt, attn_scale=0.125, generate_stats=True, seq_len_q=sq, seq_len_kv=sk, **kw)
    o.set_output(True); o.set_dim([B,H,Smax,D]); o.set_stride(st); o.set_data_type(DT.BFLOAT16); o.set_ragged_offset(rq)
    stt.set_output(True); stt.set_data_type(DT.FLOAT)
    build(g)
    out = torch.full_like(q, float("nan")); lse = torch.empty((B,H,Smax,1), device=dev)
    ws = torch.empty(g.get_workspace_size(), device=dev, dtype=torch.uint8)
    pack = {qt:q,kt:k,vt:v,o:out,stt:lse,rq:(cq*H*D).to(dev).view(B+1,1,1,1),rk:(ck*H*D).to(dev).view(B+1,1,1,1),sq:lq.to(dev).view(B,1,1,1),sk:lk.to(dev).view(B,1,1,1)}
    if use_mod == "shift": pack[sht] = shift
    if use_mod: pack[ngt] = neg
    g.execute(pack, ws, handle=handle); torch.cuda.synchronize()
    errs = []
    for b in range(B):
        a0, a1, k0, k1 = int(cq[b]), int(cq[b+1]), int(ck[b]), int(ck[b+1])
        Lq, Lk = a1 - a0, k1 - k0
        m = torch.arange(Lk, device=dev)[None, :] <= torch.arange(Lq, device=dev)[:, None] + (Lk - Lq)
        r, _ = ref_attn(q[a0:a1].transpose(0,1)[None], k[k0:k1].transpose(0,1)[None], v[k0:k1].transpose(0,1)[None], 0.125, mask=m)
        errs.append(rel(out[a0:a1].transpose(0,1)[None], r))
    print(f"thd bottom-right ({use_mod or 'native'}): rel errs", ["%.1e" % e for e in errs], "nan", out.isnan().any().item())
for mode in ("", "shift", "lens"):
    section(f"thd bottom-right {mode or 'native'}", lambda mode=mode: thd_br(mode))
print("PROBE3 DONE")
