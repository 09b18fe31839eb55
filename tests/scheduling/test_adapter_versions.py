"""Adapter versions in one engine: other weights registered under a served name are its next version; a
request admitted before finishes on the old weights (PEFT's over them), later ones get the new (PEFT's over
them); once no request uses the old version its slot, merged copy, weights and cached prefix blocks are gone.
Unloading a name refuses later requests naming it and forgets the version the same way."""

import pytest

import numaserve as ns
from scheduling.engine import Engine
from tests.conftest import random_prompt
from tests.models.test_lora import FP32, peft_greedy, two_versions

GREEDY = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def weights(llama_dir, tmp_path_factory):
    return two_versions(llama_dir, tmp_path_factory.mktemp("versions"), seed=11)


@pytest.fixture(scope="module")
def expected(llama_dir, weights):
    prompts = [random_prompt(21, seed=31), random_prompt(9, seed=32)]
    return prompts, peft_greedy(llama_dir, weights, prompts, GREEDY.max_tokens)


def run(engine: Engine, until) -> dict[str, list[int]]:
    """Step until until() holds; -> the tokens each request got meanwhile."""
    tokens: dict[str, list[int]] = {}
    while not until():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def held(engine: Engine) -> set[str]:
    """Every adapter id the engine still keeps something of."""
    stats = engine.stats()
    return (set(stats["lora_slots_held"]) | set(stats["lora_merged_held"]) | set(stats["adapters_loaded"])
            | {key[2][0] for key in engine.scheduler.kv.pool.block_key if key})


@pytest.mark.parametrize("lora_merge", ["never", "always"])
def test_a_new_version_serves_new_requests_while_one_admitted_before_finishes_on_the_old(
        llama_dir, weights, expected, lora_merge):
    prompts, want = expected
    engine = Engine(llama_dir, ns.EngineConfig(**FP32, lora_merge=lora_merge, block_size=4))
    engine.register_adapter("t", weights["old"])
    first = engine.add_request("first", prompts[0], GREEDY, adapter="t")
    tokens = run(engine, lambda: len(first.output_token_ids) >= 3)  # mid-stream by construction
    engine.register_adapter("t", weights["new"])
    assert engine.adapters.resolve("t") == "t@2" and "t" in held(engine)  # the old one is in use
    second = engine.add_request("second", prompts[1], GREEDY, adapter="t")
    assert (first.adapter_id, second.adapter_id) == ("t", "t@2")
    for request_id, more in run(engine, lambda: not engine.has_unfinished()).items():
        tokens.setdefault(request_id, []).extend(more)
    assert tokens["first"] == want["old"][0] and tokens["second"] == want["new"][1]
    assert want["old"][0] != want["new"][0]  # the versions differ where it shows
    stats = engine.stats()
    assert "t" not in held(engine) and "t@2" in held(engine)
    assert stats["num_adapters_retired"] == 1 and stats["num_adapters_forgotten"] == 1
    assert stats["num_adapter_blocks_dropped"] == len(prompts[0] + want["old"][0]) // 4
    assert (stats["num_merged_tokens"] > 0) == (lora_merge == "always")

    engine.unload_adapter("t")
    with pytest.raises(ns.InvalidRequest, match="unknown adapter 't'"):
        engine.add_request("third", prompts[0], GREEDY, adapter="t")
    assert not held(engine) and engine.stats()["num_adapters_forgotten"] == 2
    engine.register_adapter("t", weights["old"])  # again: a new version, whatever its weights
    third = engine.add_request("third", prompts[0], GREEDY, adapter="t")
    assert third.adapter_id == "t@3" and run(engine, lambda: not engine.has_unfinished())["third"] == \
        want["old"][0]
    with pytest.raises(ns.AdapterError, match="no adapter is named 'zz'"):
        engine.unload_adapter("zz")


def test_an_unloaded_adapters_request_in_flight_finishes_then_the_version_is_forgotten(
        llama_dir, weights, expected):
    prompts, want = expected
    engine = Engine(llama_dir, ns.EngineConfig(**FP32, block_size=4))
    engine.register_adapter("t", weights["old"])
    engine.compose_adapter("mix", {"t": 1.0}, "cat")  # made of t's first version, whatever t becomes
    first = engine.add_request("first", prompts[0], GREEDY, adapter="t")
    run(engine, lambda: len(first.output_token_ids) >= 1)
    engine.unload_adapter("t")
    assert "t" in held(engine)
    run(engine, lambda: not engine.has_unfinished())
    assert first.output_token_ids == want["old"][0]
    assert engine.adapters.resolve("t") is None and "t" not in engine.stats()["lora_slots_held"]
    assert "t" in engine.adapters.state().retired  # mix is made of it: a restarted store still composes it
    mix = engine.add_request("mix", prompts[0], GREEDY, adapter="mix")
    run(engine, lambda: not engine.has_unfinished())
    assert mix.output_token_ids == want["old"][0]  # a rank-preserving "cat" of one adapter at weight 1


def test_a_request_resolved_before_its_version_was_forgotten_loads_it_again(llama_dir, weights, expected):
    # LLM.generate resolves the name on the caller's thread, submits on the loop's: a re-registration can
    # retire and forget the version in between
    prompts, want = expected
    engine = Engine(llama_dir, ns.EngineConfig(**FP32, block_size=4))
    engine.register_adapter("t", weights["old"])
    late = engine.make_request("late", prompts[0], GREEDY, adapter="t")
    engine.register_adapter("t", weights["new"])
    assert "t" not in held(engine) and engine.stats()["num_adapters_forgotten"] == 1  # nothing used it
    engine.submit(late)
    run(engine, lambda: not engine.has_unfinished())
    assert late.output_token_ids == want["old"][0] and "t" not in held(engine)  # forgotten again after it
