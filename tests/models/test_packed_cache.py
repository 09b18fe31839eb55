"""The packed weight cache: a second load of the same model reads the planned weights back without loading
or repacking (asserted by making both fail) and serves bit-identical logits and tokens; any change of key
misses; a damaged entry is rebuilt, never used; an unwritable or full directory and unstorable weights cost
the cache, not the load; concurrent builders leave one valid entry; pruning keeps the byte budget."""

import gc
import json
import multiprocessing
import os
import resource
import shutil
import signal
import struct
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

import numaserve as ns
from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import CheckpointError
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import cpu_features, missing_features
from memory.matrices import Bf16Matrix, BlockInt8Matrix, Int8Matrix, parts
from memory.numa import NumaNode
from models.gguf.writer import convert_to_gguf
from models.loader import load_model
from models.packed import cache as packed_cache
from models.packed import planned_load
from models.packed.tree import Unstorable, flatten, unflatten
from models.quantization.activation_plan import INT8_FEATURES, ActivationPlan, plan_activations
from models.quantization.calibration import Calibration, MatrixCalibration, matrix_names, save_calibration
from tests.fixtures.make_kquant_gguf import FIXTURE

PROMPT = [1, 17, 5, 99, 250, 3, 42, 7]
GREEDY = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
Q8 = {"weight_dtype": "q8_0", "activation_dtype": "auto", "max_model_len": 128}
PLANNING_TOPICS = ("activation_dtype", "kernel", "calibration")


def load(path, cache: Path | None, **fields) -> ns.LLM:
    return ns.LLM(path, **(Q8 | fields), packed_cache_dir=None if cache is None else str(cache))


def outcome(llm: ns.LLM) -> str:
    return llm.engine.load_stats.outcome


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*" + packed_cache.ENTRY_SUFFIX))


def planning_decisions(llm: ns.LLM) -> list[tuple]:
    return [(d["topic"], d["subject"], d["choice"], d["reason"], d["count"]) for d in llm.diagnostics()
            if d["topic"] in PLANNING_TOPICS]


