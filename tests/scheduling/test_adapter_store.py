"""AdapterStore's invariants: a byte- or count-bounded LRU over adapter sources that reloads what it dropped
(directories, compositions, remote fetches) to the same weights, and never rebinds a served name."""

import numpy as np
import pytest

import numaserve as ns
from models.model_spec import load_spec
from scheduling.lora.adapter_store import AdapterSource, AdapterStore
from tests.models.test_lora import make_adapter


@pytest.fixture(scope="module")
def dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    return {name: make_adapter(llama_dir, root / name, seed=seed, r=r)
            for name, seed, r in (("a", 1, 4), ("b", 2, 4), ("c", 3, 8))}


def same_weights(x, y) -> bool:
    return all(set(lx) == set(ly) and all(np.array_equal(lx[m].a, ly[m].a)
                                          and np.array_equal(lx[m].b, ly[m].b)
                                          and lx[m].scaling == ly[m].scaling for m in lx)
               for lx, ly in zip(x.layers, y.layers))


def test_a_byte_bound_evicts_least_recently_used_and_reloads_the_same_weights(llama_dir, dirs):
    spec = load_spec(llama_dir)
    unbounded = AdapterStore(spec, 64)
    for name, path in dirs.items():
        unbounded.register(name, path)
    one = unbounded["a"].nbytes
    store = AdapterStore(spec, 64, max_bytes=2 * one)  # a and b fit together; c (rank 8) is twice as large
    for name, path in dirs.items():
        store.register(name, path)
        assert store.loaded_bytes <= 2 * one or store.stats()["num_adapters_loaded"] == 1
    assert [store.is_loaded(n) for n in "abc"] == [False, False, True] and store.num_evictions == 2
    store.compose("mix", {"a": 0.5, "b": 0.5}, "linear")  # loads a and b again, evicting c, then mix
    assert store.is_loaded("mix") and not store.is_loaded("c")
    unbounded.compose("mix", {"a": 0.5, "b": 0.5}, "linear")
    for name in ("a", "c", "mix", "b", "a"):  # each reloaded (mix composed again) as it was
        assert same_weights(store[name], unbounded[name])
        assert store.loaded_bytes <= 2 * one or store.stats()["num_adapters_loaded"] == 1
    stats = store.stats()
    assert stats["adapter_misses"] > 0 and stats["adapter_hits"] >= 0 and stats["num_adapters"] == 4
    assert list(store) == ["a", "b", "c", "mix"]  # every registered adapter stays served


def test_a_count_bound_over_a_remote_source_fetches_on_a_miss(llama_dir, dirs):
    spec = load_spec(llama_dir)
    origin = AdapterStore(spec, 64)
    for name, path in dirs.items():
        origin.register(name, path)
    fetched = []
    worker = AdapterStore(spec, 64, max_loaded=2, fetch=lambda n: fetched.append(n) or origin[n])
    for name in "abc":
        worker.add_remote(name)
    assert fetched == [] and "a" in worker and "zz" not in worker
    for name in "abcab":
        assert same_weights(worker[name], origin[name])
    assert fetched == ["a", "b", "c", "a", "b"] and worker.stats()["num_adapters_loaded"] == 2
    with pytest.raises(ns.AdapterError, match="taken by"):
        worker.register("a", dirs["a"])  # a name served from elsewhere is not rebound
    with pytest.raises(KeyError):
        worker["zz"]


def test_sources_round_trip_through_json():
    for source in (AdapterSource(path="/x/y"),
                   AdapterSource(weights=(("a", 0.7), ("b", -0.3)), combination="cat")):
        assert AdapterSource.from_json(source.to_json()) == source
    with pytest.raises(ValueError):
        AdapterSource.from_json({"nothing": 1})
