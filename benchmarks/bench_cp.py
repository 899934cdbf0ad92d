"""Context-parallel attention on N GPUs vs one GPU: causal bf16 forward + backward steps.

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py                 # S = 16k, 32k, 64k, 128k
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --quick         # S = 16k, 64k
    torchrun --nproc-per-node 2 benchmarks/bench_cp.py --seqlens 65536 --iters 20
    torchrun --nproc-per-node 4 benchmarks/bench_cp.py --seqlens 65536,131072 \
        --comms ring,ring_serial,ring_hp,all_gather,all_to_all --out OUT_DIR      # the 4-GPU run

Problem: B=1, H=16, D=128, bf16, causal, BSHD, cuDNN; the global sequence S is split over the N
ranks in the load-balanced layout (rank r holds chunks r and 2N-1-r). For each S:

  single       one GPU runs the whole problem (rank 0; the others wait)
  ring         context_parallel_attention(cp_comm="ring"): K/V exchange overlapped with compute
  ring_serial  the same with cp_overlap=False (each exchange waited before computing)
  ring_hp      the ring on a group whose NCCL streams have high priority (the exchange's kernels
               get SMs ahead of the attention kernels' pending blocks); GPU only
  all_gather   context_parallel_attention(cp_comm="all_gather")
  all_to_all   context_parallel_attention(cp_comm="all_to_all"): head-parallel (H % N == 0)
  comm_only    the ring's communication alone: (N-1) K/V exchanges (forward) + (N-1) K/V and
               N fp32 dK/dV exchanges (backward), timed without any attention

Columns: ms = GPU time per fwd+bwd step (CUDA events, median over iterations, the slowest
rank); wall_ms = wall-clock time per step (perf_counter over back-to-back steps, one device sync
at the end, the slowest rank: includes host overhead the GPU time hides); tflops per GPU
(causal fwd+bwd FLOPs 3.5 x 2*B*H*S^2*D, divided by N for the distributed rows), speedup =
single ms / ms, efficiency = speedup / N, hidden_ms = ring_serial - ring (communication the
overlap hides), exposed_ms = comm_only - hidden_ms, max_err = max|ring out - single out| /
the float64 reference on the last CHECK_ROWS query rows (those attend to every key), with the
project's bound (`fused_attn.testing`: 2x the error of the naive bf16 computation plus a floor);
dq_err / dq_bound: the same for the gradient of those query rows (one fwd+bwd step); single and
every distributed row are checked before timing (a wrong result is reported, not timed).

Each configuration runs in try/except (an error or OOM becomes a row with a note); rank 0 prints
versions first and rewrites benchmarks/results/cp_<gpu>x<N>.csv / .md after every row.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fused_attn  # noqa: E402
import fused_attn.distributed as fd  # noqa: E402
from benchmarks.common import (ImplWrongError, attn_flops, check_tensor, env_line, environment,  # noqa: E402
                                     gpu_slug, markdown_table, naive_attention, reference_and_bounds)
from fused_attn.distributed import cp_ring  # noqa: E402

CHECK_ROWS = 128  # query rows checked against float64 (the last ones: they attend to every key)
IMPLS = ("ring", "ring_serial", "ring_hp", "all_gather", "all_to_all")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="16384,32768,65536,131072")
    p.add_argument("--quick", action="store_true", help="S = 16384, 65536")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--comms", default="ring,ring_serial,all_gather",
                   help="comma list of ring, ring_serial, ring_hp, all_gather, all_to_all")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU baseline")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: gloo, CPU, reference backend, S = 64 and 128, H=4, D=16 (checks the harness only)")
    args = p.parse_args()
    bad = sorted(set(c for c in args.comms.split(",") if c) - set(IMPLS))
    if bad:
        p.error(f"--comms: unknown {bad}; accepted: {', '.join(IMPLS)}")
    if args.cpu_smoke:
        args.seqlens, args.quick, args.heads, args.dim, args.iters, args.warmup = "64,128", False, 4, 16, 2, 1
    return args


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _elapsed_ms(fn: Callable[[], Any]) -> float:
    """One timed call: CUDA events on the GPU, perf_counter on the CPU."""
    if DEVICE != "cuda":
        import time

        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def log(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def time_local(fn: Callable[[], Any], warmup: int, iters: int) -> Tuple[float, float]:
    """(median GPU ms of fn on this device (CUDA events), wall ms per call over back-to-back calls)."""
    import time

    for _ in range(warmup):
        fn()
    _sync()
    gpu = statistics.median(_elapsed_ms(fn) for _ in range(iters))
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return gpu, (time.perf_counter() - t0) * 1e3 / iters


def time_group(fn: Callable[[], Any], warmup: int, iters: int) -> Tuple[float, float]:
    """(median GPU ms per step, wall ms per step over back-to-back steps), each of the slowest rank
    (ranks aligned by a barrier before each timed step, and before the wall-clock run)."""
    import time

    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        _sync()
        times.append(_elapsed_ms(fn))
    dist.barrier()
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    wall = (time.perf_counter() - t0) * 1e3 / iters
    t = torch.tensor([statistics.median(times), wall], device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


class Writer:
    """Rank 0 keeps the rows and rewrites the CSV and markdown after each one."""

    def __init__(self, env: Dict[str, str], out_dir: str, world: int, notes: List[str]) -> None:
        self.env, self.rows, self.notes = env, [], notes
        os.makedirs(out_dir, exist_ok=True)
        self.base = os.path.join(out_dir, f"cp_{gpu_slug(env)}x{world}")

    COLUMNS = ("S", "B", "H", "D", "gpus", "impl", "ms", "wall_ms", "tflops", "speedup", "efficiency", "max_err",
               "bound", "dq_err", "dq_bound", "hidden_ms", "exposed_ms", "note")

    def add(self, row: Dict[str, Any]) -> None:
        if dist.get_rank() != 0:
            return
        row = {c: row.get(c) for c in self.COLUMNS}  # one column set: one table
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                               if v not in (None, "")), flush=True)
        cols: List[str] = []
        for r in self.rows:
            cols += [c for c in r if c not in cols]
        with open(self.base + ".csv", "w", newline="") as f:
            f.write("# " + env_line(self.env) + "\n")
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in self.rows:
                w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})
        with open(self.base + ".md", "w") as f:
            f.write(f"# context parallelism benchmark\n\n{env_line(self.env)}\n\n")
            for note in self.notes:
                f.write(f"- {note}\n")
            f.write("\n" + markdown_table(self.rows) + "\n")


def step_fn(attn: Callable[..., torch.Tensor], q, k, v, dout) -> Callable[[], Any]:
    def step():
        out = attn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)
    return step


def comm_only_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], None]:
    """The ring's exchanges of one fwd+bwd step, with no compute between them."""
    n, rank = dist.get_world_size(), dist.get_rank()
    cp = cp_ring.CPConfig(group=dist.group.WORLD, n=n, rank=rank, layout=None, causal=True, kwargs={})
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)

    def run():
        for _ in range(2 * (n - 1)):  # forward and backward K/V rings
            _, reqs = cp_ring._exchange(cp, [k, v])
            cp_ring._wait(reqs)
        for _ in range(n):  # the dK/dV accumulators
            _, reqs = cp_ring._exchange(cp, [dk, dv])
            cp_ring._wait(reqs)
    return run


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def reference_rows(full: List[torch.Tensor], s: int) -> Dict[str, Any]:
    """The float64 output and dq of the last CHECK_ROWS query rows of the full problem ((B, rows, H,
    D), for the cotangent full[3]) and their bounds by the project's rule."""
    rows = torch.arange(max(0, s - CHECK_ROWS), s, device=full[0].device)
    q, k, v, dout = (t.transpose(1, 2) for t in full)  # logical (B, H, S, D)
    mask = (torch.arange(s, device=rows.device).view(1, -1) <= rows.view(-1, 1)).view(1, 1, len(rows), s)
    scale = q.shape[-1] ** -0.5

    def compute(dt: torch.dtype) -> Dict[str, torch.Tensor]:
        got = naive_attention(q[:, :, rows], k, v, scale=scale, dtype=dt, mask=mask, grad_out=dout[:, :, rows])
        return {"out": got["out"], "dq": got["dq"]}
    expected, bounds = reference_and_bounds(compute, q.dtype)
    return dict(rows=rows, out=expected["out"].transpose(1, 2), dq=expected["dq"].transpose(1, 2),
                bound=bounds["out"], dq_bound=bounds["dq"])


