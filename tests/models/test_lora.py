"""LoRA adapters in PEFT format: exact against peft, mixed in one batch, bad adapters refused."""

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

import numaserve as ns
from models.lora.slots import LoraSlots
from scheduling.lora.merge_policy import MergeMeter
from tests.conftest import random_prompt
from tests.models.test_hf_parity import hf_logits

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}


def make_adapter(base_dir, out_dir, seed, modules=ALL_MODULES, r=4, alpha=8, rslora=False, **config):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=modules,
                                                  use_rslora=rslora, lora_dropout=0.0, **config))
    torch.manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero (a no-op adapter): make it do something
            p.data.normal_(0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(llama_dir, root / "a", seed=1),
            "b": make_adapter(llama_dir, root / "b", seed=2, modules=["q_proj", "v_proj"], r=8, alpha=4),
            "rs": make_adapter(llama_dir, root / "rs", seed=3, rslora=True),
            "c": make_adapter(llama_dir, root / "c", seed=4, modules=["q_proj", "o_proj", "down_proj"],
                              alpha=16)}


def peft_reference(llama_dir, adapter_dir):
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def two_versions(base_dir, root, seed: int) -> dict:
    """Two adapters' directories, "old" and "new" (other weights, another rank): one name's two versions."""
    return {"old": make_adapter(base_dir, root / "old", seed=seed),
            "new": make_adapter(base_dir, root / "new", seed=seed + 1, r=8)}


def peft_greedy(base_dir, adapter_dirs: dict, prompts: list[list[int]], n: int) -> dict:
    """{key: PEFT's greedy tokens for each prompt} over each adapter directory."""
    from tests.models.test_hf_parity import hf_greedy
    return {key: [hf_greedy(model, p, n) for p in prompts]
            for key, model in ((k, peft_reference(base_dir, d)) for k, d in adapter_dirs.items())}


@pytest.fixture(scope="module")
def llm(module_llm, llama_dir, adapters):
    llm = module_llm(llama_dir, **FP32)
    for name, path in adapters.items():
        llm.register_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def merged_llm(module_llm, llama_dir, adapters):
    """The same adapters on the merged path: every step runs its adapter's rows on a merged copy."""
    llm = module_llm(llama_dir, **FP32, lora_merge="always")
    for name, path in adapters.items():
        llm.register_adapter(name, path)
    return llm


@pytest.fixture(params=["lowrank", "merged"])
def either(request, llm, merged_llm):
    return llm if request.param == "lowrank" else merged_llm


@pytest.mark.parametrize("name", ["a", "b", "rs"])
def test_adapter_logits_match_peft(either, llama_dir, adapters, name, hf_models):
    tokens = random_prompt(40, seed=5)
    ref = hf_logits(peft_reference(llama_dir, adapters[name]), tokens)
    merged_before = either.stats()["num_merged_tokens"]
    got = either.score(tokens, adapter=name)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert np.abs(got - hf_logits(hf_models["llama"], tokens)).max() > 0.1  # the adapter does change logits
    assert either.stats()["num_merged_tokens"] - merged_before == (40 if either.config.lora_merge == "always"
                                                                   else 0)


# per-module ranks and alphas, matched as PEFT does: a bare module name, a dotted suffix, a regular expression
PATTERNS = {"rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6, r"layers\.[01]\.self_attn\.o_proj": 3},
            "alpha_pattern": {"v_proj": 32, r"model\.layers\.0\.self_attn\.o_proj": 3, "up_proj": 1.5}}
SUBSET = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("merge", ["never", "always"])
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha_over_r", "rslora"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "mistral"])
def test_rank_and_alpha_patterns_match_peft(model_dirs, hf_models, tmp_path, variant, rslora, merge):
    base = model_dirs[variant]
    path = make_adapter(base, tmp_path / "patterned", seed=7, modules=SUBSET, rslora=rslora, **PATTERNS)
    llm = ns.LLM(base, **FP32, lora_merge=merge)
    llm.register_adapter("patterned", path)
    modules = llm.engine.adapters["patterned"].layers
    assert {m: lora.rank for m, lora in modules[1].items()} == {"q_proj": 2, "v_proj": 4, "o_proj": 3,
                                                              "up_proj": 4, "down_proj": 6}
    tokens = random_prompt(40, seed=6)
    got = llm.score(tokens, adapter="patterned")
    np.testing.assert_allclose(got, hf_logits(peft_reference(base, path), tokens), atol=1e-4, rtol=0)
    assert np.abs(got - hf_logits(hf_models[variant], tokens)).max() > 0.1


