"""GPU: the one-kernel packed-batch preparation (`thd_kernel`) equals the torch-op form bit for bit.

Random batches (bucketed and not, one shared cu_seqlens row or two, GQA and Dv != D offset
multipliers), each with one value-check violation or none; the validity flag of both forms is
compared with the rule written out here, and every bound tensor with the torch-op form's.
"""

import random

import pytest
import torch

from fused_attn.backends.cudnn import thd_kernel
from fused_attn.backends.cudnn import varlen as VL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MUTATIONS = ("none", "start_up", "start_negative", "decrease", "end_short", "end_long", "over_limit",
             "kv_start", "kv_end", "kv_over_limit", "tokens_differ")


def _row(rng: random.Random, batch: int, max_len: int) -> list:
    out = [0]
    for _ in range(batch):
        out.append(out[-1] + rng.randrange(0, max_len + 1))
    return out


def _valid(row: list, tokens: int, limit: int) -> bool:
    lens = [b - a for a, b in zip(row, row[1:])]
    return row[0] == 0 and row[-1] == tokens and all(0 <= n <= limit for n in lens)


def _case(seed: int):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 3, 5, 8, 9, 17, 100])
    shared = rng.random() < 0.5
    hq, hkv, d, dv = rng.choice([(16, 16, 64, 64), (16, 4, 64, 64), (8, 2, 128, 64), (4, 4, 64, 128)])
    q_row = _row(rng, batch, rng.choice([1, 64, 700]))
    kv_row = q_row if shared else _row(rng, batch, rng.choice([1, 64, 700]))
    longest = lambda row: max(b - a for a, b in zip(row, row[1:]))  # noqa: E731
    limits = (longest(q_row) + rng.randrange(0, 3), longest(kv_row) + rng.randrange(0, 3))
    tokens = [q_row[-1], kv_row[-1]]
    mutation = MUTATIONS[seed % len(MUTATIONS)]
    kv = kv_row if not shared else q_row
    if mutation == "start_up":
        q_row[0] = 1
    elif mutation == "start_negative":
        q_row[0] = -1
    elif mutation == "decrease" and batch >= 2:
        q_row[1] = q_row[2] + 1
    elif mutation == "end_short":
        tokens[0] += 1
    elif mutation == "end_long":
        tokens[0] -= 1
    elif mutation == "over_limit":
        limits = (longest(q_row) - 1, limits[1])
    elif mutation == "kv_start":
        kv[0] = 2
    elif mutation == "kv_end":
        tokens[1] += 3
    elif mutation == "kv_over_limit":
        limits = (limits[0], longest(kv) - 1)
    elif mutation == "tokens_differ" and shared:
        tokens[1] += 1
    tokens = tuple(tokens)
    if shared:
        valid = _valid(q_row, tokens[0], min(limits)) and tokens[0] == tokens[1]
    else:
        valid = _valid(q_row, tokens[0], limits[0]) and _valid(kv_row, tokens[1], limits[1])
    cu_q = torch.tensor(q_row, dtype=torch.int32, device="cuda")
    cu_kv = cu_q if shared else torch.tensor(kv_row, dtype=torch.int32, device="cuda")
    layout = VL.ThdLayout(batch, VL.bucket_batch(batch), tuple(sorted({hq * d, hq * dv})),
                          tuple(sorted({hkv * d, hkv * dv})), torch.device("cuda"))
    return layout, cu_q, cu_kv, tokens, limits, valid, mutation


@pytest.mark.skipif(not thd_kernel.available(), reason="Triton is not installed: the torch-op preparation serves")
@pytest.mark.parametrize("seed", range(132))
def test_one_kernel_preparation_equals_torch_ops(seed):
    layout, cu_q, cu_kv, tokens, limits, valid, mutation = _case(seed)
    assert thd_kernel.prepare(layout, cu_q, cu_kv, tokens, limits) is not None, "the kernel must serve this batch"
    fast, ok_fast = VL.prepare_unchecked(layout, cu_q, cu_kv, None, None, tokens, limits)
    ops, ok_ops = VL.prepare_unchecked(layout, cu_q, cu_kv, None, None, tokens, limits, one_kernel=False)
    assert bool(ok_ops) == valid, f"{mutation}: torch-op check says {bool(ok_ops)}, the rule {valid}"
    assert bool(ok_fast) == valid, f"{mutation}: kernel check says {bool(ok_fast)}, the rule {valid}"
    assert (fast.seq_kv is fast.seq_q) == (cu_kv is cu_q)
    for name in ("seq_q", "seq_kv", "tok_q"):
        a, b = getattr(fast, name), getattr(ops, name)
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, name
        assert torch.equal(a, b), f"{mutation}: {name} {a.view(-1).tolist()} != {b.view(-1).tolist()}"
    assert fast.offsets.keys() == ops.offsets.keys()
    for key, want in ops.offsets.items():
        got = fast.offsets[key]
        assert got.dtype == torch.int32 and got.shape == want.shape and torch.equal(got, want), key


@pytest.mark.skipif(not thd_kernel.available(), reason="Triton is not installed: the torch-op preparation serves")
def test_direct_launch_is_verified_then_used_and_checks_in_kernel():
    """After one JIT launch the compiled kernel's own launcher is checked against it and used;
    check=True (the library's path) asserts in the kernel and still writes the flag."""
    layout, cu_q, cu_kv, tokens, limits, valid, _ = _case(0)  # mutation "none"
    assert valid
    for check in (False, True):
        first = thd_kernel.prepare(layout, cu_q, cu_kv, tokens, limits, check=check)
        recipe = layout._kernel_recipes[cu_kv is not cu_q]
        assert recipe.direct.get(check) is not None, "the direct launcher was not verified on this Triton"
        again = thd_kernel.prepare(layout, cu_q, cu_kv, tokens, limits, check=check)  # the direct launch
        ops, ok_ops = VL.prepare_unchecked(layout, cu_q, cu_kv, None, None, tokens, limits, one_kernel=False)
        for got in (first, again):
            assert torch.equal(got[0], ops.seq_q) and torch.equal(got[1], ops.seq_kv) and bool(got[4])
            assert all(torch.equal(got[3][key], want) for key, want in ops.offsets.items())


def test_invalid_cu_seqlens_stop_a_cuda_call_in_a_fresh_process():
    """The kernel's flag feeds the device assertion: an invalid row fails at the next sync
    (in a child process: a device assertion ends the CUDA context)."""
    import subprocess
    import sys

    code = (
        "import torch, fused_attn\n"
        "q = torch.randn(10, 2, 64, device='cuda', dtype=torch.bfloat16)\n"
        "cu = torch.tensor([0, 4, 9], dtype=torch.int32, device='cuda')\n"  # ends at 9, not 10
        "fused_attn.varlen_attn(q, q, q, cu, cu, 5, 5)\n"
        "torch.cuda.synchronize()\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert got.returncode != 0
    assert "invalid cu_seqlens" in got.stderr or "device-side assert" in got.stderr, got.stderr[-2000:]