def check_rows(name: str, out: torch.Tensor, dq: torch.Tensor, ref: Dict[str, Any], row: Dict[str, Any]) -> bool:
    """Rank 0: the checked rows of a full (B, S, H, D) output and dq against float64; records the
    errors and bounds in `row`; False (and a WRONG note) when one is above its bound."""
    row.update(bound=ref["bound"], dq_bound=ref["dq_bound"])
    try:
        row["max_err"] = check_tensor(name, "out", out[:, ref["rows"]], ref["out"], ref["bound"])
        row["dq_err"] = check_tensor(name, "dq", dq[:, ref["rows"]], ref["dq"], ref["dq_bound"])
        return True
    except ImplWrongError as exc:
        row["max_err" if exc.key == "out" else "dq_err"] = exc.err
        row["note"] = f"WRONG: {exc}; not timed"
        return False


def _note(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:160]}"


def bench_single(args: argparse.Namespace, full: List[torch.Tensor], kw: Dict[str, Any], ref: Dict[str, Any],
                 row: Dict[str, Any], flops: float) -> Optional[float]:
    """Rank 0: the whole problem on one device, checked then timed; returns its GPU ms."""
    try:
        fq, fk, fv = (t.clone().requires_grad_(True) for t in full[:3])
        attn = lambda a, bb, c: fused_attn.dot_product_attention(a, bb, c, **kw)  # noqa: E731
        out = attn(fq, fk, fv)
        dq = torch.autograd.grad(out, fq, full[3])[0]
        if not check_rows("single", out.detach(), dq, ref, row):
            return None
        del out, dq
        ms, wall = time_local(step_fn(attn, fq, fk, fv, full[3]), args.warmup, args.iters)
        row.update(ms=ms, wall_ms=wall, tflops=flops / ms / 1e9)
        return ms
    except Exception as e:  # noqa: BLE001
        row["note"] = _note(e)
        traceback.print_exc()
        return None


