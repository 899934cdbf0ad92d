"""fused_attn.distributed on CPU: DTensor sharding, context parallelism, tracing with fake tensors.

Single-process tests: the region planner, the layouts and shard helpers, offset score_mods,
which kinds of sharding a spec allows, and that every entry point traces with fake tensors
(AutoParallel's capture and torch.compile(fullgraph=True)) without reading the host.

Multi-process tests: one spawned gloo group per world size (2 and 4 processes) runs every case
of tests/helpers/dist_cases.py and tests/helpers/cp_cases.py (float64, reference backend) and reports each
case; the tests below look their case up (so a group is started once, not once per case).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="needs torch.distributed with gloo")

import fused_attn  # noqa: E402
from fused_attn.distributed import cp_layout as L  # noqa: E402
from fused_attn.distributed.cp_mods import OffsetMod, reads_positions  # noqa: E402
from fused_attn.distributed.sharding import allowed_kinds  # noqa: E402
from fused_attn.testing import agreement_bound, assert_close, max_error  # noqa: E402
from helpers import dist_cases  # noqa: E402


# ----------------------------------------------------------------------------- the region planner


def _attended(q_ids, kv_ids, causal):
    return {(i, j) for i, a in enumerate(q_ids) for j, b in enumerate(kv_ids) if not causal or a >= b}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_regions_cover_attended_pairs_once(n, layout, causal, affine):
    """Every attended (query chunk, key chunk) pair is in exactly one region; each region's mask
    is right for its pairs; with affine (position mods) each region's chunk ids are consecutive."""
    for r, src in itertools.product(range(n), repeat=2):
        q_ids, kv_ids = L.chunk_ids(layout, n, r), L.chunk_ids(layout, n, src)
        seen = []  # (query chunk, key chunk) pairs a region lets attend
        for reg in L.plan_regions(q_ids, kv_ids, causal, affine):
            qs, ks = q_ids[reg.i0:reg.i1], kv_ids[reg.j0:reg.j1]
            for i, j in itertools.product(range(reg.i0, reg.i1), range(reg.j0, reg.j1)):
                a, b = q_ids[i], kv_ids[j]
                if reg.mask == "no_mask":
                    assert not causal or a > b, f"full block over a masked pair {a, b}"
                    seen.append((i, j))
                else:  # top-left causal on the block: chunk pairs below its diagonal attend fully, on it causally
                    li, lj = i - reg.i0, j - reg.j0
                    assert (li > lj) == (a > b) and (li == lj) == (a == b)
                    if li >= lj:
                        seen.append((i, j))
            if affine:
                assert all(y == x + 1 for x, y in zip(qs, qs[1:])) and all(y == x + 1 for x, y in zip(ks, ks[1:]))
        assert len(seen) == len(set(seen)), "a pair is computed twice"
        assert set(seen) == _attended(q_ids, kv_ids, causal)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_load_balanced_causal_is_one_call_per_step(n):
    """As Transformer Engine: same rank -> causal; src < r -> keys' first chunk; src > r -> queries' second chunk."""
    for r, src in itertools.product(range(n), repeat=2):
        regs = L.plan_regions(L.chunk_ids("load_balanced", n, r), L.chunk_ids("load_balanced", n, src), True, False)
        assert len(regs) == 1
        want = (0, 2, 0, 2, "causal") if src == r else (0, 2, 0, 1, "no_mask") if src < r else (1, 2, 0, 2, "no_mask")
        assert tuple(regs[0]) == want


# ----------------------------------------------------------------------------- layouts and helpers