def no_loading_or_repacking(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("a cache hit loaded or repacked")

    monkeypatch.setattr(planned_load, "load_model", fail)
    monkeypatch.setattr(Int8Matrix, "pack", fail)
    monkeypatch.setattr(Bf16Matrix, "pack", fail)


@pytest.fixture(scope="module")
def gguf_file(llama_dir, tmp_path_factory) -> Path:
    return convert_to_gguf(llama_dir, tmp_path_factory.mktemp("gguf") / "llama-q8_0.gguf", "q8_0")


def stream_arrays(weights):
    """The packed weight streams the kernels read (kernels/placement.py)."""
    for layer in weights.layers:
        for m in layer.projections:
            for p in parts(layer.projection(m)):
                if isinstance(p, (Int8Matrix, Bf16Matrix)):
                    yield p.data
                elif isinstance(p, BlockInt8Matrix):
                    yield p.packed.data


# ---- a hit ---------------------------------------------------------------------------------------------

CASES = {  # name -> (model, engine fields)
    "int8 activations": ("llama", {}),
    "q4_0": ("llama", {"weight_dtype": "q4_0"}),
    "tied float32": ("llama_tied", {"weight_dtype": "float32", "activation_dtype": "float32"}),
    "bfloat16 activations": ("llama", {"weight_dtype": "bfloat16", "activation_dtype": "bfloat16"}),
    "float16": ("llama", {"weight_dtype": "float16"}),  # numpy float16 arrays, unpacked (float32 activations)
    "experts": ("qwen3_moe", {}),
    "gguf": ("gguf", {"weight_dtype": "auto"}),
    # llama.cpp's Q4_K_M file: K-quant packed matrices, StackedMatrix of Q4_K and Q6_K parts
    "q4_k_m gguf": ("q4_k_m", {"weight_dtype": "auto"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_second_load_hits_without_loading_or_repacking_and_serves_identical_logits(case, model_dirs,
                                                                                     gguf_file, tmp_path,
                                                                                     monkeypatch):
    model, fields = CASES[case]
    path = {"gguf": gguf_file, "q4_k_m": FIXTURE}.get(model) or model_dirs[model]
    first = load(path, tmp_path, **fields)
    assert outcome(first) == "built" and len(entries(tmp_path)) == 1
    no_loading_or_repacking(monkeypatch)
    second = load(path, tmp_path, **fields, map_packed_weights=True)  # zero-copy views of the entry's pages
    assert outcome(second) == "hit" and second.engine.load_stats.hit
    assert second.engine.load_stats.reason.startswith("mapped")
    assert second.engine.load_stats.entry_bytes > 0 and second.engine.load_stats.hash_seconds == 0
    assert np.array_equal(first.score(PROMPT), second.score(PROMPT))
    assert first.generate(PROMPT, GREEDY)[0].token_ids == second.generate(PROMPT, GREEDY)[0].token_ids
    assert planning_decisions(second) == planning_decisions(first)
    assert second.engine.spec == first.engine.spec
    w1, w2 = first.engine.model.weights, second.engine.model.weights
    assert (w2.lm_head is w2.embed) == (w1.lm_head is w1.embed)
    assert type(w2.layers[-1].qkv) is type(w1.layers[-1].qkv)
    assert w2.layers[-1].qkv.dtype == w1.layers[-1].qkv.dtype
    assert second.tokenizer.encode("the quick brown fox") == first.tokenizer.encode("the quick brown fox")
    # built or mapped, the streams sit 16 bytes past a cache line (kernels/placement.py); float weights, and
    # bfloat16 activations on a CPU without their kernel (float32 activations then), have no packed stream
    offsets = [{a.ctypes.data % 64 for a in stream_arrays(w)} for w in (w1, w2)]
    unpacked = case in ("tied float32", "float16") or (case == "bfloat16 activations"
                                                         and missing_features(BF16_FEATURES))
    assert offsets == [set(), set()] if unpacked else offsets == [{16}, {16}]


def test_a_hit_warns_again_of_a_fallback_planning_warned_of(llama_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx2")
    load(llama_dir, tmp_path, activation_dtype="int8")
    assert "this CPU lacks avx2" in caplog.text
    caplog.clear()
    hit = load(llama_dir, tmp_path, activation_dtype="int8")
    assert outcome(hit) == "hit" and "this CPU lacks avx2" in caplog.text


def test_the_loaders_errors_are_unchanged(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        load(tmp_path / "missing.gguf", tmp_path / "cache")


def test_the_hit_matches_a_load_without_the_cache(llama_dir, tmp_path):
    load(llama_dir, tmp_path)
    hit = load(llama_dir, tmp_path)
    uncached = load(llama_dir, None)
    assert outcome(hit) == "hit" and outcome(uncached) == "off"
    assert np.array_equal(hit.score(PROMPT), uncached.score(PROMPT))


# ---- a build plans each layer as it loads it -------------------------------------------------------------

BUILDS = {"hf": ("llama", "q8_0"), "gguf": ("gguf", "auto"), "experts": ("qwen3_moe", "q8_0")}


def _build(case: str, model_dirs, gguf_file) -> tuple[Path, EngineConfig]:
    model, dtype = BUILDS[case]
    path = gguf_file if model == "gguf" else model_dirs[model]
    return path, EngineConfig(**Q8 | {"weight_dtype": dtype}, packed_cache_dir=None)


@pytest.mark.parametrize("case", list(BUILDS))
def test_a_build_drops_each_layers_unplanned_matrices_before_it_loads_the_next(case, model_dirs, gguf_file,
                                                                              monkeypatch):
    """What keeps a build's memory near the weights' own: the matrices planning replaced (repacked for their
    activations) are gone by the time the next layer is planned, and at the end."""
    path, config = _build(case, model_dirs, gguf_file)
    replaced, layer = [], ActivationPlan.layer

    def watched(self, i, unplanned):
        gc.collect()
        assert [r() for r in replaced] == [None] * len(replaced), f"layer {i}: an earlier one's copy is alive"
        planned = layer(self, i, unplanned)
        replaced.extend(weakref.ref(m) for key in unplanned.projections
                        for m in parts(unplanned.projection(key))
                        if all(m is not p for p in parts(planned.projection(key))))
        return planned

    monkeypatch.setattr(ActivationPlan, "layer", watched)
    built = planned_load.load_planned(path, config, DecisionLog())
    gc.collect()
    assert [r() for r in replaced] == [None] * len(replaced)
    assert replaced or missing_features(INT8_FEATURES), "int8 planning repacked nothing"
    assert built.stats.outcome == "off"


@pytest.mark.parametrize("case", list(BUILDS))
def test_planning_while_loading_equals_planning_the_loaded_model(case, model_dirs, gguf_file):
    path, config = _build(case, model_dirs, gguf_file)
    streamed_log, after_log = DecisionLog(), DecisionLog()
    streamed = planned_load.load_planned(path, config, streamed_log)
    spec, weights, _ = load_model(path, config.weight_dtype)
    after = plan_activations(weights, config.activation_dtype, after_log)
    tree, arrays = flatten({"spec": streamed.spec, "weights": streamed.weights})
    tree_after, arrays_after = flatten({"spec": spec, "weights": after})
    assert tree == tree_after and len(arrays) == len(arrays_after)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(arrays, arrays_after))
    planning = [(d["topic"], d["subject"], d["choice"], d["reason"], d["count"]) for d in after_log.recent()]
    assert [(d["topic"], d["subject"], d["choice"], d["reason"], d["count"]) for d in streamed_log.recent()
            if d["topic"] != "packed_cache"] == planning


# ---- the key ---------------------------------------------------------------------------------------------

def test_every_change_of_key_misses_and_a_copy_of_the_source_hits(llama_dir, tmp_path, monkeypatch):
    cache, model = tmp_path / "cache", shutil.copytree(llama_dir, tmp_path / "model")
    seen = {}

    def miss(name, path=model, **fields):
        llm = load(path, cache, **fields)
        assert outcome(llm) == "built", name
        seen[name] = llm.engine.load_stats.entry
        return llm

    miss("base")
    assert outcome(load(shutil.copytree(model, tmp_path / "copy"), cache)) == "hit"  # keyed by content
    miss("weight_dtype", weight_dtype="q4_0")
    miss("activation_dtype", activation_dtype="float32")
    with monkeypatch.context() as m:
        m.setenv("NUMASERVE_DISABLE_CPU_FEATURES", min(cpu_features()))
        miss("cpu features")
    with monkeypatch.context() as m:
        m.setattr(packed_cache, "LAYOUT_VERSION", packed_cache.LAYOUT_VERSION + 1)
        miss("layout version")
    with monkeypatch.context() as m:
        m.setattr(packed_cache, "numaserve_version", lambda: "0.0.0-other")
        miss("numaserve version")
    save_calibration(_calibration(num_layers=2, fallback="layers.0.qkv"), model)
    calibrated = miss("calibration")
    assert [d[2] for d in planning_decisions(calibrated) if d[1] == "layers.0.qkv"] == ["float32"]
    miss("activation_scales", activation_scales="static")
    from tests.support.model_factory import build_model
    build_model(model, "llama", seed=5)  # the same files, other weights
    changed = miss("source")
    fresh = load(model, None)
    assert np.array_equal(changed.score(PROMPT), fresh.score(PROMPT))
    assert len(set(seen.values())) == len(seen) == len(entries(cache))
    assert outcome(load(tmp_path / "copy", cache)) == "hit"  # the old entries stay usable


def test_a_touched_source_is_hashed_again_and_still_hits(gguf_file, tmp_path):
    load(gguf_file, tmp_path)
    assert load(gguf_file, tmp_path).engine.load_stats.hash_seconds == 0  # the recorded hash trusted
    os.utime(gguf_file)
    again = load(gguf_file, tmp_path)
    assert outcome(again) == "hit" and again.engine.load_stats.hash_seconds > 0


def _calibration(num_layers: int, fallback: str) -> Calibration:
    matrices = {name: MatrixCalibration(absmax=4.0, scale=4.0 / 127, error_dynamic=0.01,
                                        fallback=name == fallback) for name in matrix_names(num_layers)}
    return Calibration(method="minmax", bound=0.02, weight_dtype="q8_0", text="test", text_sha256="0" * 64,
                       num_tokens=256, num_layers=num_layers, matrices=matrices)


# ---- damage ----------------------------------------------------------------------------------------------

def _manifest(entry: Path) -> tuple[int, int, dict]:
    """-> (the manifest's offset, the blob's offset, the manifest), read as models/packed/file.py lays out."""
    data = entry.read_bytes()
    magic, size, _ = struct.unpack("<8sQQ", data[:24])
    assert magic == b"NSPACK\x00\x01"
    return 24, -(-(24 + size) // 4096) * 4096 + 16, json.loads(data[24:24 + size])


def _flip(entry: Path, offset: int) -> None:
    data = bytearray(entry.read_bytes())
    data[offset] ^= 0x10
    entry.write_bytes(bytes(data))


def _damage(entry: Path, case: str, other: Path) -> None:
    manifest_at, blob_at, manifest = _manifest(entry)
    if case == "truncated":
        os.truncate(entry, entry.stat().st_size // 2)
    elif case == "header only":
        os.truncate(entry, 10)
    elif case == "array byte":
        largest = max(manifest["arrays"], key=lambda a: a["nbytes"])
        _flip(entry, blob_at + largest["offset"] + largest["nbytes"] // 2)
    elif case == "last array byte":
        last = manifest["arrays"][-1]
        _flip(entry, blob_at + last["offset"] + last["nbytes"] - 1)
    elif case == "manifest byte":
        _flip(entry, manifest_at + 40)
    elif case == "magic":
        _flip(entry, 0)
    elif case == "another model's entry":
        shutil.copyfile(other, entry)
    else:
        entry.unlink()


@pytest.mark.parametrize("case, problem", [
    ("truncated", "bytes, its manifest describes"), ("header only", "truncated"),
    ("array byte", "fails its checksum"), ("last array byte", "fails its checksum"),
    ("manifest byte", "manifest's checksum"), ("magic", "not a packed-cache entry"),
    ("another model's entry", "key is another model's"), ("missing", "no entry yet")])
@pytest.mark.parametrize("mapped", [False, True])
def test_a_damaged_entry_is_rebuilt_never_used(case, problem, mapped, llama_dir, tmp_path, caplog):
    reference = load(llama_dir, None).score(PROMPT)
    other = Path(load(llama_dir, tmp_path, activation_dtype="float32").engine.load_stats.entry)
    entry = Path(load(llama_dir, tmp_path).engine.load_stats.entry)
    _damage(entry, case, other)
    rebuilt = load(llama_dir, tmp_path, map_packed_weights=mapped)
    stats = rebuilt.engine.load_stats
    assert stats.outcome == ("built" if case == "missing" else "rebuilt") and problem in stats.reason
    if case != "missing":
        assert "packed_cache" in caplog.text and problem in caplog.text  # a rebuild warns
    assert np.array_equal(rebuilt.score(PROMPT), reference)
    hit = load(llama_dir, tmp_path, map_packed_weights=mapped)  # the rebuilt entry is whole again
    assert outcome(hit) == "hit" and hit.engine.load_stats.reason.startswith("mapped" if mapped else "read")
    assert np.array_equal(hit.score(PROMPT), reference)
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("how", ["rebuilt", "pruned"])
def test_an_engine_serving_a_mapped_entry_keeps_its_weights_while_the_entry_is_replaced_or_removed(
        how, llama_dir, tmp_path):
    # the cache never writes an entry in place (a new file renamed over it, or unlinked): a mapping of the
    # old one keeps its inode, so an engine serving it is untouched by a rebuild or a prune in another
    reference = load(llama_dir, None).score(PROMPT)
    entry = Path(load(llama_dir, tmp_path).engine.load_stats.entry)
    serving = load(llama_dir, tmp_path, map_packed_weights=True)
    assert outcome(serving) == "hit" and serving.engine.load_stats.reason.startswith("mapped")
    weights = [a.copy() for a in stream_arrays(serving.engine.model.weights)]
    if how == "rebuilt":  # a damaged copy renamed over the entry, then a load that finds it and rebuilds it
        damaged = tmp_path / "damaged"
        shutil.copyfile(entry, damaged)
        _manifest_at, blob_at, manifest = _manifest(damaged)
        largest = max(manifest["arrays"], key=lambda a: a["nbytes"])
        _flip(damaged, blob_at + largest["offset"] + largest["nbytes"] // 2)
        os.replace(damaged, entry)
        assert outcome(load(llama_dir, tmp_path, map_packed_weights=True)) == "rebuilt"
    else:
        other = tmp_path / "other"
        from tests.support.model_factory import build_model
        build_model(other, "llama", seed=9)
        pruning = load(other, tmp_path, packed_cache_bytes=entry.stat().st_size + 1)
        assert "removed 1 least recently used" in pruning.engine.load_stats.reason and not entry.exists()
    assert all(np.array_equal(a, b) for a, b in zip(stream_arrays(serving.engine.model.weights), weights))
    assert np.array_equal(serving.score(PROMPT), reference)


def test_a_damaged_source_record_is_hashed_again(llama_dir, tmp_path):
    load(llama_dir, tmp_path)
    for record in (tmp_path / "sources").iterdir():
        record.write_text(record.read_text()[:-5])
    again = load(llama_dir, tmp_path)
    assert outcome(again) == "hit" and again.engine.load_stats.hash_seconds > 0


# ---- the cache fails, the load does not ------------------------------------------------------------------

def test_an_unwritable_cache_directory_loads_without_the_cache(llama_dir, tmp_path, caplog):
    (tmp_path / "a file").write_text("")
    llm = load(llama_dir, tmp_path / "a file" / "cache")
    assert outcome(llm) == "not cached" and "cannot use" in llm.engine.load_stats.reason
    assert "cannot use" in caplog.text
    assert np.array_equal(llm.score(PROMPT), load(llama_dir, None).score(PROMPT))


def test_a_full_disk_loads_without_the_cache_and_leaves_no_temp_file(llama_dir, tmp_path):
    reference = load(llama_dir, None)  # kernels compiled (and numba's cache written) before writes are capped
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG): no signal
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # the tiny model's entry is ~400 KB
    try:
        llm = load(llama_dir, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert outcome(llm) == "not cached" and "cannot write" in llm.engine.load_stats.reason
    assert entries(tmp_path) == [] and not list(tmp_path.glob(".*.tmp"))
    assert np.array_equal(llm.score(PROMPT), reference.score(PROMPT))


def test_weights_the_cache_cannot_store_are_loaded_and_not_cached(llama_dir, tmp_path, monkeypatch):
    finish = planned_load.ActivationPlan.finish

    def with_an_object_array(self, weights):
        w = finish(self, weights)
        layer = replace(w.layers[0], qkv_bias=np.array([object()], dtype=object))
        return replace(w, layers=(layer, *w.layers[1:]))

    monkeypatch.setattr(planned_load.ActivationPlan, "finish", with_an_object_array)
    llm = load(llama_dir, tmp_path)
    assert outcome(llm) == "not cached"
    reason = llm.engine.load_stats.reason
    assert "model['weights'].layers[0].qkv_bias: a numpy array of dtype object" in reason
    assert entries(tmp_path) == []


# ---- concurrent builders ---------------------------------------------------------------------------------

def _build_in_child(model_dir: str, cache: str, barrier, results) -> None:
    write = planned_load.write_entry

    def write_together(*args):
        barrier.wait(timeout=300)  # both have loaded and planned: they write the same entry at once
        return write(*args)

    planned_load.write_entry = write_together
    llm = load(model_dir, Path(cache))
    results.put((outcome(llm), llm.score(PROMPT)))


def test_concurrent_builders_leave_one_valid_entry(llama_dir, tmp_path, monkeypatch):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    children = [ctx.Process(target=_build_in_child, args=(str(llama_dir), str(tmp_path), barrier, results))
                for _ in range(2)]
    for child in children:
        child.start()
    built = [results.get(timeout=600) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert [o for o, _ in built] == ["built", "built"]
    assert len(entries(tmp_path)) == 1 and not list(tmp_path.glob(".*.tmp"))
    no_loading_or_repacking(monkeypatch)
    hit = load(llama_dir, tmp_path)
    assert outcome(hit) == "hit"
    for _, logits in built:
        assert np.array_equal(hit.score(PROMPT), logits)


# ---- pruning ---------------------------------------------------------------------------------------------

def test_pruning_removes_the_least_recently_used_entries_past_the_budget(llama_dir, tmp_path):
    cache = tmp_path / "cache"
    a = Path(load(llama_dir, cache).engine.load_stats.entry)
    b = Path(load(llama_dir, cache, weight_dtype="q4_0").engine.load_stats.entry)
    now = time.time()
    os.utime(a, (now - 100, now - 100))
    os.utime(b, (now - 50, now - 50))
    assert outcome(load(llama_dir, cache)) == "hit"  # a is now the most recently used
    other = tmp_path / "other"
    from tests.support.model_factory import build_model
    build_model(other, "llama", seed=9)  # an entry of a's size
    budget = 2 * a.stat().st_size + b.stat().st_size // 2
    dead, live = cache / ".dead-writer.tmp", cache / ".live-writer.tmp"
    for temp in (dead, live):
        temp.write_bytes(b"partial")
    os.utime(dead, (now - 7200, now - 7200))
    c = load(other, cache, packed_cache_bytes=budget)
    assert outcome(c) == "built" and "removed 1 least recently used" in c.engine.load_stats.reason
    assert entries(cache) == sorted([a, Path(c.engine.load_stats.entry)])
    assert not dead.exists() and live.exists()  # a temp file untouched for an hour is a dead writer's


# ---- the config ------------------------------------------------------------------------------------------

def test_the_cache_is_off_in_the_tests_and_its_directory_comes_from_the_environment(llama_dir, monkeypatch):
    assert EngineConfig().packed_cache_dir is None  # tests/conftest.py
    llm = ns.LLM(llama_dir, max_model_len=128)
    assert outcome(llm) == "off"
    assert [d["choice"] for d in llm.diagnostics() if d["topic"] == "packed_cache"] == ["off"]
    monkeypatch.setenv("NUMASERVE_CACHE_DIR", "/somewhere")
    assert EngineConfig().packed_cache_dir == "/somewhere"
    monkeypatch.delenv("NUMASERVE_CACHE_DIR")
    assert EngineConfig().packed_cache_dir == "~/.cache/numaserve/packed"
    assert EngineConfig(packed_cache_dir="off").packed_cache_dir is None


# ---- the tree --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackedLike:
    """What a new matrix class looks like: arrays and ints, in a frozen dataclass."""

    qs: np.ndarray
    scales: np.ndarray
    shape: tuple[int, int]
    block: int


def test_a_new_container_class_round_trips_with_its_arrays_and_shared_objects():
    rng = np.random.default_rng(0)
    m = PackedLike(rng.integers(0, 255, (4, 144), dtype=np.uint8), rng.random((4, 1), np.float32), (4, 256),
                   256)
    tree, arrays = flatten({"pair": (m, m), "odd": np.arange(7, dtype=np.int8)[::2], "f": np.float32(0.1),
                            "0-d": np.array(2.5, np.float32)})
    back = unflatten(json.loads(json.dumps(tree)), arrays)
    assert back["0-d"].shape == () and back["0-d"] == np.float32(2.5)
    first, second = back["pair"]
    assert first is second and isinstance(first, PackedLike)
    assert first.shape == (4, 256) and first.block == 256
    assert np.array_equal(first.qs, m.qs) and np.array_equal(first.scales, m.scales)
    assert np.array_equal(back["odd"], [0, 2, 4, 6]) and back["f"] == np.float32(0.1)
    assert type(back["f"]) is np.float32


@pytest.mark.parametrize("value, where", [
    (lambda: 0, "model['x']: a builtins.function"),
    ({1: 2}, "model['x']: a dict with keys that are not str"),
    (np.array([None]), "model['x']: a numpy array of dtype object")])
def test_what_cannot_be_stored_is_refused_naming_where(value, where):
    with pytest.raises(Unstorable, match=rf"^{where}".replace("[", r"\[").replace("]", r"\]")):
        flatten({"x": value})


def test_a_tree_cannot_name_a_class_outside_numaserve():
    with pytest.raises(ValueError, match="refusing to import"):
        unflatten({"dataclass": "antigravity_not_loaded:X", "fields": {}}, [])



@pytest.mark.parametrize("setting, on_one_node, on_two_nodes", [("auto", "auto", False), (True, True, True),
                                                               (False, False, False)])
def test_on_several_numa_nodes_an_entry_is_mapped_only_when_asked_to(setting, on_one_node, on_two_nodes):
    # "auto" reads a copy next to each node's cores; True maps (one worker per entry: a tensor-parallel
    # group's ranks), the mapping then bound to the worker's node (models/packed/file.py)
    config = EngineConfig(map_packed_weights=setting)
    one, two = [NumaNode(0, (0, 1))], [NumaNode(0, (0,)), NumaNode(1, (1,))]
    assert planned_load.maps_entries(config, one) == on_one_node
    assert planned_load.maps_entries(config, two) == on_two_nodes
