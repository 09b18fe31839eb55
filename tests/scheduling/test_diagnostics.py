"""Decision diagnostics: a configuration -> the decisions it implies (kernel and dtypes per layer type, the
fallback when an instruction set is hidden, adapter paths, preemptions, speculation depth), recorded as
changes with repeats counted, in a ring that stays bounded."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numaserve as ns
from cluster_configs.diagnostics import DecisionLog
from kernels.linear.chunking import linear_tiles
from memory.weights import PROJECTIONS
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
GREEDY = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def decisions(llm, topic: str) -> list[dict]:
    return [d for d in llm.diagnostics() if d["topic"] == topic]


def kernels(llm) -> dict[str, tuple[str, str]]:
    return {d["subject"]: (d["choice"], d["reason"]) for d in decisions(llm, "kernel")}


# ---- the log ------------------------------------------------------------------------------------

def test_a_repeated_choice_counts_on_its_entry_and_a_change_adds_one():
    log = DecisionLog()
    for depth in (2, 2, 2, 3, 3, 2):
        log.record("speculation", f"depth {depth}", f"why {depth}", subject="depth")
    log.record("lora_path", "merged", "fits", subject="a")
    assert [(d["choice"], d["count"]) for d in log.recent("speculation")] == [("depth 2", 3), ("depth 3", 2),
                                                                             ("depth 2", 1)]
    assert [(d["subject"], d["choice"], d["count"]) for d in log.recent("lora_path")] == [("a", "merged", 1)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), max_size=300))
def test_the_ring_stays_bounded_and_counts_every_record_it_still_holds(maxlen, records):
    log = DecisionLog(maxlen)
    for subject, choice in records:
        log.record("t", f"c{choice}", "", subject=f"s{subject}")
    held = log.recent()
    assert len(held) <= maxlen and len(log._latest) <= maxlen
    # the entries held are the last len(held) runs of equal choices per subject, oldest first
    runs: list[list] = []
    last_run: dict[str, list] = {}
    for subject, choice in records:
        run = last_run.get(subject)
        if run is not None and run[1] == f"c{choice}" and run in runs[-maxlen:]:
            run[2] += 1
        else:
            run = [f"s{subject}", f"c{choice}", 1]
            runs.append(run)
            last_run[subject] = run
    assert [[d["subject"], d["choice"], d["count"]] for d in held] == runs[-maxlen:]


def test_a_ring_of_no_entries_is_refused():
    with pytest.raises(ValueError, match="maxlen=0"):
        DecisionLog(0)


# ---- kernels and fallbacks ----------------------------------------------------------------------

def test_kernel_and_dtypes_per_layer_type_follow_the_weight_format(llama_dir):
    llm = ns.LLM(llama_dir, **FP32)
    n = llm.engine.spec.num_layers
    assert kernels(llm) == {key: ("matmul: float32 weights x float32 activations", f"{n} of {n} layers")
                            for key in PROJECTIONS} | {
        "lm_head": ("matmul: float32 weights x float32 activations", "the LM head")}
    tiles = linear_tiles()  # this CPU's (tests/kernels/test_linear_tiles.py)
    assert [(d["choice"], d["reason"]) for d in llm.diagnostics() if d["topic"] == "tiles"] == [
        (f"x chunk {tiles.x_chunk_bytes >> 10} KiB", tiles.why)]


def test_int8_activations_run_the_int8_kernel_on_q8_0_weights(llama_dir, monkeypatch):
    monkeypatch.delenv("NUMASERVE_DISABLE_CPU_FEATURES", raising=False)
    from kernels.simd.cpu import missing_features
    if missing_features(("avx2", "f16c")):
        pytest.skip("this CPU lacks avx2/f16c: int8 activations always fall back here")
    llm = ns.LLM(llama_dir, weight_dtype="q8_0", activation_dtype="int8")
    n = llm.engine.spec.num_layers
    kernel = "matmul_int8" if missing_features(("avx512vnni", "avx512vl")) else "matmul_vnni"
    expected = {key: (f"{kernel}: q8_0 weights x int8 activations", f"{n} of {n} layers")
                for key in PROJECTIONS}
    assert {k: v for k, v in kernels(llm).items() if k != "lm_head"} == expected


def test_hiding_vnni_runs_the_avx2_int8_kernel(llama_dir, monkeypatch):
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx512vnni")
    from kernels.simd.cpu import missing_features
    if missing_features(("avx2", "f16c")):
        pytest.skip("this CPU lacks avx2/f16c: int8 activations always fall back here")
    llm = ns.LLM(llama_dir, weight_dtype="q8_0", activation_dtype="int8")
    assert ({v[0] for k, v in kernels(llm).items() if k != "lm_head"}
            == {"matmul_int8: q8_0 weights x int8 activations"})


def test_hiding_avx2_records_the_float32_fallback_and_its_kernels(llama_dir, monkeypatch, caplog):
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx2")
    llm = ns.LLM(llama_dir, weight_dtype="q8_0", activation_dtype="int8")
    [fallback] = decisions(llm, "activation_dtype")
    assert fallback["choice"] == "float32"
    assert "activation_dtype=int8 but this CPU lacks avx2" in fallback["reason"]
    assert "this CPU lacks avx2" in caplog.text  # an explicit request that falls back also warns
    n = llm.engine.spec.num_layers
    assert {k: v for k, v in kernels(llm).items() if k != "lm_head"} == {
        key: ("matmul: q8_0 weights x float32 activations", f"{n} of {n} layers") for key in PROJECTIONS}


# ---- adapters, preemption, speculation ----------------------------------------------------------

@pytest.fixture(scope="module")
def adapter_dir(llama_dir, tmp_path_factory):
    return make_adapter(llama_dir, tmp_path_factory.mktemp("diag") / "a", seed=3)


@pytest.mark.parametrize("lora_merge, path", [("never", "low-rank"), ("always", "merged")])
def test_the_adapter_path_is_recorded_once_and_counted_per_step(llama_dir, adapter_dir, lora_merge, path):
    llm = ns.LLM(llama_dir, **FP32, lora_merge=lora_merge)
    llm.register_adapter("a", adapter_dir)
    llm.generate([random_prompt(12, seed=1), random_prompt(5, seed=2)], GREEDY, adapter=["a", None])
    [entry] = decisions(llm, "lora_path")
    assert (entry["subject"], entry["choice"]) == ("a", path)
    assert entry["reason"].startswith(f"lora_merge={lora_merge}: ")
    assert entry["count"] == GREEDY.max_tokens  # one prefill step and a decode step per further token


def test_each_preemption_is_recorded_against_its_request_with_the_reason(llama_dir):
    bytes_per_block = 4 * 2 * 2 * 2 * 24 * 4  # block_size * (k, v) * layers * kv_heads * head_dim * fp32
    engine = ns.LLM(llama_dir, **FP32, block_size=4, kv_cache_bytes=40 * bytes_per_block,
                    scheduling_policy="priority").engine
    params = ns.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for req_id, seed, priority in (("background", 2, 5), ("urgent", 1, 0)):
        engine.submit(engine.make_request(req_id, random_prompt(40, seed=seed),
                                          params.model_copy(update={"priority": priority})))
    while engine.has_unfinished():
        engine.step()
    preemptions = engine.decisions.recent("preemption")
    num_preemptions = engine.stats()["num_preemptions"]
    assert num_preemptions > 0
    assert {d["subject"] for d in preemptions} == {"background"}  # the lower priority is the one preempted
    assert sum(d["count"] for d in preemptions) == num_preemptions
    assert all(d["choice"] == "recompute" and "no free KV block" in d["reason"] for d in preemptions)


def test_speculation_depth_is_recorded_on_change_with_its_inputs(llama_dir):
    k = 3
    llm = ns.LLM(llama_dir, **FP32,
                 speculation={"method": "ngram", "num_speculative_tokens": k, "mode": "on"})
    prompt = random_prompt(6, seed=4) * 4  # repeats: the n-gram lookup finds drafts
    llm.generate(prompt, ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    depths = [d for d in decisions(llm, "speculation") if d["subject"] == "depth"]
    assert depths, llm.diagnostics()
    # changes only: repeats counted
    assert all(a["choice"] != b["choice"] for a, b in itertools.pairwise(depths))
    assert all(d["choice"].startswith("depth ") and 0 <= int(d["choice"].split()[1]) <= k for d in depths)
    assert all("mode on, policy from the engine: 1 decoding of" in d["reason"]
               and "acceptance EMA" in d["reason"] and "step cost" in d["reason"] for d in depths)
