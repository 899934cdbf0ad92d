"""BoundedMemo: LRU order, bound, identity guard, callbacks, and thread safety (CPU only)."""

import gc
import random
import sys
import threading
import time
import weakref
from collections import Counter

import pytest

from fused_attn.memo import BoundedMemo, MemoInfo


class Obj:
    """A weak-referenceable object that compares equal to every other Obj (identity must decide)."""

    def __eq__(self, other):
        return isinstance(other, Obj)

    __hash__ = object.__hash__


def test_lru_order_and_bound():
    m = BoundedMemo(3, "t")
    for k in "abc":
        m.put(k, k.upper())
    assert m.get("a") == "A"  # a is now most recently used
    m.put("d", "D")  # evicts b, the least recently used
    assert "b" not in m and len(m) == 3
    assert [k for k in "acd" if k in m] == ["a", "c", "d"]
    m.put("c", "C2")  # replacing refreshes c
    m.put("e", "E")  # evicts a
    assert "a" not in m and m.get("c") == "C2"
    assert m.get("zz", "default") == "default"
    info = m.info()
    assert isinstance(info, MemoInfo)
    assert (info.name, info.hits, info.misses, info.evictions, info.size, info.maxsize) == ("t", 2, 1, 2, 3, 3)


def test_contains_touches_nothing():
    m = BoundedMemo(2, "t")
    m.put("a", 1)
    m.put("b", 2)
    assert "a" in m  # no LRU move: a is still evicted first
    m.put("c", 3)
    assert "a" not in m
    assert m.info().hits == 0 and m.info().misses == 0


def test_pop_and_clear():
    m = BoundedMemo(4, "t")
    m.put("a", 1)
    assert m.pop("a") == 1 and m.pop("a", "gone") == "gone" and len(m) == 0
    m.put("b", 2)
    m.get("b")
    m.clear(reset_stats=False)
    assert len(m) == 0 and m.info().hits == 1
    m.clear()
    assert m.info() == MemoInfo("t", 0, 0, 0, 0, 4)


def test_on_evict_runs_outside_the_lock_for_evictions_only():
    seen = []
    m = BoundedMemo(2, "t", on_evict=lambda k, v: seen.append((k, v, len(m))))  # len takes the lock

    def work():
        m.put("a", 1)
        m.put("b", 2)
        m.put("a", 10)  # replacement: no callback
        m.put("c", 3)  # evicts b
        m.pop("a")  # pop: no callback
        m.clear()  # clear: no callback

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "on_evict deadlocked: it was called under the memo's lock"
    assert seen == [("b", 2, 2)]


def test_on_evict_errors_propagate_after_every_callback():
    seen = []

    def cb(k, v):
        seen.append(k)
        raise RuntimeError(f"boom {k}")

    m = BoundedMemo(1, "t", on_evict=cb)
    m.put("a", 1)
    with pytest.raises(RuntimeError, match="boom a"):
        m.put("b", 2)
    assert seen == ["a"] and m.get("b") == 2


@pytest.mark.parametrize("maxsize, exc, match", [
    (0, ValueError, "maxsize must be >= 1, got 0"),
    (-3, ValueError, "maxsize must be >= 1, got -3"),
    ("16", TypeError, "maxsize must be an int, got '16'"),
    (True, TypeError, "maxsize must be an int, got True"),
    (2.0, TypeError, "maxsize must be an int, got 2.0"),
])
def test_bad_maxsize(maxsize, exc, match):
    with pytest.raises(exc, match=match):
        BoundedMemo(maxsize, "t")


def test_bad_name_and_callback():
    with pytest.raises(TypeError, match="name must be a non-empty str"):
        BoundedMemo(2, "")
    with pytest.raises(TypeError, match="on_evict must be callable"):
        BoundedMemo(2, "t", on_evict=3)
    with pytest.raises(TypeError, match="objects must be a tuple"):
        BoundedMemo(2, "t").put_identity("k", [Obj()], 1)


def test_identity_guard():
    m = BoundedMemo(4, "t")
    a, b = Obj(), Obj()
    key = (id(a), id(b))
    m.put_identity(key, (a, b), "value")
    assert m.get_identity(key, (a, b)) == "value"
    assert m.get_identity(key, (a, Obj())) is None  # equal but not the same object
    assert m.get_identity(key, (a,), "d") == "d"  # another count of objects
    assert m.get_identity(("other",), (a, b)) is None
    m.put("plain", 1)
    assert m.get_identity("plain", ()) is None  # not an identity entry
    info = m.info()
    assert (info.hits, info.misses) == (1, 4)
    # peek_identity: the same answers, without the counters or the LRU refresh
    assert m.peek_identity(key, (a, b)) == "value" and m.peek_identity(key, (a, Obj())) is None
    assert m.peek_identity(key, (a,), "d") == "d" and m.peek_identity("plain", ()) is None
    assert (m.info().hits, m.info().misses) == (1, 4)
    assert m.pop(key) == "value"


def test_identity_entries_hold_objects_weakly_and_miss_once_one_is_freed():
    """An identity entry never keeps a caller's object alive; a freed object's entry misses
    (even for a new object that reuses its id) and is dropped at the next put."""
    m = BoundedMemo(4, "t")
    a, b = Obj(), Obj()
    ref = weakref.ref(a)
    m.put_identity((id(a),), (a, None), "v")
    assert m.get_identity((id(a),), (a, None)) == "v"
    key = (id(a),)
    del a
    gc.collect()
    assert ref() is None  # not pinned
    assert m.get_identity(key, (b, None)) is None  # another object under the same key: a miss
    assert m.peek_identity(key, (b, None)) is None
    assert len(m) == 1
    m.put("other", 0)  # drops the dead entry
    assert len(m) == 1 and key not in m
    m.put_identity(key, (b,), "w")  # a live entry under a key that died before stays
    m.put("more", 1)
    assert m.get_identity(key, (b,)) == "w"


