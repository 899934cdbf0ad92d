"""Every public entry point on fake tensors (FakeTensorMode, CPU and "cuda" devices) and on meta
tensors, forward and backward: the outputs' shapes, dtypes, devices and grad_fn, and no kernel run,
no tensor value read (the reference math and the cuDNN execute are patched to raise; fake and meta
tensors raise on any value read themselves). The cuDNN execute boundary refuses storage-less tensors."""

from __future__ import annotations

import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fused_attn
from fused_attn import DotProductAttention, doc_packed_attn, dot_product_attention, varlen_attn
from fused_attn.backends import reference, reference_math
from fused_attn.backends.cudnn import runtime
from helpers.fake_cases import B, CASES, D, DV, H, HKV, S, abstract_mode, autograd_on, run_case, tensor


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """Any real attention computation or cuDNN execute fails the test."""
    def boom(*_a, **_k):
        raise AssertionError("a real attention kernel ran on fake / meta tensors")

    monkeypatch.setattr(reference_math, "compute", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "forward", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward_call", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward_with_lse", boom)
    monkeypatch.setattr(runtime, "execute", boom)
    yield


@pytest.mark.parametrize("kind", ["cpu", "cuda", "meta"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_entry_point_on_abstract_tensors(case, kind):
    if case == "varlen_out" and not autograd_on(kind):
        pytest.skip("a torch without CUDA cannot copy_ into a fake cuda tensor")
    run_case(case, kind)


def test_fake_doc_table_is_never_read(monkeypatch):
    """The AutoParallel reproducer: q/k/v and the (B, MAX_DOCS+1) table made under FakeTensorMode
    on "cuda"; a host read of the table would raise (no data), and so would tolist()."""
    def no_read(self, *a, **k):
        raise AssertionError("a document table was read on the host")

    grad = autograd_on("cuda")
    with FakeTensorMode():
        q, k, v = (torch.empty(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3))
        table = torch.tensor([[0, 3, 8], [0, 5, 8]], dtype=torch.int32, device="cuda")
        monkeypatch.setattr(torch.Tensor, "tolist", no_read)
        out = doc_packed_attn(q, k, v, table, is_causal=True)
        if grad:
            out.sum().backward()
            assert q.grad.shape == q.shape
    assert out.shape == (B, S, H, D) and out.device.type == "cuda"


def test_abstract_call_still_validates_metadata():
    with FakeTensorMode():
        q = torch.empty(B, S, H, D)
        k = torch.empty(B, S, 3, D)
        with pytest.raises(ValueError, match="multiple"):
            dot_product_attention(q, k, k)


def _fake_compiled(order):
    lowered = types.SimpleNamespace(_execute_with_raw_ptrs=lambda *a: pytest.fail("cuDNN executed a null pointer"))
    return types.SimpleNamespace(fast=(lowered, order, 0), workspace_size=0, slots=order, uids=None,
                                 graph=types.SimpleNamespace(execute=lambda *a, **k: pytest.fail("executed")))


@pytest.mark.parametrize("kind", ["fake", "meta"])
@pytest.mark.parametrize("fast", [True, False])
def test_execute_refuses_tensors_without_storage(monkeypatch, kind, fast):
    """The execute boundary: a fake or meta tensor bound to a slot raises a clear error before
    any pointer reaches cuDNN (the GPU crash of the issue: a null workspace / data pointer)."""
    monkeypatch.undo()  # the real execute, with its CUDA-only helpers stubbed
    monkeypatch.setattr(runtime, "_thread_state", lambda i: [None, 0, 7])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: 7, raising=False)
    monkeypatch.setattr(runtime, "workspace_for", lambda *a: torch.empty(16, dtype=torch.uint8))
    real = torch.randn(4, 8)
    if kind == "meta":
        bad = torch.empty(4, 8, device="meta")
    else:
        with FakeTensorMode():
            bad = torch.empty(4, 8)
    compiled = _fake_compiled(["q", "o"])
    if not fast:
        compiled.fast = None
    with pytest.raises(RuntimeError, match=f"slot 'o' is bound to a {kind} tensor"):
        runtime.execute(compiled, {"q": real, "o": bad}, 0)


def test_check_storage_accepts_empty_real_tensors():
    runtime.check_storage({"a": torch.empty(0), "b": torch.randn(3)}, ["a", "b"])


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group: the distributed entry points callable in a single process."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["cpu", "meta"])
def test_distributed_entry_points_on_abstract_tensors(one_rank_group, kind):
    """DTensor routing (dot_product_attention, DotProductAttention, doc_packed_attn, varlen_attn)
    and context parallelism (ring and all-gather), forward and backward, on fake / meta tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from fused_attn.distributed import ContextParallelAttention, context_parallel_attention

    mesh = init_device_mesh("cpu", (1,))
    ctx, dev = abstract_mode(kind)
    with ctx:
        q, k, v = tensor(dev, B, S, H, D), tensor(dev, B, S, HKV, D), tensor(dev, B, S, HKV, DV)
        dq, dk, dv = (distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v))
        table = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32, device=dev)
        attn = DotProductAttention(H, (D, DV), num_gqa_groups=HKV, attn_mask_type="causal")
        outs = [fused_attn.dot_product_attention(dq, dk, dv, attn_mask_type="causal"), attn(dq, dk, dv),
                doc_packed_attn(dq, dk, dv, table, is_causal=True, enable_gqa=True)]
        packed = [distribute_tensor(t.detach().reshape(B * S, t.shape[2], t.shape[3]).requires_grad_(), mesh,
                                    [Shard(1)]) for t in (q, q, q)]
        cu = torch.tensor([0, 5, B * S], dtype=torch.int32, device=dev)
        outs.append(varlen_attn(*packed, cu, cu, 11, 11, window_size=(-1, 0)))
        for out in outs:
            assert isinstance(out, DTensor) and out.grad_fn is not None and out.device.type == kind
            out.to_local().sum().backward()
        assert dq.grad.shape == q.shape and packed[0].grad.shape == packed[0].shape
        for comm in ("ring", "all_gather"):
            out = context_parallel_attention(q, k, v, one_rank_group, comm, attn_mask_type="causal")
            assert out.shape == (B, S, H, DV) and out.device.type == kind and out.grad_fn is not None
            out.sum().backward()
        module = ContextParallelAttention(attn, one_rank_group)
        assert module(q, k, v).shape == (B, S, H, DV)
        assert k.grad.shape == k.shape and k.grad.device.type == kind
