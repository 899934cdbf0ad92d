"""Train a Llama model with FSDP2 + context parallelism: fused_attn vs torch SDPA, same everything else.

    torchrun --nproc-per-node 4 benchmarks/train_cp.py --device cuda --out OUT_DIR          # 4 GPUs
    torchrun --nproc-per-node 4 benchmarks/train_cp.py --device cpu --model tiny --seq 64 \\
        --steps 3 --attn fused --out OUT_DIR                                                # CPU check

The model is transformers' LlamaForCausalLM built from a config (no weights): "debug" has the
dimensions of torchtitan's Llama 3 debug model (dim 256, 6 layers, 16 heads, vocab 2048, FFN
768, rope theta 5e5), "small" 8 layers of 1024 with 16 heads, "tiny" a CPU-sized one. Every rank
holds the same batch; each sequence is split over the CP group in the load-balanced layout (rank r
holds chunks r and 2N-1-r: `fused_attn.distributed.shard_sequence`, the same as torch's head-tail
load balancer), input ids, labels and RoPE position ids alike. FSDP2 (`fully_shard`, bf16 params,
fp32 reduction) shards the parameters over all ranks; the loss is the mean over the global tokens.

Attention (registered with transformers' AttentionInterface, one name per variant):
    fused  fused_attn.distributed.context_parallel_attention(cp_comm=--cp-comm), cuDNN on CUDA
    sdpa   torch.nn.functional.scaled_dot_product_attention on q/k/v DTensors sharded along the
           sequence, dispatched by torch's context parallelism (torch.distributed.tensor.
           experimental, load balancing on, --sdpa-rotate "alltoall": its ring, or "allgather");
           CUDA only (torch's context parallelism has no CPU kernels)
Both runs start from the same weights (seeded init) and see the same synthetic batches: token
sequences that repeat a random segment (period 16..seq/4), so the loss falls once the model
learns to copy from far back (which crosses ranks). Losses equal within bf16 noise is the check.

Before training, each variant's model computes the loss of step 0's batch unsharded (the whole
sequence on every rank, transformers' own SDPA): step 0's context-parallel loss must match it.

Output under --out: train_cp_<device>x<N>.csv (step, attn, loss, step_ms per step), a summary
.md (tokens/s over the steps after --skip, final losses, the max loss difference per window) and
stdout. Each variant runs in try/except: one failing still leaves the other's rows.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fused_attn.distributed as fd  # noqa: E402

MODELS = {
    "debug": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=768, vocab_size=2048, rope_theta=500000.0),
    "small": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                  intermediate_size=2816, vocab_size=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=128, vocab_size=128, rope_theta=10000.0),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="debug")
    p.add_argument("--seq", type=int, default=32768, help="global sequence length (split over the ranks)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="steps left out of tokens/s (warmup, graph builds)")
    p.add_argument("--attn", default="fused,sdpa", help="comma list of fused, sdpa (run in this order)")
    p.add_argument("--cp-comm", default="auto", choices=fd.CP_COMMS)
    p.add_argument("--sdpa-rotate", default="alltoall", choices=("alltoall", "allgather"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    for a in args.attn.split(","):
        if a not in ("fused", "sdpa"):
            p.error(f"--attn: unknown {a!r}; accepted: fused, sdpa")
    return args


# ----------------------------------------------------------------------------- attention


class CP:
    """The context-parallel group of the run (the attention functions read it)."""

    group: Any = None
    mesh: Any = None
    comm: str = "ring"
    backend: str = "auto"


def fused_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                    scaling: Any = None, dropout: float = 0.0, **kwargs: Any):
    """transformers' attention signature: q/k/v (B, H, S_local, D) -> (out (B, S_local, H, D), None)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # bshd views
    out = fd.context_parallel_attention(q, k, v, CP.group, CP.comm, attn_mask_type="causal", softmax_scale=scaling,
                                        backend=CP.backend)
    return out, None


