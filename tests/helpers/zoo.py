"""A zoo of mods and masks in the style of attention-gym, written in the score_mod language, with
independent plain-torch oracles (tests/score_mods/test_score_mods_zoo.py checks the two agree; other
files run `zoo()` through flex, the cuDNN lowering and the GPU).

Each entry: (mod with its tensors bound, oracle(score, b, h, q_idx, kv_idx) -> score or None).
Sizes: S = 16 positions (a 4 x 4 canvas for the 2-D masks), H = 2 heads.
"""

import math

import torch

import score_mods as sm

S, H = 16, 2
CANVAS = 4  # 4 x 4 canvas over S positions
NEG = -math.inf


# --------------------------------------------------------------------------- the language

@sm.mask_mod
def natten(b, h, q_idx, kv_idx, kernel=3):
    """2-D neighbourhood on a CANVAS x CANVAS image, the kernel clamped inside the canvas."""
    qr, qc = q_idx // CANVAS, q_idx % CANVAS
    kr, kc = kv_idx // CANVAS, kv_idx % CANVAS
    half = kernel // 2
    cr = qr.clamp(half, CANVAS - 1 - half)
    cc = qc.clamp(half, CANVAS - 1 - half)
    return ((cr - kr).abs() <= half) & ((cc - kc).abs() <= half)