def peft_composed(llama_dir, adapters, weights: dict, combination: str):
    """PEFT's add_weighted_adapter over the named adapters, the composed adapter active."""
    from transformers import AutoModelForCausalLM
    names = list(weights)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32),
                                      adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    model.add_weighted_adapter(names, list(weights.values()), "mix", combination_type=combination)
    model.set_adapter("mix")
    return model.eval()


@pytest.mark.parametrize("combination, weights", [
    ("cat", {"a": 0.7, "b": 0.3}),  # ranks 4 + 8, different modules
    ("cat", {"rs": 0.3, "c": 0.4}),  # the first uses rsLoRA: PEFT scales the result by sqrt(r) (weights that
    # amplify it 17x put both float32 implementations 2e-4 from float64, past the tolerance)
    ("linear", {"a": 0.6, "c": -0.4}),  # cross terms; a negative weight
    ("linear", {"b": 1.3}),
    ("svd", {"a": 0.7, "b": -0.3, "c": 0.5}),
])
def test_composed_adapters_match_peft_add_weighted_adapter(either, llama_dir, adapters, combination, weights):
    name = f"{combination}-{'-'.join(weights)}"
    either.compose_adapter(name, weights, combination=combination)
    tokens = random_prompt(40, seed=8)
    got = either.score(tokens, adapter=name)
    np.testing.assert_allclose(got, hf_logits(peft_composed(llama_dir, adapters, weights, combination),
                                              tokens),
                               atol=1e-4, rtol=0)
    assert np.abs(got - either.score(tokens, adapter=next(iter(weights)))).max() > 0.1


@pytest.mark.parametrize("weights, combination, message", [
    ({"a": 0.5, "b": 0.5}, "linear", "one rank"),
    ({"a": 0.5, "nope": 0.5}, "svd", "unknown adapters"),
    ({}, "svd", "weights must map"),
    ({"a": float("nan")}, "cat", "finite number"),
    ({"a": 1.0}, "ties", "not supported"),
    ({"a": 1.0, "b": 1.0, "c": 1.0}, "cat", "max_lora_rank=12"),
])
def test_bad_compositions_raise_adapter_error(llama_dir, adapters, weights, combination, message):
    llm = ns.LLM(llama_dir, **FP32, max_lora_rank=12)
    for name in "abc":
        llm.register_adapter(name, adapters[name])
    with pytest.raises(ns.AdapterError, match=message):
        llm.compose_adapter("mix", weights, combination=combination)
    assert "mix" not in llm.engine.adapters
    llm.compose_adapter("mix", {"a": 1.0, "c": 1.0}, combination="cat")  # the name is still free


@pytest.mark.parametrize("variant, weight_dtype, stored", [
    ("llama", "bfloat16", "bfloat16"),
    ("llama", "q8_0", "bfloat16"),  # its k/v projections are 48 wide: not whole 32-column blocks
    ("mistral", "q8_0", "q8_0"),
    ("mistral", "q4_0", "q8_0"),
])
def test_rounded_adapter_slots_change_the_adapters_effect_by_little(model_dirs, tmp_path, variant,
                                                                    weight_dtype, stored):
    """Off float32 an engine stores A and B like its base weights (models/lora/slots.py). Against the same
    engine with float32 slots, the adapter's effect on the logits moves by 1.0% (bf16 slots) and 1.6-2.0%
    (q8_0 slots) of its largest value here: the rounding, carried through two random layers."""
    adapter_dir = make_adapter(model_dirs[variant], tmp_path / "adapter", seed=11, r=8, alpha=16)

    def adapter_effect(slot_dtype: str | None) -> np.ndarray:
        engine = ns.LLM(model_dirs[variant], weight_dtype=weight_dtype, kv_dtype="float32",
                        activation_dtype="float32")
        if slot_dtype is not None:
            engine.engine.runner.lora.slots = LoraSlots(engine.engine.spec, 4, 64, slot_dtype)
        assert engine.engine.runner.lora.slots.dtype == (slot_dtype or stored)
        engine.register_adapter("x", adapter_dir)
        return engine.score(tokens, adapter="x") - engine.score(tokens)

    tokens = random_prompt(40, seed=5)
    exact, rounded = adapter_effect("float32"), adapter_effect(None)
    error = np.abs(rounded - exact).max() / np.abs(exact).max()
    assert 0 < error < 0.05, error


