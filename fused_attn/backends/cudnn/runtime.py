"""Per-thread cuDNN handles, per-stream workspaces and the hot-path execute.

* One cuDNN handle per (device, thread) (`threading.local`): handles are not thread-safe.
* The stream is read with `torch._C._cuda_getCurrentRawStream` (a fraction of a microsecond,
  against several for `torch.cuda.current_stream()`) and set on the handle before every execute
  (`cudnn.set_stream` is cheap when the stream is unchanged).
* Scratch: likewise one grow-only buffer per (device, stream) for outputs a graph writes and no
  one reads (the forward's Stats when neither a backward nor the lse will use it).
* Workspace: one grow-only uint8 buffer per (device, stream). Work on one stream is ordered, so
  reusing the buffer is safe; a buffer replaced when growing goes back to torch's caching
  allocator, which keeps it until the stream's queued work is done. A per-call allocation
  would cost a few microseconds of host time on every call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, Tuple

import torch

from ...cache_registry import MemoInfo, register_at_exit, register_clear, tensor_bytes
from .graphs import CompiledGraph

__all__ = ["handle_for", "workspace_for", "scratch_for", "execute", "current_stream", "release_all",
           "release_workspaces", "SCRATCH_MAX_BYTES"]

_local = threading.local()
_ws_lock = threading.Lock()
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
_scratch: Dict[Tuple[int, int], torch.Tensor] = {}
#: the largest discarded output served from the scratch buffer (larger ones are allocated: their
#: kernels dwarf an allocation, and the buffer is held as long as its stream is used)
SCRATCH_MAX_BYTES = 16 << 20


def handle_for(device_index: int) -> Any:
    """This thread's cuDNN handle on `device_index` (created on first use)."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    handle = handles.get(device_index)
    if handle is None:
        import cudnn

        with torch.cuda.device(device_index):
            handle = cudnn.create_handle()
        handles[device_index] = handle
    return handle


def release_all() -> None:
    """Drop the calling thread's handles and every workspace (used at interpreter exit; other
    threads' handles go with their thread-local storage)."""
    handles = getattr(_local, "handles", None)
    if handles is not None:
        handles.clear()
        del _local.handles
    for name in ("states", "arrays"):
        if getattr(_local, name, None) is not None:
            delattr(_local, name)
    with _ws_lock:
        _workspaces.clear()
        _scratch.clear()


def current_stream(device_index: int) -> int:
    """The raw current CUDA stream of `device_index` (cheap)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _grow_only(store: Dict[Tuple[int, int], torch.Tensor], key: Tuple[int, int], numel: int,
               dtype: torch.dtype) -> torch.Tensor:
    """store[key], replaced by a larger `dtype` buffer when it holds fewer than `numel` elements."""
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        with _ws_lock:
            buf = store.get(key)
            if buf is None or buf.numel() < numel:
                buf = torch.empty(max(numel, 1), dtype=dtype, device=torch.device("cuda", key[0]))
                store[key] = buf
    return buf


def workspace_for(device_index: int, stream: int, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of at least `nbytes` (>= 1) reused per (device, stream)."""
    return _grow_only(_workspaces, (device_index, stream), nbytes, torch.uint8)


def scratch_for(device_index: int, numel: int) -> torch.Tensor:
    """An fp32 buffer of at least `numel` elements (numel * 4 <= SCRATCH_MAX_BYTES) on the current
    stream of `device_index`, reused per (device, stream), for graph outputs nothing reads."""
    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    return _grow_only(_scratch, key, numel, torch.float32)


def release_workspaces() -> None:
    """Drop every cached workspace and scratch buffer (`fused_attn.graph_cache.clear()` does)."""
    with _ws_lock:
        _workspaces.clear()
        _scratch.clear()


def _workspace_info() -> MemoInfo:
    with _ws_lock:
        bufs = list(_workspaces.values()) + list(_scratch.values())
    return MemoInfo("cudnn.workspaces", 0, 0, 0, len(bufs), -1, sum(tensor_bytes(b) for b in bufs))


# one workspace and one scratch buffer per (device, stream), each as large as the largest use
register_clear("cudnn.workspaces", release_workspaces, _workspace_info)
register_at_exit("cudnn.runtime", release_all)


def _thread_state(device_index: int) -> list:
    """[handle, backend handle int, stream last set on it] of this thread on `device_index`."""
    states = getattr(_local, "states", None)
    if states is None:
        states = _local.states = {}
    state = states.get(device_index)
    if state is None:
        handle = handle_for(device_index)
        state = states[device_index] = [handle, getattr(handle, "backend_handle", None), None]
    return state


def _pointer_array(n: int) -> Any:
    """This thread's reusable ctypes int64[n] (the raw execute copies the pointers it reads)."""
    arrays = getattr(_local, "arrays", None)
    if arrays is None:
        arrays = _local.arrays = {}
    arr = arrays.get(n)
    if arr is None:
        arr = arrays[n] = (ctypes.c_int64 * n)()
    return arr


def execute(compiled: CompiledGraph, bind: Dict[str, Any], device_index: int) -> None:
    """Run `compiled` on the current stream of `device_index` with buffers `bind` (slot name ->
    tensor). The lowered graph's raw-pointer execute when the build offered it (the same plan,
    without the frontend's per-call Python checks: the call plan already guarantees shapes and
    strides), else the frontend's public ordered execute."""
    state = _thread_state(device_index)
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    if state[2] != stream:
        import cudnn

        cudnn.set_stream(state[0], stream)
        state[2] = stream
    ws = _workspaces.get((device_index, stream))
    if ws is None or ws.numel() < compiled.workspace_size:
        ws = workspace_for(device_index, stream, compiled.workspace_size)
    fast = compiled.fast
    if fast is not None:
        lowered, order, index = fast
        arr = _pointer_array(len(order))
        ptrs = [bind[s].data_ptr() for s in order]
        if 0 in ptrs:  # fake / meta tensors report null: never hand cuDNN a bogus pointer
            check_storage(bind, order)
        arr[:] = ptrs
        lowered._execute_with_raw_ptrs(ctypes.addressof(arr), len(order), ws.data_ptr(), state[1], index)
        return
    check_storage(bind, compiled.slots)
    compiled.graph.execute([bind[s] for s in compiled.slots], ws, handle=state[0], tensor_uids=compiled.uids)


def check_storage(bind: Dict[str, Any], slots: Any) -> None:
    """Raise RuntimeError if a slot is bound to a tensor without real storage (a fake or meta
    tensor, or a non-empty tensor whose data pointer is null): cuDNN would read or write there."""
    from ...tensor_kind import is_abstract

    for slot in slots:
        t = bind[slot]
        if not isinstance(t, torch.Tensor):
            continue
        bad = "meta" if t.is_meta else None
        if bad is None and type(t) is not torch.Tensor and is_abstract(t):
            bad = "fake"
        if bad is None and t.numel() and t.data_ptr() == 0:
            bad = "storage-less (null data pointer)"
        if bad is not None:
            raise RuntimeError(
                f"cuDNN execute: slot {slot!r} is bound to a {bad} tensor of shape {tuple(t.shape)} on {t.device}; "
                "fake and meta tensors have no memory for a kernel. Trace with them through fused_attn's entry "
                "points (which route them to the custom ops' fake implementations), not a call plan's runner")
