"""Cases for 4 spawned gloo processes: CP groups that are not the world group, the ring's
communication/compute order, and a rank that fails mid-step (see test_cp_groups_faults.py)."""

from __future__ import annotations

import os
import re
import time
import traceback
from typing import Any, Callable, Dict, List

import torch

from _cp_compare import Ctx, compare

COMMS = ("ring", "all_gather", "all_to_all")


def _inputs(ctx: Ctx) -> List[torch.Tensor]:
    return [ctx.randn(2, 16, 8, 16), ctx.randn(2, 16, 4, 16), ctx.randn(2, 16, 4, 16)]


def subgroups(kind: str) -> Callable:
    """Two CP groups of 2 ranks ("pairs": {0,1} {2,3}; "strided": {0,2} {1,3}; "mesh": the cp dim
    of a (dp=2, cp=2) DeviceMesh); each group attends its own data (a rank that talked to the
    other group would get the other group's keys, and fail the comparison)."""
    def case(ctx: Ctx) -> None:
        import torch.distributed as dist

        if kind == "mesh":
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            group, gid = mesh.get_group("cp"), mesh.get_local_rank("dp")
        else:
            members = [[0, 1], [2, 3]] if kind == "pairs" else [[0, 2], [1, 3]]
            groups = [dist.new_group(m) for m in members]  # every rank creates every group
            gid = next(i for i, m in enumerate(members) if ctx.rank in m)
            group = groups[gid]
        assert dist.get_world_size(group) == 2
        for comm in COMMS:
            ctx.seed(kind, comm, gid)  # distinct data per group
            compare(ctx, _inputs(ctx), dict(attn_mask_type="causal"), comm, group=group)
    return case


def ring_order(ctx: Ctx) -> None:
    """Each ring exchange (K/V forward and backward, dK/dV backward) is posted before an attention
    call and waited after it (cp_overlap=True; all but the final dK/dV hop), and waited at once
    with cp_overlap=False; the results are identical."""
    from fused_attn.distributed import cp_ring

    log: List[tuple] = []
    orig = {n: getattr(cp_ring, n) for n in ("_exchange", "_wait", "attention_forward", "attention_backward")}

    def exchange_logged(cp, tensors):
        log.append(("post", None))
        idx = len(log) - 1
        bufs, reqs = orig["_exchange"](cp, tensors)  # with cp_overlap=False it waits inside (logged)
        log[idx] = ("post", id(reqs) if reqs else log[-1][1])
        return bufs, reqs

    def wait_logged(reqs):
        if reqs:
            log.append(("wait", id(reqs)))
        orig["_wait"](reqs)

    def computing(name):
        def fn(*a, **k):
            log.append(("compute",))
            return orig[name](*a, **k)
        return fn

    fd = ctx.fd
    q, k, v = (fd.shard_sequence(t).requires_grad_(True) for t in _inputs(ctx)[:1] * 3)
    try:
        cp_ring._exchange, cp_ring._wait = exchange_logged, wait_logged
        cp_ring.attention_forward = computing("attention_forward")
        cp_ring.attention_backward = computing("attention_backward")
        results = {}
        for overlap in (True, False):
            log.clear()
            out = fd.context_parallel_attention(q, k, v, None, "ring", attn_mask_type="causal", cp_overlap=overlap)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            results[overlap] = (out.detach(), grads, list(log))
    finally:
        for n, f in orig.items():
            setattr(cp_ring, n, f)
    for overlap, (_, _, events) in results.items():
        posts = [i for i, e in enumerate(events) if e[0] == "post"]
        # forward: N-1 K/V; backward: N-1 K/V and N dK/dV (the last: the accumulators' final hop
        # to their owners, after the last block: nothing is left to overlap it with)
        assert len(posts) == 2 * (ctx.world - 1) + ctx.world, events
        for i in posts[:-1]:
            j = next(j for j in range(i + 1, len(events)) if events[j] == ("wait", events[i][1]))
            between = [e for e in events[i + 1:j] if e[0] == "compute"]
            if overlap:
                assert between, f"exchange posted at event {i} was waited at {j} with no attention call between"
            else:
                assert not between, f"cp_overlap=False: exchange at event {i} waited after an attention call"
    a, b = results[True], results[False]
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "overlap changed results"