def test_mixed_adapters_in_one_batch_equal_each_alone(llm):
    greedy = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [random_prompt(n, seed=n) for n in (5, 30, 17, 8)]
    names = ["a", None, "b", "a"]
    alone = [llm.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)]
    # one submission: the four run in the same steps, on the loop thread (this thread stepping the engine
    # could race the loop, which steps whatever the engine holds once generate's last output is delivered)
    together = llm.engine_loop.run([llm.engine.make_request(f"mix{i}", p, greedy, adapter=n) for i, (p, n) in
                                    enumerate(zip(prompts, names))])
    assert [r.output_token_ids for r in together] == alone
    assert alone[0] != llm.generate(prompts[0], greedy)[0].token_ids


def test_one_generate_call_with_an_adapter_per_prompt_equals_each_alone_on_both_paths(either):
    llm = either
    greedy = ns.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [random_prompt(n, seed=40 + n) for n in (6, 21, 3, 14, 9, 30, 12)]
    names = ["a", None, "b", "rs", "c", "a", None]
    alone = [llm.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)]
    assert [o.token_ids for o in llm.generate(prompts, greedy, adapter=names)] == alone
    assert len({tuple(llm.generate(prompts[0], greedy, adapter=n)[0].token_ids)
                for n in ("a", "b", None)}) == 3
    with pytest.raises(ns.InvalidRequest, match="2 adapter for 7 prompts"):
        llm.generate(prompts, greedy, adapter=["a", "b"])
    with pytest.raises(ns.InvalidRequest, match="unknown adapter 'zz'"):
        llm.generate(prompts, greedy, adapter=["a", "zz", None, None, None, None, None])
    with pytest.raises(ns.InvalidRequest, match="adapter must be an adapter name"):
        llm.generate(prompts, greedy, adapter=3)
    assert not llm.engine.has_unfinished()
    stats = llm.stats()
    if llm.config.lora_merge == "always":  # every adapted row ran on its adapter's merged copy
        assert stats["num_merged_tokens"] > 0 and stats["num_lora_tokens"] == 0
        assert set(stats["lora_merged_held"]) >= {"a", "b", "rs", "c"}


def weights_checksum(weights) -> str:
    """sha256 over every array of the model's weights, in a fixed order."""
    digest = hashlib.sha256()

    def walk(w):
        if dataclasses.is_dataclass(w):  # ModelWeights, LayerWeights, a matrix: its arrays in field order
            for f in dataclasses.fields(w):
                walk(getattr(w, f.name))
        elif isinstance(w, list | tuple):
            for v in w:
                walk(v)
        elif isinstance(w, np.ndarray):
            digest.update(w.tobytes())
    walk(weights)
    return digest.hexdigest()


def test_more_adapters_than_slots_evict_and_stay_exact(llm, llama_dir, adapters):
    """max_loras=2: three adapters in turn evict each other, a batch of four adapters runs at most two at a
    time, and every request gets the tokens it gets from the engine with a slot for each adapter."""
    greedy = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    small = ns.LLM(llama_dir, **FP32, max_loras=2)
    for name in ("a", "b", "c", "rs"):
        small.register_adapter(name, adapters[name])
    before = weights_checksum(small.engine.model.weights)
    prompts = [random_prompt(n, seed=60 + n) for n in (7, 12, 5, 18, 9, 11)]
    names = ["a", "b", "c", "a", None, "rs"]
    expected = [llm.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)]
    assert [small.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)] == expected
    stats = small.stats()
    assert stats["lora_slot_evictions"] >= 3 and stats["lora_slot_misses"] == stats["lora_slot_evictions"] + 2
    assert stats["lora_slot_hits"] > 0 and len(stats["lora_slots_held"]) == 2
    # 4 adapters, 2 slots
    assert [o.token_ids for o in small.generate(prompts, greedy, adapter=names)] == expected
    assert weights_checksum(small.engine.model.weights) == before


