"""GraphKey and GraphCache on CPU, with a fake builder (no cuDNN needed)."""

import dataclasses
import gc
import threading
import time
import weakref

import pytest
import torch

from fused_attn.cache import CacheInfo, GraphCache, GraphKey, intern_key


def make_key(**overrides) -> GraphKey:
    fields = dict(
        direction="fwd", dtype="bfloat16", q_dims=(2, 4, 128, 64), k_dims=(2, 2, 128, 64),
        v_dims=(2, 2, 128, 64), q_strides=(32768, 64, 256, 1), k_strides=(16384, 64, 128, 1),
        v_strides=(16384, 64, 128, 1), o_strides=(32768, 64, 256, 1), scale=0.125,
    )
    fields.update(overrides)
    return GraphKey(**fields)


CHANGES = {
    "direction": "bwd", "dtype": "float16", "q_dims": (2, 4, 256, 64), "k_dims": (2, 4, 128, 64),
    "v_dims": (2, 2, 128, 32), "q_strides": (32768, 8192, 64, 1), "k_strides": (16384, 8192, 64, 1),
    "v_strides": (16384, 8192, 64, 1), "o_strides": (32768, 8192, 64, 1), "scale": 0.25,
    "band": (None, 0, False), "padding": True, "ragged": True, "score_mod": ("softcap", 1),
    "operands": (("cap", (1, 1, 1, 1), (1, 1, 1, 1), "torch.float32", True),), "deterministic": True,
    "device_index": 1, "backend_version": 91900, "bias": ((1, 4, 128, 128), (65536, 16384, 128, 1), "float32", True),
    "sinks": True, "dropout": 0.1, "stats_strides": (4 * 512, 512, 1, 1),
    "grad_strides": ((32768, 64, 256, 1), (16384, 64, 128, 1), (8192, 32, 64, 1)),
    "token_capacity": (4096, 2048),
}


@pytest.mark.parametrize("field_name", sorted(CHANGES))
def test_keys_differing_in_one_field_are_unequal(field_name):
    a, b = make_key(), make_key(**{field_name: CHANGES[field_name]})
    assert a == make_key() and hash(a) == hash(make_key())
    assert a != b and b != a and not (a == b)
    assert a != (a._key) and a != "fwd"


@pytest.mark.slow
def test_equal_keys_intern_to_one_object_held_weakly():
    def intern_two_and_build(cache):
        a, b = make_key(), make_key()
        same = (a is not b, intern_key(a) is a, intern_key(b) is a)
        cache.get_or_build(intern_key(b), lambda: "graph")
        hit = cache.get_or_build(a, lambda: "rebuilt")
        return same, hit, weakref.ref(a)

    cache = GraphCache(maxsize=4)
    same, hit, probe = intern_two_and_build(cache)
    assert same == (True, True, True) and hit == "graph"
    assert probe() is not None  # the cache entry holds the key
    cache.clear()
    gc.collect()
    assert probe() is None  # the intern table itself holds keys weakly
    c = make_key()
    assert intern_key(c) is c


def test_key_fields_all_covered():
    names = {f.name for f in dataclasses.fields(GraphKey) if f.compare}
    assert names == set(CHANGES)


def test_key_equal_and_hash():
    a, b = make_key(), make_key()
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_key_differs_per_field(field):
    a, b = make_key(), make_key(**{field: CHANGES[field]})
    assert a != b
    assert len({a, b}) == 2


@pytest.mark.parametrize("band", [(None, 0, True), (3, 0, False), (None, 2, False)])
def test_key_band_variants_differ(band):
    assert make_key(band=band) != make_key(band=(None, 0, False))


def test_key_is_frozen_and_validates():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_key().scale = 1.0
    with pytest.raises(ValueError, match="direction must be 'fwd' or 'bwd', got 'sideways'"):
        make_key(direction="sideways")
    assert "band(left_bound=3" in make_key(band=(3, 0, True)).describe()


class FakeGraph:
    pass


def counting_builder(counter, value=None, delay=0.0):
    def build():
        counter.append(1)
        if delay:
            time.sleep(delay)
        return value if value is not None else FakeGraph()
    return build


def test_hits_misses_builds():
    cache, calls = GraphCache(maxsize=4), []
    g1 = cache.get_or_build(make_key(), counting_builder(calls))
    g2 = cache.get_or_build(make_key(), counting_builder(calls))
    assert g1 is g2 and len(calls) == 1
    info = cache.info()
    assert isinstance(info, CacheInfo)
    assert (info.hits, info.misses, info.builds, info.size, info.maxsize) == (1, 1, 1, 1, 4)
    assert info.build_seconds >= 0.0 and info.thd_builds == 0
    cache.get_or_build(make_key(ragged=True), counting_builder(calls))
    assert cache.info().thd_builds == 1


def test_lru_order_and_eviction():
    cache, calls = GraphCache(maxsize=2), []
    k1, k2, k3 = make_key(scale=1.0), make_key(scale=2.0), make_key(scale=3.0)
    cache.get_or_build(k1, counting_builder(calls))
    cache.get_or_build(k2, counting_builder(calls))
    cache.get_or_build(k1, counting_builder(calls))  # k1 becomes most recent
    cache.get_or_build(k3, counting_builder(calls))  # evicts k2
    assert cache.keys() == [k1, k3]
    assert cache.info().evictions == 1
    assert cache.peek(k2) is None
    cache.get_or_build(k2, counting_builder(calls))
    assert len(calls) == 4 and cache.keys() == [k3, k2]