@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "bhsd"])
def test_dense_shards_round_trip(layout, fmt):
    from fused_attn.distributed import shard_sequence

    n = 4
    full = torch.arange(2 * 16 * 3 * 2, dtype=torch.float64).view({"bshd": (2, 16, 3, 2), "sbhd": (16, 2, 3, 2),
                                                                  "bhsd": (2, 3, 16, 2)}[fmt])
    shards = torch.stack([shard_sequence(full, layout=layout, qkv_format=fmt, world_size=n, rank=r) for r in range(n)])
    lay = L.DenseLayout(fmt, layout, n, 0, 4, 4)
    assert torch.equal(lay.to_global(shards), full)
    assert torch.equal(lay.to_rank_major(full), shards)
    if layout == "load_balanced":  # rank 1 of 4 holds chunks 1 and 6 (of 8, 2 tokens each)
        seq = {"bshd": 1, "sbhd": 0, "bhsd": 2}[fmt]
        assert torch.equal(shards[1], torch.cat([full.narrow(seq, 2, 2), full.narrow(seq, 12, 2)], seq))


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_thd_shards_round_trip(layout):
    from fused_attn.distributed import shard_sequence

    n, units = 2, (4 if layout == "load_balanced" else 2)
    lens = [2 * units, 0, units, 3 * units]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    full = torch.arange(int(cu[-1]), dtype=torch.float64).view(-1, 1, 1).expand(-1, 2, 3).contiguous()
    shards = torch.stack([shard_sequence(full, layout=layout, qkv_format="thd", cu_seqlens=cu, world_size=n, rank=r)
                          for r in range(n)])
    lay = L.ThdLayout(layout, n, 0, cu, cu, max(lens), max(lens), int(cu[-1]) // n, int(cu[-1]) // n)
    assert torch.equal(lay.to_global(shards), full)
    assert torch.equal(lay.to_rank_major(full), shards)
    # sequence 0 (tokens 0..7 with 4 chunks of 2 when load-balanced): rank 0 holds chunks 0 and 3
    if layout == "load_balanced":
        assert shards[0, :4, 0, 0].tolist() == [0, 1, 6, 7]
    # the region index picks local chunk 1 of every sequence
    idx = L.ThdLayout(layout, n, 0, cu, cu, max(lens), max(lens), int(cu[-1]) // n, int(cu[-1]) // n)
    if layout == "load_balanced":
        assert shards[0].index_select(0, idx.index("q", 1, 2))[:, 0, 0].tolist()[:2] == [6, 7]


def test_thd_lengths_not_divisible_raise():
    from fused_attn.distributed import shard_sequence

    cu = torch.tensor([0, 6, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"every sequence length must be a multiple of 4"):
        shard_sequence(torch.zeros(14, 1, 8), qkv_format="thd", cu_seqlens=cu, world_size=2, rank=0)


def test_offset_mod_evaluates_at_global_positions():
    """An ALiBi bias on a block at offsets equals the bias of the whole matrix there."""
    from score_mods import alibi, alibi_slopes

    mod = alibi(alibi_slopes(4).double())
    s = torch.zeros(1, 4, 16, 16, dtype=torch.float64)
    idx = lambda n: torch.arange(n)  # noqa: E731
    whole = mod.eager(s, torch.zeros(1, 1, 1, 1, dtype=torch.long), idx(4).view(1, 4, 1, 1), idx(16).view(1, 1, 16, 1),
                      idx(16).view(1, 1, 1, 16), 16, 16)
    block = OffsetMod(mod, 8, 4, 16, 16, (16, 16)).eager(
        s[..., :4, :4], torch.zeros(1, 1, 1, 1, dtype=torch.long), idx(4).view(1, 4, 1, 1), idx(4).view(1, 1, 4, 1),
        idx(4).view(1, 1, 1, 4), 4, 4)
    assert torch.equal(block, whole[..., 8:12, 4:8])


def test_reads_positions():
    from score_mods import alibi, alibi_slopes, causal, post_scale_bias, score_mod, softcap

    assert not reads_positions(softcap(30.0)) and not reads_positions(None)
    assert reads_positions(causal()) and reads_positions(alibi(alibi_slopes(4)))
    assert reads_positions(post_scale_bias(torch.zeros(1, 1, 4, 4)))

    @score_mod
    def per_head(score, b, h, q_idx, kv_idx):
        return score * (h + 1.0)

    assert not reads_positions(per_head)


def test_allowed_kinds_name_the_reason():
    from fused_attn.spec import resolve_spec

    spec, _ = resolve_spec(qkv_format="thd")
    assert allowed_kinds(spec, 4, 4)["batch"].startswith("packed thd tokens cannot be split by batch")
    spec, _ = resolve_spec(score_mod=lambda s, b, h, q, k: s + b)
    assert "reads the index 'b'" in allowed_kinds(spec, 4, 4)["batch"] and allowed_kinds(spec, 4, 4)["heads"] is None
    spec, _ = resolve_spec()
    assert "GQA with 8 query heads and 2 key/value heads" in allowed_kinds(spec, 8, 2, 4)["heads"]


def test_sharding_rules_registered():
    from torch.distributed.tensor import DTensor

    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    assert torch.ops.fused_attn.attn_fwd.default in funcs and torch.ops.fused_attn.attn_bwd.default in funcs
    assert torch.ops.aten._assert_async.msg in funcs


# ----------------------------------------------------------------------------- fake tensors


def _entry(kind):
    import fused_attn

    attn = fused_attn.DotProductAttention(4, 16, attn_mask_type="causal")

    def fn(x, cu):
        if kind == "doc_packed":
            return fused_attn.doc_packed_attn(x, x, x, cu, is_causal=True)
        if kind == "module":
            return attn(x, x, x)
        if kind == "dot_product_attention":
            return fused_attn.dot_product_attention(x, x, x, attn_mask_type="causal")
        t = x.reshape(-1, 4, 16)
        if kind == "varlen":
            return fused_attn.varlen_attn(t, t, t, cu, cu, 64, 64, window_size=(-1, 0))
        return fused_attn.dot_product_attention(t, t, t, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                max_seqlen_q=64, max_seqlen_kv=64)
    return fn


def _fake_inputs(kind):
    x = torch.randn(2, 64, 4, 16, requires_grad=True)
    if kind == "doc_packed":
        return x, torch.tensor([[0, 10, 64], [0, 64, 64]], dtype=torch.int32)
    return x, torch.tensor([0, 10, 64, 128], dtype=torch.int32)


KINDS = ["doc_packed", "module", "dot_product_attention", "varlen", "thd"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_autoparallel_style_capture_with_fake_tensors(kind):
    """What AutoParallel does before sharding: dynamo export capture + AOT joint graph on fake
    tensors. A host read would raise DataDependentOutputException; the joint graph holds the
    custom ops forward and backward and no host scalar read."""
    export = pytest.importorskip("torch._dynamo.functional_export")
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses import FakeTensorMode
    import contextlib

    fn = _entry(kind)
    with FakeTensorMode():
        x, cu = _fake_inputs(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch._dynamo.config.patch(install_free_tensors=True):
            gm = export._dynamo_graph_capture_for_export(fn)(x, cu)
        with contextlib.ExitStack() as stack:
            joint = aot_export_joint_with_descriptors(stack, gm, (x, cu))
    targets = {str(n.target) for n in joint.graph_module.graph.nodes if n.op == "call_function"}
    assert {"fused_attn.attn_fwd.default", "fused_attn.attn_bwd.default"} <= targets
    assert not any("_local_scalar_dense" in t or t.endswith(".item") for t in targets), sorted(targets)


@pytest.mark.slow  # torch.compile under fake tensors
@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 11),
                    reason="torch 2.10 cannot torch.compile under an active FakeTensorMode (torch's own SDPA fails "
                           "the same way: the backend's fake mode differs from the inputs')")
@pytest.mark.parametrize("kind", KINDS)
def test_compile_fullgraph_with_fake_tensors(kind):
    from torch._subclasses import FakeTensorMode

    torch._dynamo.reset()
    fn = torch.compile(_entry(kind), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        x, cu = _fake_inputs(kind)
        out = fn(x, cu)
        out.sum().backward()
        assert x.grad.shape == x.shape


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["module", "dot_product_attention"])
def test_eager_dense_calls_with_fake_tensors(kind):
    from torch._subclasses import FakeTensorMode

    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        x, cu = _fake_inputs(kind)
        _entry(kind)(x, cu).sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["doc_packed", "varlen", "thd"])
def test_eager_thd_calls_with_fake_tensors(kind):
    """Eager thd calls on fake tensors read no cu_seqlens (they go to the ops' fake implementations)."""
    from torch._subclasses import FakeTensorMode

    with warnings.catch_warnings(), FakeTensorMode():
        warnings.simplefilter("ignore")
        x, cu = _fake_inputs(kind)
        out = _entry(kind)(x, cu)
        out.sum().backward()
        assert x.grad.shape == x.shape


# ----------------------------------------------------------------------------- multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, outdir: str, deadline_s: float = 240.0) -> dict:
    """Run every case of `world` in a spawned gloo group; {case: (ok, message)} over all ranks."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(dist_cases.worker, args=(world, _free_port(), outdir), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > end:
                raise TimeoutError(f"the {world}-process group did not finish in {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    merged: dict = {}
    for r in range(world):
        with open(os.path.join(outdir, f"results_{r}.json")) as f:
            for name, (ok, msg) in json.load(f).items():
                prev = merged.get(name, (True, ""))
                merged[name] = (prev[0] and ok, prev[1] + ("" if ok else msg + "\n"))
    return merged


_GROUPS: dict = {}


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    def get(world: int) -> dict:
        if world not in _GROUPS:
            _GROUPS[world] = _spawn(world, str(tmp_path_factory.mktemp(f"dist{world}")))
        return _GROUPS[world]
    return get


def _check(results: dict, case: str) -> None:
    assert case in results, f"case {case} did not run (a rank failed before it)"
    ok, msg = results[case]
    assert ok, msg


@pytest.mark.slow  # spawned gloo process groups
@pytest.mark.parametrize("case", dist_cases.case_names(2))
def test_two_processes(group_results, case):
    _check(group_results(2), case)


@pytest.mark.slow  # spawned gloo process groups
@pytest.mark.parametrize("case", dist_cases.case_names(4))
def test_four_processes(group_results, case):
    _check(group_results(4), case)


@pytest.mark.slow  # spawned gloo process groups
def test_bench_cp_cpu_smoke(tmp_path):
    """benchmarks/bench_cp.py under torchrun on 2 CPU processes (--cpu-smoke): every row is
    written and checked, none has an error note."""
    import csv
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), os.path.join(root, "benchmarks", "bench_cp.py"), "--cpu-smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "cp_cpux2.csv") as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    impls = [(r["S"], r["impl"]) for r in rows]
    assert impls == [(s, i) for s in ("64", "128") for i in ("single", "ring", "ring_serial", "all_gather",
                                                            "comm_only")], impls
    assert all(r["ms"] for r in rows)
    assert not any(r["note"] and "overlap hides" not in r["note"] for r in rows), rows
    checked = [r for r in rows if r["impl"] != "comm_only"]  # against float64 with the project's bound
    assert all(0 < float(r["max_err"]) <= float(r["bound"]) for r in checked), checked


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group in this process (routing and refusals, not sharding, are under test)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.slow
def test_core_entry_points_route_dtensors(one_rank_group):
    """fused_attn.dot_product_attention / varlen_attn / DotProductAttention / doc_packed_attn given
    DTensors go to fused_attn.distributed (a one-rank group here: the routing, not the sharding,
    is under test; the sharded cases run in the multi-process tests)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v))
    want = fused_attn.dot_product_attention(q, k, v, attn_mask_type="causal")
    got = fused_attn.dot_product_attention(dq, dk, dv, attn_mask_type="causal")
    assert isinstance(got, DTensor) and max_error(got.full_tensor(), want) <= agreement_bound(want)
    attn = fused_attn.DotProductAttention(4, 8, attn_mask_type="causal")
    got = attn(dq, dk, dv)
    assert isinstance(got, DTensor) and max_error(got.full_tensor(), want) <= agreement_bound(want)
    cu = torch.tensor([[0, 5, 16], [0, 16, 16]], dtype=torch.int32)
    want = fused_attn.doc_packed_attn(q, k, v, cu, is_causal=True)
    got = fused_attn.doc_packed_attn(dq, dk, dv, cu, is_causal=True)
    assert isinstance(got, DTensor) and max_error(got.full_tensor(), want) <= agreement_bound(want)
    packed = [t.reshape(32, 4, 8) for t in (q, k, v)]
    cu1 = torch.tensor([0, 16, 32], dtype=torch.int32)
    want = fused_attn.varlen_attn(*packed, cu1, cu1, 16, 16, window_size=(-1, 0))
    dpacked = [distribute_tensor(t, mesh, [Shard(1)]) for t in packed]
    got = fused_attn.varlen_attn(*dpacked, cu1, cu1, 16, 16, window_size=(-1, 0))
    assert isinstance(got, DTensor) and max_error(got.full_tensor(), want) <= agreement_bound(want)