def test_merged_copies_are_bounded_in_bytes_and_leave_the_base_weights_alone(llm, llama_dir, adapters):
    greedy = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    probe = ns.LLM(llama_dir, **FP32, lora_merge="always")
    probe.register_adapter("a", adapters["a"])
    probe.generate([5, 6, 7], greedy, adapter="a")
    one_copy = probe.stats()["lora_merged_bytes"]  # a, all seven modules: a copy of every projection
    merged = ns.LLM(llama_dir, **FP32, lora_merge="always", lora_merged_bytes=one_copy)
    for name in ("a", "c", "rs"):
        merged.register_adapter(name, adapters[name])
    before = weights_checksum(merged.engine.model.weights)
    prompts = [random_prompt(n, seed=90 + n) for n in (5, 9, 13, 7)]
    names = ["a", "c", "rs", "a"]
    expected = [llm.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)]
    assert [merged.generate(p, greedy, adapter=n)[0].token_ids for p, n in zip(prompts, names)] == expected
    stats = merged.stats()
    assert stats["lora_merged_builds"] == 4 and stats["lora_merged_evictions"] >= 2  # "a" built again
    assert stats["lora_merged_bytes"] <= one_copy and stats["num_lora_tokens"] == 0
    assert weights_checksum(merged.engine.model.weights) == before


@pytest.fixture
def fixed_merge_costs(monkeypatch):
    """lora_merge "auto" decides from measured seconds, which differ from machine to machine (a fast box's
    low-rank rows may never pay for a copy). Here each step is charged fixed costs instead: 1 ms per low-rank
    row, 0.5 ms a weight pass (a build keeps its prior, the weights' bytes at BUILD_BYTES_PER_S), so a burst
    of one adapter pays for its copy after BURST_STEPS steps on every machine alike."""
    observe = MergeMeter.observe

    def charged(self, lowrank_rows, lowrank_s, num_rows, linear_s, small_step_rows=32):
        observe(self, lowrank_rows, 1e-3 * lowrank_rows, num_rows, 5e-4, small_step_rows)
    monkeypatch.setattr(MergeMeter, "observe", charged)
    monkeypatch.setattr(MergeMeter, "built", lambda self, seconds: None)


@pytest.mark.load_sensitive
def test_auto_merges_a_single_adapter_burst_once_the_measured_savings_pay_for_the_copy(llm, llama_dir,
                                                                                       adapters,
                                                                                       fixed_merge_costs):
    greedy = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    auto = ns.LLM(llama_dir, **FP32, lora_merge="auto")
    auto.register_adapter("a", adapters["a"])
    prompt = random_prompt(7, seed=77)
    assert (auto.generate(prompt, greedy, adapter="a")[0].token_ids
            == llm.generate(prompt, greedy, adapter="a")[0].token_ids)
    stats = auto.stats()
    # the first steps run low-rank (and are measured), then the burst pays for a copy and runs on it
    assert (stats["lora_merged_builds"] == 1 and stats["num_lora_tokens"] >= 8
            and stats["num_merged_tokens"] > 0)
    assert stats["lora_lowrank_s_per_row"] > 0 and stats["lora_merged_build_s"] > 0
    mixed = auto.generate([prompt, random_prompt(9, seed=78)], greedy, adapter=["a", None])
    assert mixed[0].token_ids == llm.generate(prompt, greedy, adapter="a")[0].token_ids


def test_the_same_adapter_again_hits_its_slot(llama_dir, adapters):
    llm = ns.LLM(llama_dir, **FP32, max_loras=2)
    llm.register_adapter("a", adapters["a"])
    params = ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([5, 6, 7], params, adapter="a")
    first = llm.stats()
    llm.generate([8, 9], params, adapter="a")
    second = llm.stats()
    assert first["lora_slot_misses"] == second["lora_slot_misses"] == 1 and second["lora_slot_evictions"] == 0
    assert second["lora_slot_hits"] > first["lora_slot_hits"]
    assert second["num_lora_tokens"] == first["num_lora_tokens"] + 2 + 3  # two prompt rows, three decode rows


