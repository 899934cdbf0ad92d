"""The persistent graph cache wired into the cuDNN backend, on CPU with a stub frontend.

`graph_cache.set_persistent_dir` makes a miss look in the directory first. Here building and
(de)serializing are stubbed (a fake graph whose blob is its key text); the store and the
backend's wiring, the counters, the payload format and every skip path run for real. The GPU
half (a fresh process loading real graphs) is test_plan_gpu.py::test_persistent_cache_*.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fused_attn
from fused_attn.backends.cudnn import common, persist, runtime
from fused_attn.backends.cudnn.graphs import CompiledGraph
from fused_attn.cache import GRAPH_CACHE, GraphKey
from fused_attn.graph_store import GraphStoreWarning

ENV = {"cudnn": "91900", "cudnn_frontend": "1.32.0", "torch": "2.13.0", "arch": "sm90", "entry_format": persist.ENTRY_FORMAT}


class FakeGraph:
    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def serialize(self, as_bytes: bool = False) -> bytes:
        assert as_bytes
        return self.blob


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def key(device_index: int = 0, seq: int = 128, score_mod=None) -> GraphKey:
    return GraphKey(direction="fwd", dtype="bfloat16", q_dims=(1, 2, seq, 64), k_dims=(1, 2, seq, 64),
                    v_dims=(1, 2, seq, 64), q_strides=(seq * 128, 64, 128, 1), k_strides=(seq * 128, 64, 128, 1),
                    v_strides=(seq * 128, 64, 128, 1), o_strides=(seq * 128, 64, 128, 1), scale=None,
                    device_index=device_index, backend_version=91900, score_mod=score_mod)


@pytest.fixture
def frontend(monkeypatch, tmp_path):
    """Stub build / deserialize; records what was built and loaded."""
    built, loaded = [], []

    def fake_build(k, mod, templates, handle):
        built.append(k)
        return CompiledGraph(FakeGraph(repr(k.q_dims).encode()), ("q", "k", "v", "o", "stats"), [1, 2, 3, 4, 5],
                             1024, None)

    def fake_deserialize(payload, handle):
        head, blob = persist.decode(payload)
        loaded.append(blob)
        return CompiledGraph(FakeGraph(blob), tuple(head["slots"]), head["uids"], head["workspace"], None)

    monkeypatch.setattr(common, "build", fake_build)
    monkeypatch.setattr(persist, "_deserialize", fake_deserialize)
    monkeypatch.setattr(persist, "environment", lambda index: dict(ENV))
    monkeypatch.setattr(runtime, "handle_for", lambda index: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _Null())
    GRAPH_CACHE.clear()
    fused_attn.graph_cache.set_persistent_dir(tmp_path)
    yield built, loaded, tmp_path
    fused_attn.graph_cache.set_persistent_dir(None)
    GRAPH_CACHE.clear()


def get(k: GraphKey) -> CompiledGraph:
    return common.Graphs(k, None, None, {}, k.device_index).get("fwd")


def restart() -> None:
    """What a new process sees: an empty in-memory cache, the same directory."""
    GRAPH_CACHE.clear()


@pytest.mark.slow
def test_second_process_loads_instead_of_building(frontend):
    built, loaded, directory = frontend
    first = get(key())
    assert len(built) == 1 and GRAPH_CACHE.info().builds == 1 and GRAPH_CACHE.info().loads == 0
    assert fused_attn.graph_cache.persistent_info().saves == 1
    assert len(list(directory.glob("*.graph"))) == 1
    restart()
    again = get(key())
    info = GRAPH_CACHE.info()
    assert len(built) == 1 and info.builds == 0 and info.loads == 1
    assert again.graph.blob == first.graph.blob and again.slots == first.slots and again.uids == first.uids
    assert again.workspace_size == first.workspace_size
    get(key())
    assert GRAPH_CACHE.info().hits == 1  # in memory after the load


@pytest.mark.slow
def test_other_keys_are_built_and_stored_separately(frontend):
    built, loaded, directory = frontend
    get(key(seq=128))
    get(key(seq=256))
    assert len(built) == 2 and len(list(directory.glob("*.graph"))) == 2
    restart()
    assert get(key(seq=256)).graph.blob == repr((1, 2, 256, 64)).encode()


@pytest.mark.slow
def test_ranks_on_other_devices_share_the_stored_graph(frontend):
    built, loaded, directory = frontend
    get(key(device_index=0))
    restart()
    get(key(device_index=1))
    assert len(built) == 1 and len(loaded) == 1
    assert persist.stored_key(key(device_index=3)) == key(device_index=0)


@pytest.mark.slow
def test_corrupt_file_warns_and_is_rebuilt_and_rewritten(frontend):
    built, loaded, directory = frontend
    get(key())
    (path,) = directory.glob("*.graph")
    path.write_bytes(path.read_bytes()[:-5])  # truncated
    restart()
    with pytest.warns(GraphStoreWarning):
        get(key())
    assert len(built) == 2 and not loaded
    restart()
    get(key())
    assert len(built) == 2 and len(loaded) == 1  # the rebuild overwrote the bad file


@pytest.mark.slow
def test_other_environment_is_skipped_and_rebuilt(frontend, monkeypatch):
    built, loaded, directory = frontend
    get(key())
    restart()
    monkeypatch.setattr(persist, "environment", lambda index: dict(ENV, cudnn="92100"))
    with pytest.warns(GraphStoreWarning, match="cudnn"):
        get(key())
    assert len(built) == 2 and not loaded


@pytest.mark.slow
def test_a_payload_the_frontend_rejects_is_rebuilt(frontend, monkeypatch):
    built, loaded, directory = frontend
    get(key())
    restart()

    def broken(payload, handle):
        raise RuntimeError("deserialize failed")

    monkeypatch.setattr(persist, "_deserialize", broken)
    with pytest.warns(GraphStoreWarning, match="could not be loaded"):
        graph = get(key())
    assert len(built) == 2 and graph.graph.blob == repr((1, 2, 128, 64)).encode()


@pytest.mark.slow
def test_unstorable_key_is_built_and_not_stored(frontend, monkeypatch):
    built, loaded, directory = frontend
    monkeypatch.setattr(persist, "_unstorable_warned", type(persist._unstorable_warned)())

    class UserKey:  # a user cache_key= object: no process-independent text
        def __hash__(self):
            return 1

    with pytest.warns(GraphStoreWarning, match="cannot be stored"):
        get(key(score_mod=("user", UserKey())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get(key(seq=256, score_mod=("user", UserKey())))  # warned once per process
    assert len(built) == 2 and not list(directory.glob("*.graph"))


def test_payload_round_trip_and_malformed_payloads():
    compiled = CompiledGraph(FakeGraph(b"\x00blob"), ("q", "o"), [7, 9], 4096, None)
    head, blob = persist.decode(persist.encode(compiled))
    assert head == {"slots": ["q", "o"], "uids": [7, 9], "workspace": 4096} and blob == b"\x00blob"
    for bad in (b"", b"\x05\x00\x00\x00{}", b"\x02\x00\x00\x00{}", b"\x0b\x00\x00\x00{\"slots\":1}"):
        with pytest.raises(ValueError):
            persist.decode(bad)


def test_set_persistent_dir_arguments(tmp_path):
    with pytest.raises(TypeError, match="directory must be a str, os.PathLike or None, got int"):
        fused_attn.graph_cache.set_persistent_dir(3)
    with pytest.raises(ValueError, match="max_bytes"):
        fused_attn.graph_cache.set_persistent_dir(None, max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes must be None or an int >= 1, got 0"):
        fused_attn.graph_cache.set_persistent_dir(tmp_path, max_bytes=0)
    fused_attn.graph_cache.set_persistent_dir(tmp_path, max_bytes=1 << 20)
    try:
        assert GRAPH_CACHE.store.max_bytes == 1 << 20 and fused_attn.graph_cache.persistent_info().saves == 0
    finally:
        fused_attn.graph_cache.set_persistent_dir(None)
    assert fused_attn.graph_cache.persistent_info() is None


@pytest.mark.slow
def test_keys_differ_per_field_in_the_stored_text(frontend):
    """Every structural field reaches the file name: two keys differing in one field never share a file."""
    base = key()
    store = GRAPH_CACHE.store
    paths = {store.path_for(persist.stored_key(base))}
    for change in (dict(direction="bwd"), dict(dtype="float16"), dict(scale=0.125), dict(band=(None, 0, False)),
                   dict(padding=True), dict(ragged=True), dict(score_mod=("softcap",)), dict(deterministic=True),
                   dict(backend_version=92100), dict(sinks=True), dict(dropout=0.1),
                   dict(q_strides=(128 * 128, 64 * 2, 64, 1))):
        paths.add(store.path_for(persist.stored_key(dataclasses.replace(base, **change))))
    assert len(paths) == 13