def cases(world: int) -> Dict[str, Callable]:
    return {"subgroups_pairs": subgroups("pairs"), "subgroups_strided": subgroups("strided"),
            "subgroups_mesh": subgroups("mesh"), "ring_order": ring_order}


def worker(rank: int, world: int, port: int, outdir: str) -> None:
    import warnings

    import torch.distributed as dist
    from _cp4_cases import run_cases
    from _spawn import init_gloo, write_result

    warnings.simplefilter("ignore")
    init_gloo(rank, world, port)
    try:
        write_result(outdir, rank, run_cases(Ctx(rank, world), cases(world), dist.barrier))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- faults


FAULT = "injected fault on rank 2"


def _inject(comm: str) -> Callable[[], None]:
    """Make rank 2's attention raise at its second block call (ring: step 1; all-gather: the second
    local chunk, after the gather) or at the head-parallel call (before the output exchange);
    returns the undo."""
    import fused_attn.functional as functional
    from fused_attn.distributed import cp_ring

    if comm == "all_to_all":
        orig_dpa = functional.dot_product_attention

        def failing(*a: Any, **k: Any):
            raise RuntimeError(FAULT)
        functional.dot_product_attention = failing
        return lambda: setattr(functional, "dot_product_attention", orig_dpa)
    orig = cp_ring.attention_forward
    calls = []

    def flaky(*a: Any, **k: Any):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(FAULT)
        return orig(*a, **k)
    cp_ring.attention_forward = flaky
    return lambda: setattr(cp_ring, "attention_forward", orig)


def _failing_step(ctx: Ctx, comm: str, group: Any) -> Dict[str, Any]:
    fd = ctx.fd
    ctx.seed("fault", comm)
    q, k, v = (fd.shard_sequence(t, group).requires_grad_(True) for t in _inputs(ctx))
    undo = _inject(comm) if ctx.rank == 2 else (lambda: None)
    t0 = time.monotonic()
    res: Dict[str, Any] = {"raised": False}
    try:
        out = fd.context_parallel_attention(q, k, v, group, comm, attn_mask_type="causal")
        out.sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads it
        res = {"raised": True, "type": type(e).__name__, "message": str(e)[:500],
               "notes": list(getattr(e, "__notes__", [])), "trace": traceback.format_exc(limit=-3)[-1500:]}
    finally:
        undo()
    res["elapsed_s"] = time.monotonic() - t0
    return res


def fault_worker(rank: int, world: int, port: int, outdir: str, pg_timeout_s: float) -> None:
    """For each strategy, one training-like step (forward + backward) on a fresh CP group (all 4
    ranks, timeout pg_timeout_s) where rank 2 raises; every rank records what it raised and
    when. The failing rank stays alive and joins the next strategy's group (as a process that
    caught and logged the error would), so its peers must get out through the timeout, not a
    closed socket. The default group (healthy, long timeout) keeps the strategies in step."""
    import datetime
    import warnings

    import torch.distributed as dist
    from _spawn import init_gloo, write_result

    warnings.simplefilter("ignore")
    init_gloo(rank, world, port, timeout_s=120.0)
    ctx = Ctx(rank, world)
    out: Dict[str, Any] = {}
    for comm in COMMS:
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=pg_timeout_s))
        out[comm] = _failing_step(ctx, comm, group)
        dist.barrier()  # the default group: every rank is out of the failed step
    write_result(outdir, rank, out)
    os._exit(0)  # the CP groups are broken: no destroy_process_group
