"""Every public entry point on fake tensors (FakeTensorMode, CPU and "cuda" devices) and on meta
tensors, forward and backward: the outputs' shapes, dtypes, devices and grad_fn, and no kernel run,
no tensor value read (the reference math and the cuDNN execute are patched to raise; fake and meta
tensors raise on any value read themselves). The cuDNN execute boundary refuses storage-less tensors."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fused_attn
import score_mods as sm
from fused_attn import DotProductAttention, doc_packed_attn, dot_product_attention, varlen_attn, varlen_attn_out
from fused_attn.functional import attention_backward, attention_forward
from fused_attn.integrations import transformers as fa_hf
from fused_attn.backends import reference
from fused_attn.backends.cudnn import runtime

B, S, H, HKV, D, DV = 2, 8, 4, 2, 16, 8
CU_ROWS = [0, 3, 8]  # dense padding lengths 3 and 5; packed: two sequences of 3 and 5 tokens


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """Any real attention computation or cuDNN execute fails the test."""
    def boom(*_a, **_k):
        raise AssertionError("a real attention kernel ran on fake / meta tensors")

    monkeypatch.setattr(reference, "_compute", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "forward", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward_call", boom)
    monkeypatch.setattr(reference.ReferenceRunner, "backward_with_lse", boom)
    monkeypatch.setattr(runtime, "execute", boom)
    yield


def _mode(kind):
    """(context, device): FakeTensorMode for fake CPU / fake "cuda" tensors, nothing for meta."""
    if kind == "meta":
        return contextlib.nullcontext(), "meta"
    return FakeTensorMode(allow_non_fake_inputs=False), kind


def _autograd_on(dev) -> bool:
    """A torch without CUDA aborts the process on autograd with (fake) "cuda" tensors: forward only there."""
    return dev != "cuda" or torch.cuda.is_available()


def _t(dev, *shape, dtype=torch.float16, grad=True):
    return torch.empty(*shape, dtype=dtype, device=dev, requires_grad=grad and _autograd_on(dev))


def _cu(dev, rows=CU_ROWS):
    return torch.tensor(rows, dtype=torch.int32, device=dev)


class _HFModule(torch.nn.Module):
    is_causal = True


# Each case: dev -> (output, inputs that must receive gradients). Built inside the mode.
def _dense(dev):
    q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
    return dot_product_attention(q, k, v, attn_mask_type="causal", score_mod=sm.softcap(20.0)), (q, k, v)


def _dense_lse(dev):
    q, k, v = _t(dev, B, H, S, D), _t(dev, B, H, S, D), _t(dev, B, H, S, DV)
    out, lse = dot_product_attention(q, k, v, qkv_format="bhsd", return_lse=True)
    assert lse.shape == (B, H, S) and lse.dtype == torch.float32 and lse.device == q.device
    return out, (q, k, v)


def _padding(dev):
    q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
    cu = _cu(dev)  # (B+1,): lengths 3 and 5
    return dot_product_attention(q, k, v, attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu), (q, k, v)


def _thd_no_max(dev):
    q, k, v = _t(dev, S, H, D), _t(dev, S, HKV, D), _t(dev, S, HKV, DV)
    cu = _cu(dev)
    return dot_product_attention(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), (q, k, v)


def _sinks(dev):
    q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
    sinks = _t(dev, H, dtype=torch.float32)
    out = dot_product_attention(q, k, v, softmax_type="learnable", sinks=sinks, attn_mask_type="causal")
    return out, (q, k, v, sinks)


def _module(dev):
    with torch.device(dev):
        attn = DotProductAttention(H, (D, DV), num_gqa_groups=HKV, attn_mask_type="causal", softmax_type="learnable")
    attn.requires_grad_(_autograd_on(dev))
    q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
    return attn(q, k, v), (q, k, v, attn.sinks)


def _varlen(dev):
    q, k, v = _t(dev, S, H, D), _t(dev, S, HKV, D), _t(dev, S, HKV, DV)
    cu = _cu(dev)
    return varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0), enable_gqa=True), (q, k, v)


def _varlen_out(dev):
    q, k, v = (_t(dev, S, H, D, grad=False) for _ in range(3))
    out = _t(dev, S, H, D, grad=False)
    cu = _cu(dev)
    got, lse = varlen_attn_out(out, q, k, v, cu, cu, 5, 5, return_aux=fused_attn.AuxRequest(lse=True))
    assert got is out and lse.shape == (H, S)
    return got, ()


def _doc_packed(dev):
    q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
    table = torch.tensor([[0, 3, 8], [0, 8, 8]], dtype=torch.int32, device=dev)
    return doc_packed_attn(q, k, v, table, is_causal=True, enable_gqa=True), (q, k, v)


def _transformers(dev):
    q, k, v = _t(dev, B, H, S, D), _t(dev, B, HKV, S, D), _t(dev, B, HKV, S, DV)
    mask = torch.ones(B, S, dtype=torch.bool, device=dev)
    out, weights = fa_hf.attention_forward(_HFModule(), q, k, v, mask, scaling=0.25)
    assert weights is None
    return out, (q, k, v)


def _forward_backward_pieces(dev):
    q, k, v = _t(dev, B, S, H, D, grad=False), _t(dev, B, S, HKV, D, grad=False), _t(dev, B, S, HKV, DV, grad=False)
    out, lse = attention_forward(q, k, v, attn_mask_type="causal")
    assert out.shape == (B, S, H, DV) and lse.shape == (B, H, S) and lse.dtype == torch.float32
    grads = attention_backward(q, k, v, out, lse, torch.empty_like(out), attn_mask_type="causal")
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype and g.device == t.device
    return out, ()


CASES = {f.__name__[1:]: f for f in (_dense, _dense_lse, _padding, _thd_no_max, _sinks, _module, _varlen, _varlen_out,
                                     _doc_packed, _transformers, _forward_backward_pieces)}
EXPECTED = {"dense": (B, S, H, DV), "dense_lse": (B, H, S, DV), "padding": (B, S, H, DV), "thd_no_max": (S, H, DV),
            "sinks": (B, S, H, DV), "module": (B, S, H, DV), "varlen": (S, H, DV), "varlen_out": (S, H, D),
            "doc_packed": (B, S, H, DV), "transformers": (B, S, H, DV), "forward_backward_pieces": (B, S, H, DV)}


def run_case(case, kind):
    """Run CASES[case] on `kind` ("cpu" / "cuda": fake tensors, "meta") and check what it returns
    (forward and, where autograd can run, backward)."""
    ctx, dev = _mode(kind)
    with ctx:
        out, leaves = CASES[case](dev)
        assert tuple(out.shape) == EXPECTED[case]
        assert out.dtype == torch.float16 and out.device.type == kind
        if kind != "meta":
            from torch._subclasses.fake_tensor import is_fake

            assert is_fake(out)
        if leaves and _autograd_on(dev):
            assert out.grad_fn is not None
            out.backward(torch.empty_like(out))
            for t in leaves:
                assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype
                assert t.grad.device == t.device


@pytest.mark.parametrize("kind", ["cpu", "cuda", "meta"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_entry_point_on_abstract_tensors(case, kind):
    if case == "varlen_out" and not _autograd_on(kind):
        pytest.skip("a torch without CUDA cannot copy_ into a fake cuda tensor")
    run_case(case, kind)


def test_fake_doc_table_is_never_read(monkeypatch):
    """The AutoParallel reproducer: q/k/v and the (B, MAX_DOCS+1) table made under FakeTensorMode
    on "cuda"; a host read of the table would raise (no data), and so would tolist()."""
    def no_read(self, *a, **k):
        raise AssertionError("a document table was read on the host")

    grad = _autograd_on("cuda")
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
    ctx, dev = _mode(kind)
    with ctx:
        q, k, v = _t(dev, B, S, H, D), _t(dev, B, S, HKV, D), _t(dev, B, S, HKV, DV)
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