def test_index_reads_of_the_expression_graph():
    """Direct subscripts shard with their tensor; computed or conflicting subscripts count as
    arithmetic use of the index (the kind that splits it is refused)."""
    import score_mods as sm
    from fused_attn.distributed.sharding import index_uses, tensor_axes

    bias = sm.post_scale_bias(torch.randn(2, 1, 8, 8))
    assert index_uses(bias) == frozenset()
    assert tensor_axes(bias) == {"bias": ("b", "h", "q_idx", "kv_idx")}
    alibi = sm.alibi(torch.randn(4))
    assert index_uses(alibi) == {"q_idx", "kv_idx"} and tensor_axes(alibi) == {"slopes": ("h",)}

    @sm.score_mod
    def rel(score, b, h, q_idx, kv_idx, table=sm.TensorParam()):
        return score + table[h, (q_idx - kv_idx).clamp(-3, 3) + 3]

    assert tensor_axes(rel(table=torch.randn(4, 7))) == {"table": ("h", None)}
    assert index_uses(rel(table=torch.randn(4, 7))) == {"q_idx", "kv_idx"}

    @sm.score_mod
    def mixed(score, b, h, q_idx, kv_idx, t=sm.TensorParam()):
        return score + t[b] - t[0]  # row b and row 0 of one table: no batch shard holds both

    assert "b" in index_uses(mixed(t=torch.randn(4))) and tensor_axes(mixed(t=torch.randn(4))) == {"t": (None,)}
    assert allowed_kinds(_spec_of(mixed(t=torch.randn(4))), 4, 4)["batch"] is not None


def _spec_of(mod):
    from fused_attn.spec import resolve_spec

    return resolve_spec(score_mod=mod, backend="reference")[0]


def test_thd_context_parallelism_on_one_rank_equals_the_unsharded_call(one_rank_group):
    """A one-rank group: packed context parallelism is the plain call (more ranks: the
    multi-process tests here, and on cuDNN the 2-GPU suite)."""
    import fused_attn.distributed as fd

    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    q = torch.randn(16, 2, 8, dtype=torch.float64)
    kw = dict(qkv_format="thd", attn_mask_type="causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=8,
              max_seqlen_kv=8)
    out = fd.context_parallel_attention(q, q, q, backend="reference", **kw)
    want = fused_attn.dot_product_attention(q, q, q, backend="reference", **kw)
    assert_close(out, want, agreement_bound(want), "out")