def _deinterleave(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


@sm.mask_mod
def morton_natten(b, h, q_idx, kv_idx):
    """The same neighbourhood with positions in Morton (Z) order: decode with bit tricks."""
    qx, qy = _deinterleave(q_idx), _deinterleave(q_idx >> 1)
    kx, ky = _deinterleave(kv_idx), _deinterleave(kv_idx >> 1)
    cx, cy = qx.clamp(1, CANVAS - 2), qy.clamp(1, CANVAS - 2)
    return ((cx - kx).abs() <= 1) & ((cy - ky).abs() <= 1)


@sm.mask_mod
def dilated_window(b, h, q_idx, kv_idx, window=4, dilation=2):
    diff = (q_idx - kv_idx).abs()
    return (diff <= window) & (diff % dilation == 0)


@sm.mask_mod
def block_diagonal(b, h, q_idx, kv_idx, block=4):
    return q_idx // block == kv_idx // block


@sm.mask_mod
def block_diffusion(b, h, q_idx, kv_idx):
    """BD3-LM training mask over [noised | clean] halves of S, blocks of 2."""
    half, block = S // 2, 2
    q_noised, kv_noised = q_idx < half, kv_idx < half
    qb, kb = (q_idx % half) // block, (kv_idx % half) // block
    diagonal = (qb == kb) & (q_noised == kv_noised)
    offset_causal = (qb > kb) & q_noised & ~kv_noised
    block_causal = (qb >= kb) & ~q_noised & ~kv_noised
    return diagonal | offset_causal | block_causal


@sm.mask_mod
def jetspec_training(b, h, q_idx, kv_idx, prefix=3, block=4):
    kv_local = kv_idx - prefix
    same = (kv_idx >= prefix) & (q_idx // block == kv_local // block) & (kv_local % block <= q_idx % block)
    return (kv_idx < prefix) | same


@sm.mask_mod
def temporal_head(b, h, q_idx, kv_idx, prompt=2, per_frame=5, width=2):
    token_q, token_k = (q_idx - prompt) % per_frame, (kv_idx - prompt) % per_frame
    return (kv_idx < prompt) | (q_idx < prompt) | ((token_q - token_k).abs() < width)


def _prefix(b, h, q_idx, kv_idx):
    return kv_idx < 5


prefix_lm = sm.or_masks(_prefix, sm.causal())


@sm.mask_mod
def global_window(b, h, q_idx, kv_idx, window=2, is_global=sm.TensorParam("bool")):
    return ((q_idx - kv_idx).abs() <= window) | is_global[q_idx] | is_global[kv_idx]


@sm.score_mod
def t5_bias(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
    """Bidirectional T5 relative-position buckets (16 buckets, max distance 32), a learned table."""
    buckets, max_distance = 16, 32
    half = buckets // 2
    exact = half // 2
    rel = kv_idx - q_idx
    base = sm.where(rel > 0, half, 0)
    n = rel.abs()
    large = exact + sm.floor(sm.log(n / exact) / math.log(max_distance / exact) * (half - exact))
    bucket = base + sm.where(n < exact, n, sm.minimum(large, half - 1))
    return score + table[h, bucket]


@sm.score_mod
def sandwich(score, b, h, q_idx, kv_idx, rel_bias=sm.TensorParam(), head_scale=sm.TensorParam()):
    return score + rel_bias[q_idx - kv_idx + (S - 1)] * head_scale[h]


@sm.score_mod
def graphormer(score, b, h, q_idx, kv_idx, spatial=sm.TensorParam(), dist=sm.TensorParam("int")):
    return score + spatial[h, dist[b, q_idx, kv_idx]]


@sm.score_mod
def gym_alibi(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) * 2.0 ** (-((h + 1) * 8.0 / H))


@sm.score_mod
def gelu_activation(score, b, h, q_idx, kv_idx, offset=1.0):
    """log(gelu(s) + offset): softmax replaced by GELU (exact, with erf)."""
    return sm.log(score * 0.5 * (1.0 + sm.erf(score / math.sqrt(2.0))) + offset)


@sm.score_mod
def power_mod(score, b, h, q_idx, kv_idx, p=1.5):
    return sm.pow(score.abs() + 1.0, p) - 0.25 * score ** 2 + 2.0 ** (score * 0.3)


@sm.score_mod
def quantized(score, b, h, q_idx, kv_idx):
    """Score-dependent % and floor (floor has derivative 0, % has derivative 1)."""
    return score - 0.3 * (score % 0.5) + 0.1 * sm.floor(score * 2) + 0.05 * sm.ceil(score)


@sm.score_mod
def bias_under_mask(score, b, h, q_idx, kv_idx, cap=20.0, table=sm.TensorParam()):
    """softcap, a learned relative-position table (clamped distance), causal."""
    s = cap * sm.tanh(score / cap) + table[h, (kv_idx - q_idx).clamp(-4, 4) + 4]
    return sm.where(kv_idx <= q_idx, s, NEG)


# --------------------------------------------------------------------------- oracles (plain torch)

def _natten_oracle(q, k, kernel=3):
    half = kernel // 2
    cr = (q // CANVAS).clamp(half, CANVAS - 1 - half)
    cc = (q % CANVAS).clamp(half, CANVAS - 1 - half)
    return ((cr - k // CANVAS).abs() <= half) & ((cc - k % CANVAS).abs() <= half)


def _z(i):  # Morton decode by loops
    x = y = 0
    for bit in range(8):
        x |= ((i >> (2 * bit)) & 1) << bit
        y |= ((i >> (2 * bit + 1)) & 1) << bit
    return x, y


def _morton_oracle(q, k):
    out = torch.zeros(q.shape[-2], k.shape[-1], dtype=torch.bool)
    for i in range(q.shape[-2]):
        for j in range(k.shape[-1]):
            (qx, qy), (kx, ky) = _z(i), _z(j)
            cx, cy = min(max(qx, 1), CANVAS - 2), min(max(qy, 1), CANVAS - 2)
            out[i, j] = abs(cx - kx) <= 1 and abs(cy - ky) <= 1
    return out


def t5_bucket(rel):
    buckets, max_distance = 16, 32
    half = buckets // 2
    exact = half // 2
    out = (rel > 0).long() * half
    n = rel.abs()
    large = exact + (torch.log(n.double() / exact) / math.log(max_distance / exact) * (half - exact)).floor().long()
    large = torch.where(n < exact, n, large.clamp(max=half - 1))
    return out + large


def mask_oracle(fn):
    def score_fn(s, b, h, q, k):
        return s.masked_fill(~fn(q, k), NEG)

    return score_fn


def zoo(device="cpu", dtype=torch.float64, batch=1):
    """name -> (mod bound to tensors on `device`, oracle score_fn or None)."""
    g = torch.Generator().manual_seed(0)
    t5_table = torch.randn(H, 16, generator=g, dtype=dtype).to(device)
    rel_bias = torch.randn(2 * S - 1, generator=g, dtype=dtype).to(device)
    head_scale = torch.rand(H, generator=g, dtype=dtype).to(device)
    spatial = torch.randn(H, 6, generator=g, dtype=dtype).to(device)
    dist = torch.randint(0, 6, (batch, S, S), generator=g).to(device)
    rel_table = torch.randn(H, 9, generator=g, dtype=dtype).to(device)
    is_global = torch.zeros(S, dtype=torch.bool)
    is_global[[0, 9]] = True
    is_global = is_global.to(device)
    return {
        "natten": (natten, mask_oracle(_natten_oracle)),
        "morton_natten": (morton_natten, mask_oracle(_morton_oracle)),
        "dilated_window": (dilated_window, mask_oracle(lambda q, k: ((q - k).abs() <= 4) & ((q - k).abs() % 2 == 0))),
        "block_diagonal": (block_diagonal, mask_oracle(lambda q, k: q // 4 == k // 4)),
        "block_diffusion": (block_diffusion, None),
        "jetspec_training": (jetspec_training, None),
        "temporal_head": (temporal_head, None),
        "prefix_lm": (prefix_lm, mask_oracle(lambda q, k: (k < 5) | (k <= q))),
        "global_window": (global_window(is_global=is_global),
                          mask_oracle(lambda q, k: ((q - k).abs() <= 2) | is_global.cpu()[q] | is_global.cpu()[k])),
        "t5_bias": (t5_bias(table=t5_table), lambda s, b, h, q, k: s + t5_table[h, t5_bucket(k - q)]),
        "sandwich": (sandwich(rel_bias=rel_bias, head_scale=head_scale),
                     lambda s, b, h, q, k: s + rel_bias[q - k + S - 1] * head_scale[h]),
        "graphormer": (graphormer(spatial=spatial, dist=dist), lambda s, b, h, q, k: s + spatial[h, dist[b, q, k]]),
        "gym_alibi": (gym_alibi, lambda s, b, h, q, k: s + (k - q) * torch.exp2(-((h + 1) * 8.0 / H))),
        "gelu_activation": (gelu_activation,
                            lambda s, b, h, q, k: torch.log(torch.nn.functional.gelu(s) + 1.0)),
        "power_mod": (power_mod, lambda s, b, h, q, k: (s.abs() + 1.0) ** 1.5 - 0.25 * s ** 2 + 2.0 ** (s * 0.3)),
        "quantized": (quantized, lambda s, b, h, q, k: s - 0.3 * torch.remainder(s, 0.5) + 0.1 * torch.floor(s * 2)
                      + 0.05 * torch.ceil(s)),
        "bias_under_mask": (bias_under_mask(table=rel_table),
                            lambda s, b, h, q, k: (20.0 * torch.tanh(s / 20.0) + rel_table[h, (k - q).clamp(-4, 4) + 4])
                            .masked_fill(k > q, NEG)),
    }


def grid(batch=1, heads=H, sq=S, skv=S, device="cpu"):
    return (torch.arange(batch, device=device).view(-1, 1, 1, 1), torch.arange(heads, device=device).view(1, -1, 1, 1),
            torch.arange(sq, device=device).view(1, 1, -1, 1), torch.arange(skv, device=device).view(1, 1, 1, -1))