def test_registration_is_confined_to_adapter_roots(llama_dir, adapters, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(adapters["a"], root / "a")
    shutil.copytree(adapters["c"], root / "c")
    shutil.copytree(adapters["a"], outside)
    (root / "link").symlink_to(outside, target_is_directory=True)
    llm = ns.LLM(llama_dir, **FP32, adapter_roots=[str(root)])
    llm.register_adapter("a", root / "sub" / ".." / "a")
    for path in (outside, root / ".." / "outside", root / "link"):
        with pytest.raises(ns.AdapterError, match="outside adapter_roots"):
            llm.register_adapter("x", path)
    llm.register_adapter("a", root / "a")  # the same directory again: a no-op
    assert llm.engine.adapters.resolve("a") == "a"
    llm.register_adapter("a", root / "c")  # other weights under a served name: its next version
    assert llm.engine.adapters.resolve("a") == "a@2"


def test_a_rank_above_max_lora_rank_is_refused(llama_dir, adapters):
    llm = ns.LLM(llama_dir, **FP32, max_lora_rank=4)
    llm.register_adapter("a", adapters["a"])
    with pytest.raises(ns.AdapterError, match="rank 8, above max_lora_rank=4"):
        llm.register_adapter("b", adapters["b"])


def test_requests_with_different_adapters_do_not_share_prefix_blocks(llm):
    prompt = random_prompt(64, seed=9)
    params = ns.SamplingParams(max_tokens=1)
    done = []
    for i, adapter in enumerate(["a", "b", "a"]):  # one after another: blocks commit after their step
        done.append(llm.engine.add_request(f"p{i}", prompt, params, adapter=adapter))
        while llm.engine.has_unfinished():
            llm.engine.step()
    first, second, third = done
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 0 and third.num_cached_tokens == 48


@pytest.mark.parametrize("breakage, message", [
    ("no_dir", "not a directory"),
    ("no_config", "adapter_config.json: missing"),
    ("bad_json", "not valid JSON"),
    ("not_lora", "only LORA"),
    ("pickle", "pickled"),
    ("bad_shape", "trained for another base model"),
    ("foreign_key", "does not adapt a supported module"),
    ("dora", "use_dora=True: DoRA"),
    ("lora_bias", "lora_bias=True"),
    ("modules_to_save", "modules_to_save"),
    ("bad_pattern", "rank_pattern must map"),
])
def test_bad_adapters_raise_adapter_error_and_engine_keeps_serving(llm, adapters, tmp_path, breakage,
                                                                   message):
    d = tmp_path / "adapter"
    shutil.copytree(adapters["a"], d)
    config = json.loads((d / "adapter_config.json").read_text())
    if breakage == "no_dir":
        d = tmp_path / "nowhere"
    elif breakage == "no_config":
        (d / "adapter_config.json").unlink()
    elif breakage == "bad_json":
        (d / "adapter_config.json").write_text("{")
    elif breakage == "not_lora":
        (d / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    elif breakage in ("dora", "lora_bias"):
        (d / "adapter_config.json").write_text(json.dumps(config | {f"use_{breakage}" if breakage == "dora"
                                                                   else breakage: True}))
    elif breakage == "modules_to_save":
        (d / "adapter_config.json").write_text(json.dumps(config | {"modules_to_save": ["lm_head"]}))
    elif breakage == "bad_pattern":
        (d / "adapter_config.json").write_text(json.dumps(config | {"rank_pattern": {"q_proj": "four"}}))
    elif breakage == "pickle":
        (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")
    else:
        from safetensors.torch import load_file, save_file
        tensors = load_file(d / "adapter_model.safetensors")
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        if breakage == "bad_shape":
            tensors[key] = torch.zeros(4, 10)
        else:
            tensors[key.replace("self_attn.q_proj", "self_attn.rotary")] = tensors.pop(key)
        save_file(tensors, d / "adapter_model.safetensors")
    with pytest.raises(ns.AdapterError, match=message):
        llm.register_adapter("broken", d)
    with pytest.raises(ns.InvalidRequest, match="unknown adapter 'broken'"):
        llm.generate([5, 6], ns.SamplingParams(max_tokens=2), adapter="broken")
    served = ns.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)  # unseeded sampling may draw EOS
    assert llm.generate([5, 6], served, adapter="a")[0].finish_reason == "length"


def test_adapter_name_must_be_a_non_empty_string(llm, adapters):
    with pytest.raises(ns.AdapterError, match="non-empty string"):
        llm.register_adapter("", adapters["a"])