def test_on_evict_gets_identity_entry_values():
    seen = []
    m = BoundedMemo(1, "t", on_evict=lambda k, v: seen.append(v))
    alive = Obj()
    m.put_identity("k", (alive,), "v")
    m.put("x", 1)
    assert seen == ["v"]


def test_get_or_create_basics():
    m = BoundedMemo(4, "t")
    calls = []
    assert m.get_or_create("a", lambda: calls.append(1) or [1]) == [1]
    first = m.get("a")
    assert m.get_or_create("a", lambda: calls.append(1) or [2]) is first
    assert calls == [1]
    with pytest.raises(KeyError, match="nope"):
        m.get_or_create("b", lambda: {}["nope"])
    assert "b" not in m
    assert m.get_or_create("b", lambda: 2) == 2  # a failed factory left nothing behind


def test_get_or_create_recursion_is_an_error_not_a_deadlock():
    m = BoundedMemo(4, "t")
    with pytest.raises(RuntimeError, match="asked for its own key"):
        m.get_or_create("a", lambda: m.get_or_create("a", lambda: 1))
    assert "a" not in m


def test_get_or_create_put_meanwhile_wins_and_clear_drops():
    m = BoundedMemo(4, "t")
    assert m.get_or_create("a", lambda: (m.put("a", "put"), "made")[1]) == "put"
    assert m.get("a") == "put"
    assert m.get_or_create("b", lambda: (m.clear(), "made")[1]) == "made"
    assert "b" not in m  # cleared while the factory ran: nothing stored


def test_get_or_create_waiters_share_one_value_and_one_error():
    m = BoundedMemo(8, "t")
    gate = threading.Event()
    results, errors = [], []

    def factory():
        gate.wait(5)
        raise ValueError("factory failed")

    def call():
        try:
            results.append(m.get_or_create("k", factory))
        except ValueError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join(5)
    assert results == [] and len(errors) == 4 and "k" not in m


def test_factory_called_once_per_key_under_contention():
    keys = list(range(64))
    m = BoundedMemo(64, "t")  # no eviction
    calls = Counter()
    calls_lock = threading.Lock()
    start = threading.Barrier(16)
    got = [dict() for _ in range(16)]

    def factory(k):
        with calls_lock:
            calls[k] += 1
        time.sleep(0.0005)  # widen the race window
        return object()

    def worker(i):
        order = keys[:]
        random.Random(i).shuffle(order)
        start.wait()
        for k in order:
            got[i][k] = m.get_or_create(k, lambda k=k: factory(k))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(calls[k] == 1 for k in keys), calls
    for k in keys:
        assert all(g[k] is got[0][k] for g in got)
    info = m.info()
    assert info.hits + info.misses == 16 * 64 and info.misses >= 64 and info.size == 64


@pytest.mark.slow
def test_thread_hammer():
    """16 threads x 20,000 mixed operations on 64 keys, maxsize 16."""
    n_threads, n_ops, maxsize = 16, 20_000, 16
    m = BoundedMemo(maxsize, "hammer")
    errors, over, lookups = [], [], [0] * n_threads
    start = threading.Barrier(n_threads)

    def worker(i):
        rng = random.Random(i)
        start.wait()
        try:
            for _ in range(n_ops):
                k = rng.randrange(64)
                op = rng.random()
                if op < 0.4:
                    v = m.get(k)
                    lookups[i] += 1
                    if v is not None and v != k * 10:
                        errors.append(f"get {k} -> {v}")
                elif op < 0.6:
                    m.put(k, k * 10)
                elif op < 0.85:
                    v = m.get_or_create(k, lambda k=k: k * 10)
                    lookups[i] += 1
                    if v != k * 10:
                        errors.append(f"get_or_create {k} -> {v}")
                elif op < 0.95:
                    m.pop(k)
                else:
                    size = len(m)
                    if size > maxsize:
                        over.append(size)
        except Exception as exc:  # noqa: BLE001 - report every failure
            errors.append(repr(exc))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # more interleavings
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:5]
    assert not over
    info = m.info()
    assert info.size == len(m) <= maxsize
    assert info.hits + info.misses == sum(lookups)
    assert info.evictions > 0


def test_identity_entries_neither_serve_nor_store_during_cuda_graph_capture(monkeypatch):
    """A captured graph replays its kernels on new tensor contents: an identity hit would bake the
    warm-up's device values into it (capture itself is simulated: fake CUDA tensors on the CPU)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def never(*_):
        raise AssertionError("asked about capture without an initialized CUDA context")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", never)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cu = torch.empty(5, dtype=torch.int32, device="cuda")
    assert cu.is_cuda
    memo = BoundedMemo(4, "capture")
    memo.put_identity(("k",), (cu,), "warm-up value")  # no CUDA context: never asked, stored
    assert memo.get_identity(("k",), (cu,)) == "warm-up value"
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert memo.get_identity(("k",), (cu,)) is None  # capture: recompute, do not reuse
    assert memo.peek_identity(("k",), (cu,)) is None
    memo.put_identity(("k2",), (cu,), "captured buffers")
    capturing[0] = False
    assert memo.get_identity(("k2",), (cu,)) is None  # nothing was stored during capture
    assert memo.get_identity(("k",), (cu,)) == "warm-up value"  # eager calls still hit
    cpu = torch.zeros(3)
    capturing[0] = True
    memo.put_identity(("c",), (cpu,), 1)  # no CUDA tensor among the objects: capture is irrelevant
    assert memo.get_identity(("c",), (cpu,)) == 1
