"""Built cuDNN graphs to and from a `GraphStore` (the opt-in persistent graph cache).

A stored entry is the frontend's `serialize(as_bytes=True)` blob plus what execute needs and the
blob does not say: the slot names in uid order and the workspace size. Its key is the GraphKey
with the device index set to 0 (ranks of one job on equal GPUs share files); its environment
names everything that invalidates a plan (cuDNN library and frontend versions, torch version,
GPU architecture, this entry format). Measured on H100 (cuDNN 9.19, frontend 1.32): serialized
graphs, score_mod graphs included, deserialize and execute correctly in a fresh process
(benchmarks/results/frontend_probe4_h100.md, section 3).

Payload, little-endian: uint32 H, H bytes of UTF-8 JSON {"slots": [...], "uids": [...],
"workspace": int}, then the frontend's blob.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import threading
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...graph_store import GraphStore, GraphStoreWarning, stable_repr
from ...cache_registry import MemoInfo, register_clear
from .graphs import CompiledGraph, fast_path

__all__ = ["ENTRY_FORMAT", "stored_key", "environment", "encode", "decode", "load_or_build"]

#: Bumped whenever the graph built for a key changes (2: a score_mod's leading scalar factor is
#: folded into the attention scale; 3: packed graphs keep Stats as ragged per-token rows; 4: score
#: callbacks read their input through a copy where quirk score_reused_in_pointwise applies), so
#: stored plans of the old structure are never executed.
ENTRY_FORMAT = "4"
_LEN = struct.Struct("<I")
_env_lock = threading.Lock()
_env_by_device: Dict[int, Dict[str, str]] = {}  # bounded by the number of GPUs


def _forget_envs() -> None:
    with _env_lock:
        _env_by_device.clear()


register_clear("cudnn.persist_env", _forget_envs,
               lambda: MemoInfo("cudnn.persist_env", 0, 0, 0, len(_env_by_device), -1))
_unstorable_warned = threading.Event()


def stored_key(key: Any) -> Any:
    """The key a graph is stored under: the GraphKey on device 0."""
    return dataclasses.replace(key, device_index=0) if key.device_index else key


def environment(device_index: int) -> Dict[str, str]:
    """What must match for a stored graph to be used on `device_index`."""
    with _env_lock:
        env = _env_by_device.get(device_index)
        if env is None:
            import cudnn

            major, minor = torch.cuda.get_device_capability(device_index)
            env = {"cudnn": str(cudnn.backend_version()), "cudnn_frontend": str(cudnn.__version__),
                   "torch": str(torch.__version__), "arch": f"sm{major}{minor}", "entry_format": ENTRY_FORMAT}
            _env_by_device[device_index] = env
        return env


def encode(compiled: CompiledGraph) -> bytes:
    """The stored payload of a built graph."""
    head = json.dumps({"slots": list(compiled.slots), "uids": [int(u) for u in compiled.uids],
                       "workspace": int(compiled.workspace_size)}).encode("utf-8")
    return _LEN.pack(len(head)) + head + bytes(compiled.graph.serialize(as_bytes=True))


def decode(payload: bytes) -> Tuple[Dict[str, Any], bytes]:
    """(header, frontend blob) of a payload; ValueError if it is malformed."""
    if len(payload) < _LEN.size:
        raise ValueError("payload shorter than its length prefix")
    (n,) = _LEN.unpack_from(payload)
    if _LEN.size + n > len(payload):
        raise ValueError("payload header runs past the payload")
    head = json.loads(payload[_LEN.size:_LEN.size + n].decode("utf-8"))
    if not (isinstance(head, dict) and isinstance(head.get("slots"), list) and isinstance(head.get("uids"), list)
            and len(head["slots"]) == len(head["uids"]) and isinstance(head.get("workspace"), int)):
        raise ValueError("payload header lacks slots / uids / workspace")
    return head, payload[_LEN.size + n:]


class _Uid:
    """Stands in for a graph tensor where only its uid is asked for (fast_path)."""

    __slots__ = ("uid",)

    def __init__(self, uid: int) -> None:
        self.uid = uid

    def get_uid(self) -> int:
        return self.uid


def _deserialize(payload: bytes, handle: Any) -> CompiledGraph:
    import cudnn

    head, blob = decode(payload)
    graph = cudnn.pygraph(handle=handle)
    graph.deserialize(handle, blob)
    slots, uids = tuple(head["slots"]), [int(u) for u in head["uids"]]
    fast = fast_path(graph, {s: _Uid(u) for s, u in zip(slots, uids)})
    workspace = max(int(head["workspace"]), int(graph.get_workspace_size()))
    return CompiledGraph(graph, slots, uids, workspace, fast)


def load_or_build(store: GraphStore, key: Any, build: Callable[[], CompiledGraph], handle: Any
                  ) -> Tuple[CompiledGraph, bool]:
    """(graph, loaded): the stored graph for `key` if `store` has a valid one, else `build()`
    (then saved). A stored entry the frontend cannot deserialize is skipped with a warning and
    rebuilt (the rebuild overwrites it). A key without a process-independent text (a user
    `cache_key=` object) is built and not stored (one warning per process)."""
    skey = stored_key(key)
    try:
        stable_repr(skey)
    except TypeError as exc:
        if not _unstorable_warned.is_set():
            _unstorable_warned.set()
            warnings.warn(f"graph_cache: a graph key cannot be stored on disk ({exc}); such graphs are built "
                          "in every process", GraphStoreWarning, stacklevel=4)
        return build(), False
    env = environment(key.device_index)
    payload = store.load(skey, env)
    if payload is not None:
        try:
            return _deserialize(payload, handle), True
        except Exception as exc:  # noqa: BLE001 - any frontend or format failure means "rebuild"
            warnings.warn(f"graph_cache: stored graph {store.path_for(skey).name} could not be loaded "
                          f"({type(exc).__name__}: {str(exc)[:200]}); rebuilding it", GraphStoreWarning, stacklevel=4)
    compiled = build()
    try:
        data = encode(compiled)
    except Exception as exc:  # noqa: BLE001 - a graph the frontend cannot serialize stays in memory only
        warnings.warn(f"graph_cache: a built graph could not be serialized ({type(exc).__name__}: "
                      f"{str(exc)[:200]}); it is not stored", GraphStoreWarning, stacklevel=4)
        return compiled, False
    store.save(skey, env, data)
    return compiled, False