def test_builder_error_caches_nothing():
    cache = GraphCache(maxsize=2)

    def boom():
        raise NotImplementedError("no engine")

    with pytest.raises(NotImplementedError, match="no engine"):
        cache.get_or_build(make_key(), boom)
    assert cache.info().size == 0 and cache.info().builds == 0
    calls = []
    cache.get_or_build(make_key(), counting_builder(calls))
    assert len(calls) == 1


@pytest.mark.slow
def test_set_maxsize_shrinks_and_validates():
    cache, calls = GraphCache(maxsize=8), []
    keys = [make_key(scale=float(i)) for i in range(6)]
    for k in keys:
        cache.get_or_build(k, counting_builder(calls))
    cache.set_maxsize(2)
    assert cache.keys() == keys[-2:] and cache.info().evictions == 4 and cache.info().maxsize == 2
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="maxsize must be an int >= 1, got"):
            cache.set_maxsize(bad)


@pytest.mark.slow
def test_clear_and_eviction_release_graphs():
    cache = GraphCache(maxsize=1)
    g = FakeGraph()
    ref = weakref.ref(g)
    cache.get_or_build(make_key(), lambda: g)
    del g
    gc.collect()
    assert ref() is not None
    cache.clear()
    assert ref() is None
    assert cache.info() == CacheInfo(0, 0, 0, 0, 0.0, 0, 1, 0)
    g2 = FakeGraph()
    ref2 = weakref.ref(g2)
    cache.get_or_build(make_key(scale=1.0), lambda: g2)
    del g2
    cache.get_or_build(make_key(scale=2.0), FakeGraph)  # evicts the first
    gc.collect()
    assert ref2() is None


def test_two_threads_same_key_build_once():
    cache, calls = GraphCache(maxsize=4), []
    results = []
    barrier = threading.Barrier(2)

    def worker():
        barrier.wait()
        results.append(cache.get_or_build(make_key(), counting_builder(calls, delay=0.2)))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results[0] is results[1]
    info = cache.info()
    assert info.builds == 1 and info.misses == 2


def test_builds_run_outside_the_lock():
    cache, calls = GraphCache(maxsize=4), []
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(0.3)
        return FakeGraph()

    t = threading.Thread(target=lambda: cache.get_or_build(make_key(scale=1.0), slow))
    t.start()
    started.wait()
    t0 = time.perf_counter()
    cache.get_or_build(make_key(scale=2.0), counting_builder(calls))
    assert time.perf_counter() - t0 < 0.2  # did not wait for the other key's build
    t.join()


def test_many_threads_many_keys():
    cache = GraphCache(maxsize=16)
    lock, built = threading.Lock(), {}

    def builder_for(i):
        def build():
            with lock:
                built[i] = built.get(i, 0) + 1
            time.sleep(0.001)
            return ("graph", i)
        return build

    errors = []

    def worker(seed):
        try:
            for j in range(200):
                i = (seed * 7 + j) % 12
                assert cache.get_or_build(make_key(scale=float(i)), builder_for(i)) == ("graph", i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(n == 1 for n in built.values()) and len(built) == 12
    info = cache.info()
    assert info.hits + info.misses == 8 * 200 and info.builds == 12 and info.size == 12


@pytest.mark.slow
def test_public_module_api():
    from fused_attn import graph_cache

    graph_cache.clear()
    info = graph_cache.cache_info()
    assert info.size == 0 and info.builds == 0
    old = info.maxsize
    graph_cache.set_maxsize(3)
    assert graph_cache.cache_info().maxsize == 3
    graph_cache.set_maxsize(old)
    with pytest.raises(ValueError, match="maxsize must be an int >= 1"):
        graph_cache.set_maxsize(0)
    with pytest.raises(ValueError, match="missing keys"):
        graph_cache._inputs({"batch": 1}, False)
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        graph_cache._inputs(dict(batch=1, seqlen_q=8, num_heads=1, head_dim=8, dtype=None, bogus=1), False)


_GOOD = dict(batch=1, seqlen_q=16, num_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.mark.parametrize("configs, backward, exc, match", [
    (dict(_GOOD), True, TypeError, "configs must be a list .* of dicts, got dict"),
    (["x"], True, TypeError, r"configs\[0\] must be a dict, got str"),
    ([_GOOD], "yes", TypeError, "backward must be a bool, got 'yes'"),
    ([{**_GOOD, "batch": -1}], True, ValueError, r"configs\[0\]\['batch'\] must be an int >= 1, got -1"),
    ([_GOOD, {**_GOOD, "head_dim": 2.5}], True, ValueError, r"configs\[1\]\['head_dim'\] must be an int >= 1, got 2.5"),
    ([{**_GOOD, "num_heads": True}], True, ValueError, r"\['num_heads'\] must be an int >= 1, got True"),
    ([{**_GOOD, "dtype": torch.int32}], True, ValueError, r"\['dtype'\] must be torch.bfloat16 or torch.float16"),
    ([{**_GOOD, "device": "nope"}], True, ValueError, r"\['device'\] is not a device: 'nope'"),
    ([{**_GOOD, "device": "cpu"}], True, ValueError, r"\['device'\] must be a CUDA device"),
    ([{k: v for k, v in _GOOD.items() if k != "batch"}], True, ValueError, r"missing keys \['batch'\]"),
    ([{**_GOOD, "colour": 1}], True, ValueError, r"unknown keys \['colour'\]"),
])
def test_warmup_validates_before_building(configs, backward, exc, match):
    from fused_attn import graph_cache

    before = graph_cache.cache_info()
    with pytest.raises(exc, match=match):
        graph_cache.warmup(configs, backward=backward)
    assert graph_cache.cache_info().builds == before.builds