def _hp_group() -> Any:
    """A group of every rank whose NCCL streams have high priority (gloo: a plain new group)."""
    if DEVICE != "cuda":
        return dist.new_group()
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = True
    return dist.new_group(backend="nccl", pg_options=opts)


def bench_seqlen(args: argparse.Namespace, s: int, writer: Writer) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    b, h, d = args.batch, args.heads, args.dim
    flops = attn_flops(b, h, s, s, d, causal=True, mode="fwd_bwd")
    base = dict(S=s, B=b, H=h, D=d, gpus=world)
    gen = torch.Generator(device=DEVICE).manual_seed(s)
    full = [torch.randn(b, s, h, d, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    q, k, v, dout = (fd.shard_sequence(t).requires_grad_(i < 3) for i, t in enumerate(full))
    kw = dict(attn_mask_type="causal", backend="cudnn" if DEVICE == "cuda" else "reference")
    single_ms: Optional[float] = None
    ref: Dict[str, Any] = {}
    if rank == 0:
        ref = reference_rows(full, s)
        _empty_cache()
    if not args.no_single:
        row = dict(base, impl="single", gpus=1)
        if rank == 0:
            single_ms = bench_single(args, full, kw, ref, row, flops)
            _empty_cache()
        writer.add(row)
        dist.barrier()
    times: Dict[str, float] = {}
    for impl in [c for c in args.comms.split(",") if c]:
        row = dict(base, impl=impl)
        try:
            comm = impl if impl in ("all_gather", "all_to_all") else "ring"
            group = _hp_group() if impl == "ring_hp" else None
            attn = (lambda a, bb, c, _comm=comm, _ov=(impl != "ring_serial"), _g=group:
                    fd.context_parallel_attention(a, bb, c, _g, _comm, cp_overlap=_ov, **kw))
            out = attn(q, k, v)
            dq = torch.autograd.grad(out, q, dout)[0]
            out_full, dq_full = fd.unshard_sequence(out.detach()), fd.unshard_sequence(dq)
            wrong = rank == 0 and not check_rows(impl, out_full, dq_full, ref, row)
            flag = torch.tensor([int(wrong)], device=DEVICE)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank skips the timing of a wrong result
            del out, dq, out_full, dq_full
            if not int(flag):
                ms, wall = time_group(step_fn(attn, q, k, v, dout), args.warmup, args.iters)
                times[impl] = ms
                row.update(ms=ms, wall_ms=wall, tflops=flops / ms / 1e9 / world)
                if single_ms:
                    row.update(speedup=single_ms / ms, efficiency=single_ms / ms / world)
        except Exception as e:  # noqa: BLE001
            row["note"] = _note(e)
            if rank == 0:
                traceback.print_exc()
        _empty_cache()
        writer.add(row)
    if world > 1:
        row = dict(base, impl="comm_only")
        try:
            comm_ms, comm_wall = time_group(comm_only_fn(q.detach(), k.detach(), v.detach()), args.warmup, args.iters)
            row.update(ms=comm_ms, wall_ms=comm_wall)
            if "ring" in times and "ring_serial" in times:
                hidden = times["ring_serial"] - times["ring"]
                row.update(hidden_ms=hidden, exposed_ms=comm_ms - hidden,
                           note=f"overlap hides {100 * hidden / comm_ms:.0f}% of the ring's communication")
        except Exception as e:  # noqa: BLE001
            row["note"] = _note(e)
        writer.add(row)


def main() -> int:
    global DEVICE
    args = parse()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu_smoke:
        DEVICE = "cpu"
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
        env = environment(torch.device("cpu"))
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10),
                                device_id=torch.device("cuda", local))
        env = environment(torch.device("cuda", local))
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            env["nccl"] = "?"
    env["world"] = str(dist.get_world_size())
    log(f"bench_cp: {env_line(env)}")
    log(f"python {sys.version.split()[0]}, fused_attn {fused_attn.__version__}")
    seqlens = [16384, 65536] if args.quick else [int(x) for x in args.seqlens.split(",") if x]
    notes = [f"B={args.batch} H={args.heads} D={args.dim} bf16 causal bshd, cuDNN, load-balanced layout; "
             f"ms: median of {args.iters} fwd+bwd steps (slowest rank); tflops per GPU",
             "ms: GPU time per step (CUDA events); wall_ms: wall clock per step, back-to-back steps",
             "hidden_ms = ring_serial - ring; exposed_ms = comm_only - hidden_ms",
             f"max_err / dq_err: max |out - float64| / |dq - float64| over the last {CHECK_ROWS} query rows; "
             "bound / dq_bound: the project's rule (2x the naive bf16 error + floor); checked before timing"]
    writer = Writer(env, args.out, dist.get_world_size(), notes)
    for s in seqlens:
        log(f"-- S = {s}")
        try:
            bench_seqlen(args, s, writer)
        except Exception:  # noqa: BLE001 - keep going with the next size
            if dist.get_rank() == 0:
                traceback.print_exc()
        _empty_cache()
    if dist.get_rank() == 0:
        print("\n" + markdown_table(writer.rows), flush=True)
        print(f"\nwrote {writer.base}.csv and .md", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
