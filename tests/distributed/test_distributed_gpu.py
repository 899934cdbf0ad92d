"""GPU: fused_attn.distributed on 2+ CUDA devices (NCCL, bf16, cuDNN) against one GPU.

Each case computes, on every rank, the exact float64 result (reference backend), the single-GPU
bf16 result (the same call on the full inputs) and the distributed bf16 result, and holds the
distributed one to the project's rule applied to the single-GPU computation:

    max|distributed - exact| <= 2 x max|single GPU - exact| + floor (bf16 floor x max(1, |exact|))

for the output and for dq, dk, dv.

Run either way (both need >= 2 GPUs; plain pytest uses every visible GPU):
    python -m pytest -q -m gpu tests/distributed/test_distributed_gpu.py            # one NCCL process per GPU
    torchrun --nproc-per-node 4 -m pytest -q -m gpu tests/distributed/test_distributed_gpu.py
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import time
import traceback
import zlib
from typing import Any, Callable, Dict, List

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs at least 2 CUDA devices"),
]

_BF16 = torch.bfloat16


def _bound(single: torch.Tensor, exact: torch.Tensor) -> float:
    """The project's rule (`fused_attn.testing.bound_from`) from the single-GPU bf16 result."""
    from fused_attn.testing import bound_from

    return bound_from(single, exact, _BF16)


def _check(name: str, got: torch.Tensor, single: torch.Tensor, exact: torch.Tensor) -> None:
    from fused_attn.testing import assert_close

    assert_close(got, exact, _bound(single, exact), f"{name} (single-GPU error "
                 f"{float((single.double() - exact.double()).abs().max()):.3e})")


