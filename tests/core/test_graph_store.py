"""GraphStore and stable_repr on CPU: round trip, stable keys, bad files, concurrency, bounds."""

import dataclasses
import enum
import errno
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from fused_attn import graph_store as gs
from fused_attn.graph_store import GraphStore, GraphStoreWarning, StoreInfo, key_digest, stable_repr
from helpers import store_worker as sw

ENV = sw.ENV
KEY = ("fwd", "bfloat16", (2, 4, 128, 64), 0.125)


@pytest.fixture
def store(tmp_path):
    return GraphStore(tmp_path / "graphs")


def store_warnings(fn, *args):
    """(result of fn(*args), [GraphStoreWarning messages])."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    assert all(issubclass(w.category, GraphStoreWarning) for w in caught), [str(w.message) for w in caught]
    return result, [str(w.message) for w in caught]


# stable_repr ------------------------------------------------------------------------------

class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int
    b: float


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner
    cached: int = dataclasses.field(default=0, compare=False)


@dataclasses.dataclass
class Mutable:
    a: int


def test_stable_repr_format_is_pinned():
    text = stable_repr((None, True, 3, 0.5, "a\"b", (), (1,), Color.RED))
    assert text == ('(None,True,int:3,float:0x1.0000000000000p-1,str:"a\\"b",(),(int:1),'
                    f"enum:{__name__}.Color.RED)")


@pytest.mark.parametrize("a, b", [
    (0.0, -0.0), (1, 1.0), (1, True), (0, False), (1, "1"), ((1,), 1), ((1, 2), ((1,), 2)), (None, "None"),
    (Color.RED, 1), (float("inf"), float("-inf")), (1.0, 1.0 + 2 ** -52), ("", ()),
])
def test_stable_repr_distinguishes(a, b):
    assert stable_repr(a) != stable_repr(b)
    assert key_digest(a) != key_digest(b)


def test_stable_repr_agrees_where_it_should():
    assert stable_repr(float("nan")) == stable_repr(-float("nan")) == "float:nan"
    assert stable_repr(Outer("x", Inner(1, 0.0))) == stable_repr(Outer("x", Inner(1, 0.0), cached=99))
    assert stable_repr(Outer("x", Inner(1, 0.0))) != stable_repr(Outer("x", Inner(1, -0.0)))
    assert stable_repr(Outer("x", Inner(1, 0.0))) != stable_repr(Outer("x", Inner(2, 0.0)))
    assert "cached" not in stable_repr(Outer("x", Inner(1, 0.0)))


def test_graph_key_text_leaves_out_the_per_process_hash():
    key = sw.sample_key()
    text = stable_repr(key)
    assert text.startswith("dc:fused_attn.cache.GraphKey(direction=str:\"bwd\",")
    assert "_hash" not in text
    assert stable_repr(dataclasses.replace(key)) == text
    assert stable_repr(dataclasses.replace(key, scale=0.25)) != text


@pytest.mark.slow  # a fresh interpreter
def test_key_text_stable_across_processes():
    expected = f"{stable_repr(sw.sample_key())}\n{key_digest(sw.sample_key())}"
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r}); "
            "from helpers import store_worker; store_worker.print_sample_digest()")
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=sw.ROOT,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == expected


@pytest.mark.parametrize("bad, where", [
    ([1, 2], "key"), ((1, {"a": 1}), r"key\[1\]"), ((1, (2, {3})), r"key\[1\]\[1\]"), (object(), "key"),
    (b"bytes", "key"), (Mutable(1), "key"), (Inner, "key"), (Outer("x", Inner(1, [0.0])), r"key.inner.b"),
    (1 + 2j, "key"),
])
def test_stable_repr_refuses(bad, where):
    with pytest.raises(TypeError, match=f"stable_repr: {where} "):
        stable_repr(bad)


def test_load_and_save_refuse_unstable_keys(store):
    with pytest.raises(TypeError, match="stable_repr"):
        store.save((object(),), ENV, b"x")
    with pytest.raises(TypeError, match="stable_repr"):
        store.load([1], ENV)


# round trip and arguments -----------------------------------------------------------------

def test_round_trip_across_instances(tmp_path):
    a = GraphStore(tmp_path / "new" / "dir")  # created, parents too
    assert a.load(KEY, ENV) is None
    payload = bytes(range(256)) * 10
    a.save(KEY, ENV, payload)
    b = GraphStore(tmp_path / "new" / "dir")
    assert b.load(KEY, ENV) == payload
    assert a.stats() == StoreInfo(loads=0, load_misses=1, saves=1, skipped_corrupt=0, skipped_mismatch=0,
                                  save_failures=0, evictions=0)
    assert b.stats().loads == 1
    assert a.path_for(KEY).name == key_digest(KEY) + ".graph"
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == [a.path_for(KEY).name]


def test_empty_payload_bytearray_and_memoryview(store):
    store.save(("k", 1), ENV, b"")
    assert store.load(("k", 1), ENV) == b""
    store.save(("k", 2), ENV, bytearray(b"ab"))
    store.save(("k", 3), ENV, memoryview(b"cd"))
    assert store.load(("k", 2), ENV) == b"ab" and store.load(("k", 3), ENV) == b"cd"


def test_save_overwrites(store):
    store.save(KEY, ENV, b"one")
    store.save(KEY, ENV, b"two")
    assert store.load(KEY, ENV) == b"two"


def test_graph_key_round_trip(store):
    key = sw.sample_key()
    store.save(key, ENV, b"graph")
    assert store.load(dataclasses.replace(key), ENV) == b"graph"
    assert store.load(dataclasses.replace(key, direction="fwd"), ENV) is None


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(directory=3), TypeError, "directory must be a str or os.PathLike, got int"),
    (dict(max_bytes=0), ValueError, "max_bytes must be None or an int >= 1, got 0"),
    (dict(max_bytes=1.5), ValueError, "max_bytes must be None or an int >= 1, got 1.5"),
    (dict(max_bytes=True), ValueError, "max_bytes must be None or an int >= 1, got True"),
])
def test_bad_arguments(tmp_path, kwargs, exc, match):
    kwargs.setdefault("directory", tmp_path)
    with pytest.raises(exc, match=match):
        GraphStore(**kwargs)


def test_bad_env_and_payload(store):
    with pytest.raises(TypeError, match="env must map str to str, got 'arch': 90"):
        store.load(KEY, {"arch": 90})
    with pytest.raises(TypeError, match="env must be a mapping"):
        store.save(KEY, [("arch", "sm90")], b"x")
    with pytest.raises(TypeError, match=r"payload must be bytes, got list .*as_bytes=True"):
        store.save(KEY, ENV, [1, 2, 3])


# bad files ----------------------------------------------------------------------------------

def _forge_other_key(path: Path, blob: bytes) -> bytes:
    return gs._encode(stable_repr(("another", "key")), dict(sorted(ENV.items())), b"payload")


def _flip_payload_byte(path, blob):
    return blob[:-1] + bytes([blob[-1] ^ 0xFF])


def _bad_header_json(path, blob):
    header_len = int.from_bytes(blob[12:16], "little")
    return blob[:16] + b"{" * header_len + blob[16 + header_len:]


CORRUPTIONS = {
    "empty": (lambda p, b: b"", "corrupt", "truncated: 0 bytes"),
    "bad magic": (lambda p, b: b"NOTGRAPH" + b[8:], "corrupt", "bad magic"),
    "truncated header": (lambda p, b: b[:40], "corrupt", "truncated header"),
    "garbage header": (_bad_header_json, "corrupt", "unreadable header"),
    "truncated payload": (lambda p, b: b[:-7], "corrupt", "payload is .* bytes, header says"),
    "padded payload": (lambda p, b: b + b"\0", "corrupt", "payload is .* bytes, header says"),
    "bad checksum": (_flip_payload_byte, "corrupt", "payload checksum mismatch"),
    "newer format": (lambda p, b: b[:8] + (gs.FORMAT_VERSION + 1).to_bytes(4, "little") + b[12:], "mismatch",
                     "format version"),
    "digest collision": (_forge_other_key, "mismatch", "holds another key"),
    "env mismatch": (lambda p, b: gs._encode(stable_repr(KEY), dict(sorted({**ENV, "arch": "sm80"}.items())),
                                             b"payload"), "mismatch", "environment differs: arch stored 'sm80', now 'sm90'"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_bad_file_warns_once_returns_none_and_save_fixes_it(store, case):
    damage, kind, why = CORRUPTIONS[case]
    payload = b"the real graph" * 100
    store.save(KEY, ENV, payload)
    path = store.path_for(KEY)
    path.write_bytes(damage(path, path.read_bytes()))
    got, messages = store_warnings(store.load, KEY, ENV)
    assert got is None
    assert len(messages) == 1
    assert str(path) in messages[0] and re.search(why, messages[0]), messages[0]
    got, messages = store_warnings(store.load, KEY, ENV)  # the same file again: counted, not re-warned
    assert got is None and messages == []
    counts = store.stats()
    assert (counts.skipped_corrupt, counts.skipped_mismatch) == ((2, 0) if kind == "corrupt" else (0, 2))
    store.save(KEY, ENV, payload)
    got, messages = store_warnings(store.load, KEY, ENV)
    assert got == payload and messages == []


def test_env_mismatch_in_either_direction(store):
    store.save(KEY, ENV, b"x")
    extra = {**ENV, "driver": "580"}
    got, messages = store_warnings(store.load, KEY, extra)
    assert got is None and "driver stored '<absent>', now '580'" in messages[0]
    assert store.load(KEY, dict(reversed(list(ENV.items())))) == b"x"  # order does not matter


def test_unreadable_path_is_skipped(store):
    store.path_for(KEY).mkdir()  # a directory where the file should be
    got, messages = store_warnings(store.load, KEY, ENV)
    assert got is None and len(messages) == 1 and "unreadable" in messages[0]


# unwritable directories ---------------------------------------------------------------------

def test_read_only_directory_warns_once(tmp_path):
    d = tmp_path / "ro"
    store = GraphStore(d)
    store.save(KEY, ENV, b"kept")
    d.chmod(0o555)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("the directory stays writable (running as root?)")
        _, messages = store_warnings(store.save, ("other",), ENV, b"x")
        assert len(messages) == 1 and "cannot write" in messages[0]
        _, messages = store_warnings(store.save, ("third",), ENV, b"x")
        assert messages == []
        assert store.load(KEY, ENV) == b"kept"  # reads still work
        assert store.stats().save_failures == 2
    finally:
        d.chmod(0o755)


def test_full_disk_warns_once_and_leaves_no_temp_file(store, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gs.os, "fsync", no_space)
    _, messages = store_warnings(store.save, KEY, ENV, b"x" * 1000)
    assert len(messages) == 1 and "No space left on device" in messages[0]
    _, messages = store_warnings(store.save, ("other",), ENV, b"y")
    assert messages == []
    assert os.listdir(store.directory) == []
    assert store.stats().save_failures == 2 and store.stats().saves == 0
    monkeypatch.undo()
    store.save(KEY, ENV, b"x")
    assert store.load(KEY, ENV) == b"x"


def test_directory_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    store, messages = store_warnings(GraphStore, blocker / "graphs")
    assert len(messages) == 1 and "cannot create" in messages[0]
    got, messages = store_warnings(store.load, KEY, ENV)
    assert got is None and messages == [] and store.stats().load_misses == 1
    _, messages = store_warnings(store.save, KEY, ENV, b"x")
    assert len(messages) == 1


# bounds and clear ---------------------------------------------------------------------------

def _file_size(payload_len: int, key) -> int:
    return len(gs._encode(stable_repr(key), dict(sorted(ENV.items())), b"\0" * payload_len))


def test_max_bytes_evicts_least_recently_used(tmp_path):
    keys = [("k", i) for i in range(4)]
    size = _file_size(1000, keys[0])
    store = GraphStore(tmp_path, max_bytes=3 * size + 10)
    for i, key in enumerate(keys[:3]):
        store.save(key, ENV, b"a" * 1000)
        ns = 1_000_000_000 * (i + 1)
        os.utime(store.path_for(key), ns=(ns, ns))  # k0 oldest .. k2 newest, whatever the clock resolution
    assert store.load(keys[0], ENV) is not None  # touches k0: now the most recent
    store.save(keys[3], ENV, b"a" * 1000)  # over the bound: evicts k1
    assert [store.path_for(k).exists() for k in keys] == [True, False, True, True]
    assert store.stats().evictions == 1
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= store.max_bytes


def test_max_bytes_removes_abandoned_temp_files(tmp_path):
    store = GraphStore(tmp_path, max_bytes=10_000)
    digest = key_digest(KEY)
    old, new = tmp_path / f".{digest}.1.2.aaaa.tmp", tmp_path / f".{digest}.1.2.bbbb.tmp"
    old.write_bytes(b"abandoned")
    new.write_bytes(b"being written")
    os.utime(old, (1_000_000, 1_000_000))
    store.save(KEY, ENV, b"x")
    assert not old.exists() and new.exists()


def test_max_bytes_refuses_a_file_larger_than_the_bound(tmp_path):
    store = GraphStore(tmp_path, max_bytes=500)
    store.save(("small",), ENV, b"s")
    _, messages = store_warnings(store.save, KEY, ENV, b"x" * 1000)
    assert len(messages) == 1 and "exceeds max_bytes=500" in messages[0]
    assert not store.path_for(KEY).exists() and store.path_for(("small",)).exists()
    assert store.stats().save_failures == 1


def test_clear_removes_only_store_files(store):
    store.save(KEY, ENV, b"x")
    store.load(KEY, ENV)
    stray = store.directory / f".{key_digest(KEY)}.123.456.abcd.tmp"
    stray.write_bytes(b"partial")
    (store.directory / "notes.txt").write_text("keep me")
    store.clear()
    assert os.listdir(store.directory) == ["notes.txt"]
    assert store.stats() == StoreInfo(0, 0, 0, 0, 0, 0, 0)


# concurrency --------------------------------------------------------------------------------

@pytest.mark.slow  # four spawned processes: ~10 s
def test_processes_share_a_directory(tmp_path):
    """4 spawned processes save and load shared and private keys; every file verifies after."""
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=sw.worker, args=(str(tmp_path), w, 40, start, results)) for w in range(4)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len({pid for _, pid, _ in reports}) == 4
    assert [p for _, _, ps in reports for p in ps] == []
    names = [f"shared{i}" for i in range(4)] + [f"private{w}_{i}" for w in range(4) for i in range(3)]
    assert sorted(os.listdir(tmp_path)) == sorted(key_digest(("worker-test", n)) + ".graph" for n in names)
    store = GraphStore(tmp_path)
    for name in names:
        got, messages = store_warnings(store.load, ("worker-test", name), ENV)
        assert messages == [] and got is not None and sw.check_payload(name, got)


@pytest.mark.slow
def test_threads_share_a_store(store):
    problems = []
    start = threading.Barrier(8)

    def run(t):
        start.wait()
        for r in range(30):
            name = f"shared{r % 3}"
            got = store.load(("thread-test", name), ENV)
            if got is not None and not sw.check_payload(name, got):
                problems.append(name)
            store.save(("thread-test", name), ENV, sw.make_payload(name, f"t{t}r{r}"))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert problems == [] and caught == []
    counts = store.stats()
    assert counts.saves == 240 and counts.loads + counts.load_misses == 240
    assert len(os.listdir(store.directory)) == 3