def sdpa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                   scaling: Any = None, dropout: float = 0.0, **kwargs: Any):
    """torch SDPA under torch's context parallelism: DTensors sharded along the sequence (dim 2)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = query.shape[1] // key.shape[1]
    if rep > 1:  # GQA: expanded, as torch's ring rotates what it is given
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (DTensor.from_local(t.contiguous(), CP.mesh, [Shard(2)], run_check=False) for t in (query, key, value))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    return out.to_local().transpose(1, 2), None


def register(name: str, fn: Callable) -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, lambda *a, **k: None)  # causal is the attention's own


def enable_torch_cp(rotate: str) -> None:
    from torch.distributed.tensor.experimental._attention import _enable_context_parallel_dispatcher, set_rotate_method

    set_rotate_method(rotate)
    _enable_context_parallel_dispatcher()


# ----------------------------------------------------------------------------- data and model


def batch(step: int, args: argparse.Namespace, vocab: int, device: torch.device) -> torch.Tensor:
    """(B, seq + 1) tokens: a random segment repeated (the same on every rank, per step and seed)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    rows = []
    for _ in range(args.batch):
        period = int(torch.randint(16, max(17, args.seq // 4), (1,), generator=g))
        seg = torch.randint(0, vocab, (period,), generator=g)
        rows.append(seg.repeat(math.ceil((args.seq + 1) / period))[: args.seq + 1])
    return torch.stack(rows).to(device)


def build(args: argparse.Namespace, attn_name: str, device: torch.device, mesh: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODELS[args.model], max_position_embeddings=args.seq, tie_word_embeddings=False,
                      use_cache=False)
    cfg._attn_implementation = attn_name
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(device)  # the same init on every rank and for every variant
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's load-balanced shard of a (B, S) tensor."""
    return fd.shard_sequence(t.unsqueeze(-1).unsqueeze(-1), CP.group).squeeze(-1).squeeze(-1)


def train(args: argparse.Namespace, attn: str, device: torch.device, mesh: Any) -> List[Dict[str, Any]]:
    vocab = MODELS[args.model]["vocab_size"]
    model = build(args, "fa_cp" if attn == "fused" else "sdpa_cp", device, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    n = dist.get_world_size(CP.group)
    positions = local(torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, -1))
    tokens_global = args.batch * args.seq
    ref = unsharded_loss(model, batch(0, args, vocab, device))
    rows = []
    for step in range(args.steps):
        data = batch(step, args, vocab, device)
        ids, labels = local(data[:, :-1]), local(data[:, 1:])
        _sync(device)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
        # FSDP averages gradients over the N ranks: scale so the result is d(global mean)/dθ
        (loss_sum * (n / tokens_global)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = loss_sum.detach().clone()
        dist.all_reduce(total, group=CP.group)
        loss = float(total) / tokens_global  # a host read per step: the step boundary of the timing
        ms = (time.perf_counter() - t0) * 1e3
        rows.append(dict(step=step, attn=attn, loss=loss, step_ms=ms, unsharded_loss=ref if step == 0 else ""))
        if dist.get_rank() == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"  {attn} step {step}: loss {loss:.4f}, {ms:.1f} ms", flush=True)
    del model, opt
    return rows


@torch.no_grad()
def unsharded_loss(model: Any, data: torch.Tensor) -> float:
    """The loss of the whole sequence on one process with transformers' own SDPA attention (no
    context parallelism): what step 0's loss must equal within bf16 noise."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        logits = model(input_ids=data[:, :-1], use_cache=False).logits
        return float(F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten()))
    finally:
        model.config._attn_implementation = impl


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- results


def summarize(rows: List[Dict[str, Any]], args: argparse.Namespace, world: int, failures: Dict[str, str]) -> str:
    by: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["attn"], []).append(r)
    lines = [f"# train_cp: Llama '{args.model}' FSDP2 + CP={world}, seq {args.seq}, batch {args.batch}, "
             f"{args.steps} steps, fused cp_comm={args.cp_comm}, sdpa rotate={args.sdpa_rotate}", "",
             "| attn | tokens/s | ms/step | step-0 loss | step-0 loss unsharded | final loss (mean of last 20) |",
             "|---|---|---|---|---|---|"]
    tps = {}
    for attn, rs in by.items():
        timed = rs[args.skip:] or rs
        ms = sum(r["step_ms"] for r in timed) / len(timed)
        tps[attn] = args.batch * args.seq / (ms / 1e3)
        tail = [r["loss"] for r in rs[-20:]]
        lines.append(f"| {attn} | {tps[attn]:.0f} | {ms:.1f} | {rs[0]['loss']:.4f} | {rs[0]['unsharded_loss']:.4f} | "
                     f"{sum(tail) / len(tail):.4f} |")
    if "fused" in by and "sdpa" in by and len(by["fused"]) == len(by["sdpa"]):
        lines += ["", f"tokens/s fused / sdpa: {tps['fused'] / tps['sdpa']:.3f}", "",
                  "| steps | max abs loss difference | mean loss (sdpa) |", "|---|---|---|"]
        for w0 in range(0, len(by["fused"]), 50):
            pair = list(zip(by["fused"][w0:w0 + 50], by["sdpa"][w0:w0 + 50]))
            diff = max(abs(a["loss"] - b["loss"]) for a, b in pair)
            mean = sum(b["loss"] for _, b in pair) / len(pair)
            lines.append(f"| {w0}-{w0 + len(pair) - 1} | {diff:.4f} | {mean:.4f} |")
        lines += ["", "bf16 noise: the relative spacing of bf16 is 2^-8 = 0.0039; step 0 starts from identical "
                  "weights and data, so its difference is attention numerics alone"]
    for attn, why in failures.items():
        lines.append(f"\n{attn} FAILED: {why}")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0")) if args.device == "cuda" else None)
    if args.device == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("cp",))
    CP.group, CP.mesh, CP.comm = mesh.get_group("cp"), mesh, args.cp_comm
    CP.backend = "cudnn" if args.device == "cuda" else "auto"
    register("fa_cp", fused_attention)
    register("sdpa_cp", sdpa_attention)
    rows: List[Dict[str, Any]] = []
    failures: Dict[str, str] = {}
    for attn in args.attn.split(","):
        if dist.get_rank() == 0:
            print(f"-- {attn}", flush=True)
        try:
            if attn == "sdpa":
                if args.device != "cuda":
                    raise NotImplementedError("torch's context parallelism dispatches CUDA SDPA kernels only")
                enable_torch_cp(args.sdpa_rotate)
            rows += train(args, attn, device, mesh)
        except Exception as e:  # noqa: BLE001 - reported, the other variant still runs
            failures[attn] = f"{type(e).__name__}: {str(e)[:300]}"
            if dist.get_rank() == 0:
                traceback.print_exc()
        finally:
            if attn == "sdpa" and args.device == "cuda":
                from torch.distributed.tensor.experimental._attention import _disable_context_parallel_dispatcher

                _disable_context_parallel_dispatcher()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"train_cp_{args.device}x{world}")
        with open(base + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["step", "attn", "loss", "step_ms", "unsharded_loss"])
            w.writeheader()
            w.writerows(rows)
        text = summarize(rows, args, world, failures)
        with open(base + ".md", "w") as f:
            f.write(text)
        print("\n" + text + f"\nwrote {base}.csv and .md", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