def _grads(fn: Callable, inputs: List[torch.Tensor], dout: torch.Tensor, dtype: torch.dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    (out.to(dout.dtype) * dout).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _seed(*parts: Any) -> int:
    """A seed every rank derives alike: tensors enter by value (a CUDA tensor's repr names its
    device, cuda:0 on one rank and cuda:1 on the other: seeds hashed from it made every rank draw
    different inputs, and the packed context-parallel comparison failed for that reason alone)."""
    def plain(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", x.tolist())
        if isinstance(x, dict):
            return sorted((k, plain(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x
    return zlib.crc32(repr(plain(parts)).encode())


def _assert_same_on_every_rank(tensors: List[torch.Tensor]) -> None:
    """The ranks must compare one problem: their inputs' checksums must agree."""
    sums = torch.stack([t.double().sum() for t in tensors] + [t.double().abs().sum() for t in tensors])
    gathered = [torch.empty_like(sums) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, sums)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "the ranks drew different inputs"


def _compare_cp(rank: int, world: int, kw: Dict[str, Any], comm: str, shape: tuple, fmt: str = "bshd",
                cu: torch.Tensor = None, module: bool = False) -> None:
    import fused_attn
    import fused_attn.distributed as fd

    gen = torch.Generator(device="cuda").manual_seed(_seed(kw, comm, shape))
    full = [torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64) for _ in range(3)]
    dout = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float64)
    _assert_same_on_every_rank(full + [dout])
    exact, g_exact = _grads(lambda *t: fused_attn.dot_product_attention(*t, backend="reference", **kw), full, dout,
                            torch.float64)
    single, g_single = _grads(lambda *t: fused_attn.dot_product_attention(*t, backend="cudnn", **kw), full, dout, _BF16)
    shard = lambda t: fd.shard_sequence(t, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731
    unshard = lambda t: fd.unshard_sequence(t, qkv_format=fmt, cu_seqlens=cu)  # noqa: E731
    loc = [shard(t).to(_BF16).requires_grad_(True) for t in full]
    if module:  # DotProductAttention(cp_group=...): the module's configuration, local shards in and out
        attn = fused_attn.DotProductAttention(shape[2], shape[3], qkv_format=fmt, backend="cudnn",
                                              cp_group=torch.distributed.group.WORLD, cp_comm=comm, **kw)
        out = attn(*loc)
    else:
        out = fd.context_parallel_attention(*loc, None, comm, backend="cudnn", **kw)
    (out.double() * shard(dout)).sum().backward()
    _check(f"{comm} out", unshard(out.detach()), single, exact)
    for name, l, gs, ge in zip("qkv", loc, g_single, g_exact):
        _check(f"{comm} d{name}", unshard(l.grad), gs, ge)


def cp_dense(comm: str, mask: str, softcap: bool = False):
    def case(rank: int, world: int) -> None:
        from score_mods import softcap as sc

        kw: Dict[str, Any] = dict(attn_mask_type=mask)
        if softcap:
            kw["score_mod"] = sc(30.0)
        _compare_cp(rank, world, kw, comm, (2, 512 * world, 8, 128))
    return case


def cp_thd(comm: str, mask: str):
    def case(rank: int, world: int) -> None:
        u = 2 * world
        lens = [256 * u, 64 * u, 0, 128 * u]  # an empty sequence included
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
        kw = dict(qkv_format="thd", attn_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        # (an earlier comparison failed only because the ranks drew different inputs: see _seed)
        _compare_cp(rank, world, kw, comm, (int(cu[-1]), 8, 128), fmt="thd", cu=cu)
    return case


def dtensor_sharding(dim: int):
    """DTensor batch (dim 0) / heads (dim 2) sharding on cuDNN against one GPU."""
    def case(rank: int, world: int) -> None:
        import fused_attn
        import fused_attn.distributed as fd
        from score_mods import softcap
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cuda", (world,))
        gen = torch.Generator(device="cuda").manual_seed(7 + dim)
        full = [torch.randn(2 * world, 1024, 4 * world, 128, generator=gen, device="cuda", dtype=torch.float64)
                for _ in range(3)]
        dout = torch.randn(*full[0].shape, generator=gen, device="cuda", dtype=torch.float64)
        kw = dict(attn_mask_type="causal", score_mod=softcap(30.0))
        exact, g_exact = _grads(lambda *t: fused_attn.dot_product_attention(*t, backend="reference", **kw), full,
                                dout, torch.float64)
        single, g_single = _grads(lambda *t: fused_attn.dot_product_attention(*t, **kw), full, dout, _BF16)
        dts = [distribute_tensor(t.to(_BF16), mesh, [Shard(dim)]).requires_grad_(True) for t in full]
        out = fd.dot_product_attention(*dts, **kw)
        (out.to(torch.float64) * distribute_tensor(dout, mesh, [Shard(dim)])).sum().backward()
        _check("dtensor out", out.full_tensor(), single, exact)
        for name, d, gs, ge in zip("qkv", dts, g_single, g_exact):
            _check(f"dtensor d{name}", d.grad.full_tensor(), gs, ge)
    return case


def cp_position_mod(comm: str, which: str):
    """Score_mods that read positions get global ones on cuDNN (one graph for every block)."""
    def case(rank: int, world: int) -> None:
        import score_mods as sm

        s, h = 512 * world, 8
        slopes = sm.alibi_slopes(h).cuda()
        kw: Dict[str, Any] = {
            "alibi": dict(attn_mask_type="causal", score_mod=sm.alibi(slopes)),
            "causal_mod": dict(score_mod=sm.compose(sm.softcap(30.0), sm.causal())),
            "window_mod": dict(score_mod=sm.sliding_window(300, 0)),
        }.get(which)
        if which == "bias":  # a fixed bias indexed by q_idx / kv_idx: indexed globally
            gen = torch.Generator(device="cuda").manual_seed(_seed(which, world))
            bias = torch.randn(1, h, s, s, generator=gen, device="cuda")
            kw = dict(attn_mask_type="causal", score_mod=sm.post_scale_bias(bias))
        _compare_cp(rank, world, kw, comm, (2, s, h, 128))
    return case


def thd_position_mod_refused(rank: int, world: int) -> None:
    import fused_attn.distributed as fd
    from score_mods import alibi, alibi_slopes

    cu = torch.tensor([0, 128 * world, 256 * world], dtype=torch.int32, device="cuda")
    local = fd.shard_sequence(torch.randn(256 * world, 4, 64, device="cuda", dtype=_BF16), qkv_format="thd",
                              cu_seqlens=cu)
    with pytest.raises(NotImplementedError, match="differ per sequence in a packed"):
        fd.context_parallel_attention(local, local, local, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                      max_seqlen_q=128 * world, max_seqlen_kv=128 * world,
                                      score_mod=alibi(alibi_slopes(4).cuda()))


def cp_thd_heads_position_mod(rank: int, world: int) -> None:
    """Head-parallel packed batches with a score_mod that reads positions run on cuDNN (the call
    sees the global sequence: no per-sequence offsets)."""
    import score_mods as sm

    u = 2 * world
    lens = [256 * u, 64 * u, 0, 128 * u]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    kw = dict(qkv_format="thd", attn_mask_type="causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
              max_seqlen_kv=max(lens), score_mod=sm.alibi(sm.alibi_slopes(8).cuda()))
    _compare_cp(rank, world, kw, "all_to_all", (int(cu[-1]), 8, 128), fmt="thd", cu=cu)


CASES: Dict[str, Callable] = {}
for _comm in ("ring", "all_gather", "all_to_all"):
    CASES[f"cp_dense_{_comm}_no_mask"] = cp_dense(_comm, "no_mask")
    CASES[f"cp_dense_{_comm}_causal"] = cp_dense(_comm, "causal")
    CASES[f"cp_dense_{_comm}_causal_softcap"] = cp_dense(_comm, "causal", softcap=True)
    CASES[f"cp_thd_{_comm}_causal"] = cp_thd(_comm, "causal")
    CASES[f"cp_thd_{_comm}_no_mask"] = cp_thd(_comm, "no_mask")
CASES["module_cp_ring_causal"] = lambda rank, world: _compare_cp(rank, world, dict(attn_mask_type="causal"), "ring",
                                                                  (2, 512 * world, 8, 128), module=True)
CASES["dtensor_batch"] = dtensor_sharding(0)
CASES["dtensor_heads"] = dtensor_sharding(2)
for _comm, _which in itertools.product(("ring", "all_gather", "all_to_all"), ("alibi", "causal_mod", "window_mod",
                                                                           "bias")):
    CASES[f"cp_{_comm}_{_which}"] = cp_position_mod(_comm, _which)
CASES["cp_thd_position_mod_refused_on_cudnn"] = thd_position_mod_refused
CASES["cp_thd_all_to_all_alibi"] = cp_thd_heads_position_mod
CASES["module_cp_auto_causal"] = lambda rank, world: _compare_cp(rank, world, dict(attn_mask_type="causal"), "auto",
                                                                  (2, 512 * world, 8, 128), module=True)


# ----------------------------------------------------------------------------- running


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "LOCAL_RANK" in os.environ


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=torch.device("cuda", rank))
    import fused_attn.distributed  # noqa: F401  (registers the sharding rules)

    results = {}
    try:
        for name, fn in CASES.items():
            start = time.monotonic()
            try:
                fn(rank, world)
                results[name] = [True, ""]
            except Exception as e:  # noqa: BLE001
                results[name] = [False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"]
            dist.barrier()
            if rank == 0:  # progress, so a timeout can say how far the group got
                with open(os.path.join(outdir, "progress.txt"), "a") as f:
                    f.write(f"{name}: {'ok' if results[name][0] else 'failed'} in {time.monotonic() - start:.1f} s\n")
    finally:
        with open(os.path.join(outdir, f"gpu_results_{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run_case(tmp_path_factory):
    """torchrun: init NCCL once and run each case in place; plain pytest: spawn one process per
    visible GPU (at least 2) once."""
    import torch.distributed as dist

    if _under_torchrun():
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        import fused_attn.distributed  # noqa: F401

        def run(name: str) -> None:
            CASES[name](dist.get_rank(), dist.get_world_size())
        yield run
        return
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    outdir = str(tmp_path_factory.mktemp("gpu_dist"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_worker, args=(world, port, outdir), nprocs=world, join=False, start_method="spawn")
    end = time.monotonic() + 900
    while not ctx.join(timeout=5):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            progress = os.path.join(outdir, "progress.txt")
            done = open(progress).read() if os.path.exists(progress) else "no case finished\n"
            raise TimeoutError(f"the {world}-GPU group did not finish in 900 s; cases done:\n{done}")
    merged: Dict[str, Any] = {}
    for r in range(world):
        with open(os.path.join(outdir, f"gpu_results_{r}.json")) as f:
            for name, (ok, msg) in json.load(f).items():
                prev = merged.get(name, (True, ""))
                merged[name] = (prev[0] and ok, prev[1] + ("" if ok else msg + "\n"))

    def lookup(name: str) -> None:
        assert name in merged, f"case {name} did not run"
        assert merged[name][0], merged[name][1]
    yield lookup


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_gpu(run_case, case):
    run_case(case)
