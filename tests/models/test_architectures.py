"""Every engine feature on every dense family added after Llama (models/architectures.py), through
numaserve.LLM: batching, chunked prefill, preemption and prefix caching change no greedy token; KV, weight
and activation dtypes stay close to float32 (weight formats exact against transformers on the same rounded
weights); n-gram and draft-model speculation give the tokens of none; PEFT LoRA adapters match peft (Phi-3's
on its fused projections); Phi-3 within its original context rotates by LongRoPE's short factors, as
transformers does; an EAGLE head (a Llama layer) drafts for a Qwen3 target, one of another layer is refused.
"""
import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import numaserve as ns
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import missing_features
from memory.matrices import WeightMatrix
from models.linear import dequantize
from models.model_spec import load_spec
from models.quantization.activation_plan import INT8_FEATURES
from models.quantization.quant_mix import lm_head_dtype
from scripts.head_modules import EagleHead
from tests.conftest import random_prompt
from tests.models.test_eagle import head_against_torch, random_head, save_head
from tests.models.test_hf_parity import hf_greedy, hf_logits
from tests.models.test_lora import make_adapter, peft_composed
from tests.scheduling.test_speculation import perturbed_copy

NEW = ("qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3")
# mixture of experts: every feature but LoRA on the MLP (tests/models/test_moe_model.py: on the attention,
# refusals)
WITH_MOE = NEW + ("qwen3_moe", "mixtral")
FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
GREEDY = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# the windowed layers (qwen3, gemma2/3) look back 8 tokens: most prompts cross a window; the last two repeat
# themselves, so that n-gram lookup drafts on every family
LENGTHS = (1, 70, 17, 40, 3, 29, 9)
PROMPTS = ([random_prompt(n, seed=100 + i) for i, n in enumerate(LENGTHS)]
           + [[5, 6, 7, 8, 9] * 6, random_prompt(12, seed=7) * 3])


def logit_scale(llm: ns.LLM) -> float:
    """How much more a rounding of a key moves attention scores here than on a plain rope: LongRoPE (Phi-3)
    scales cos and sin by its attention factor a, so every score q.k by a^2 (1.8 for the test variant)."""
    return max(r.attention_scaling for r in llm.engine.model.ropes) ** 2


@pytest.fixture(scope="module")
def alone(model_dirs):
    """variant -> each of PROMPTS generated alone (float32, no prefix cache): what every feature must give."""
    cache = {}

    def get(variant: str) -> list[list[int]]:
        if variant not in cache:
            llm = ns.LLM(model_dirs[variant], **FP32, enable_prefix_caching=False)
            cache[variant] = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
        return cache[variant]

    return get


# ---- batching, chunked prefill, preemption, prefix caching: the same greedy tokens ----------------------

def preempting_pool(model_dir) -> dict:
    """24 blocks of 4 tokens: the 70-token prompt's 82 tokens alone need 21, so the batch must preempt."""
    s = load_spec(model_dir)
    bytes_per_block = 4 * 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4  # (k, v), float32
    return {"block_size": 4, "kv_cache_bytes": 24 * bytes_per_block, "max_num_batched_tokens": 64}


@pytest.mark.parametrize("setup", ["batched", "chunked_prefill", "preempted"])
@pytest.mark.parametrize("variant", WITH_MOE)
def test_batched_chunked_and_preempted_runs_give_each_prompts_tokens_alone(variant, setup, model_dirs, alone):
    fields = {"batched": {"max_num_batched_tokens": 256},
              # chunks of 8 tokens: every prompt but the shortest prefills over several steps, mid-window
              "chunked_prefill": {"block_size": 4, "max_num_batched_tokens": 8},
              "preempted": preempting_pool(model_dirs[variant])}[setup]
    llm = ns.LLM(model_dirs[variant], **FP32, **fields)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone(variant)
    stats = llm.stats()
    if setup == "preempted":
        assert stats["num_blocks"] == 24 and stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("variant", WITH_MOE)
def test_a_prefix_cache_hit_gives_the_tokens_of_no_cache(variant, model_dirs):
    prefix = random_prompt(40, seed=11)  # past every window: the windowed layers read cached keys too
    first, second = prefix + random_prompt(7, seed=12), prefix + random_prompt(9, seed=13)
    reference = ns.LLM(model_dirs[variant], **FP32, enable_prefix_caching=False).generate(second, GREEDY)[0]
    engine = ns.LLM(model_dirs[variant], **FP32).engine
    requests = []
    for i, prompt in enumerate((first, second)):
        requests.append(engine.add_request(f"r{i}", prompt, GREEDY))
        while engine.has_unfinished():
            engine.step()
    assert [r.num_cached_tokens for r in requests] == [0, 32]  # 2 full blocks of 16 of the 40 shared tokens
    assert engine.stats()["prefix_hit_rate"] == pytest.approx(32 / (len(first) + len(second)))
    assert requests[1].output_token_ids == reference.token_ids


# ---- KV, weight and activation dtypes ---------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(model_dirs):
    """(variant, engine fields) -> one shared LLM (score only: no state a test could see)."""
    cache = {}

    def get(variant: str, **fields) -> ns.LLM:
        key = (variant, tuple(sorted(fields.items())))
        if key not in cache:
            cache[key] = ns.LLM(model_dirs[variant], **({"kv_dtype": "float32"} | fields))
        return cache[key]

    return get


def relative_errors(got: np.ndarray, exact: np.ndarray, rows=slice(None)) -> tuple[float, float]:
    """max and mean |got - exact| over the logit rows `rows`, in units of the exact logits' standard
    deviation."""
    err = np.abs(got[rows] - exact[rows]) / exact.std()
    return float(err.max()), float(err.mean())


def before_routing_differs(a: ns.LLM, b: ns.LLM) -> slice:
    """The rows of the two engines' last score (one forward each) before the first token whose experts some
    MoE layer chose differently: a rounding that tips a near-tie in a router swaps one of that token's
    experts, a jump in its MLP output (its logits move by up to 0.65 std here) that no rounding bound
    covers, and through attention it reaches every later row. Causal attention leaves the rows before it
    alone: they are held to the bound, and must be at least a quarter of them. A dense model: every row."""
    first = None
    for ids_a, ids_b in zip(a.engine.model.expert_log.last, b.engine.model.expert_log.last):
        if ids_a is not None:
            differs = np.flatnonzero((np.sort(ids_a, axis=1) != np.sort(ids_b, axis=1)).any(axis=1))
            first = min([first, *differs[:1]], key=lambda t: len(ids_a) if t is None else t)
            rows = len(ids_a)
    if first is None:
        return slice(None)
    assert first >= rows // 4, f"token {first} of {rows} routed differently"
    return slice(0, first)


# tests/scheduling/test_batching.py's bounds for Llama (max 0.06 / mean 0.01 for bf16, 0.2 / 0.03 for int8, on
# logits of std 1.2), in units of the logits' std, times logit_scale. Measured here, max / mean: bf16 <= 0.042
# / 0.0031 (Phi-3: 0.060 / 0.0053, its bounds 0.09 / 0.015), int8 <= 0.071 / 0.0087 (Phi-3: 0.118 / 0.0133)
KV_BOUNDS = {"bfloat16": (0.05, 0.0083), "int8": (0.167, 0.025)}


@pytest.mark.parametrize("kv_dtype", [*KV_BOUNDS, "auto"])
@pytest.mark.parametrize("variant", WITH_MOE)
def test_low_precision_kv_stays_close_to_float32(variant, kv_dtype, engines):
    """"auto" is the serving default: int8, held to int8's bounds."""
    tokens = random_prompt(120, seed=61)
    reference = engines(variant, weight_dtype="float32")
    exact = reference.score(tokens)
    low = engines(variant, weight_dtype="float32", kv_dtype=kv_dtype)
    stored = low.config.resolved_kv_dtype
    assert stored == ("int8" if kv_dtype == "auto" else kv_dtype)
    max_err, mean_err = relative_errors(low.score(tokens), exact, before_routing_differs(low, reference))
    bound_max, bound_mean = (b * logit_scale(low) for b in KV_BOUNDS[stored])
    assert 0 < max_err < bound_max and mean_err < bound_mean, (max_err, mean_err)


def served_rounding(hf_model, weight_dtype: str) -> torch.nn.Module:
    """A copy of an HF model whose matrices hold what numaserve serves in weight_dtype (every matrix
    rounded to it and back; the LM head, and a tied embedding, in lm_head_dtype), norms float32."""
    rounded = type(hf_model)(hf_model.config).eval()
    tied = hf_model.config.tie_word_embeddings
    state = {}
    for name, w in hf_model.state_dict().items():
        router = name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))  # served float32
        if w.ndim >= 2 and not router:  # experts: [E, N, K] (transformers 5 stacks them), rounded by rows
            head = name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight")
            rows = w.numpy().reshape(-1, w.shape[-1])
            w = torch.from_numpy(dequantize(WeightMatrix.from_float(
                rows, lm_head_dtype(weight_dtype) if head else weight_dtype)).reshape(w.shape))
        state[name] = w
    rounded.load_state_dict(state)
    return rounded


@pytest.fixture(scope="module")
def llama_errors(engines):
    """Llama's max and mean logit errors (relative_errors) under an engine's fields against a reference
    engine's: what the new families' rounding is bounded by (as many random layers, the same init)."""
    cache = {}

    def get(tokens: list[int], reference: dict, fields: dict) -> tuple[float, float]:
        key = (tuple(tokens), tuple(sorted(reference.items())), tuple(sorted(fields.items())))
        if key not in cache:
            cache[key] = relative_errors(engines("llama", **fields).score(tokens),
                                         engines("llama", **reference).score(tokens))
        return cache[key]

    return get


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "q8_0", "q4_0"])
@pytest.mark.parametrize("variant", WITH_MOE)
def test_weight_formats_match_hf_on_the_same_rounded_weights(variant, weight_dtype, engines, hf_models,
                                                            llama_errors):
    # With float32 activations the served matrices are exactly the rounded checkpoint values (q8_0 / q4_0:
    # GGML's blocks, tests/kernels/test_quant.py), so against HF in float32 on those values only summation
    # order differs: the float32 tolerance holds (tests/models/test_hf_parity.py does this for Llama's bf16
    # weights).
    tokens = random_prompt(60, seed=2)
    fields = {"weight_dtype": weight_dtype, "activation_dtype": "float32"}
    ours = engines(variant, **fields).score(tokens)
    np.testing.assert_allclose(ours, hf_logits(served_rounding(hf_models[variant], weight_dtype), tokens),
                               atol=1e-4, rtol=0)
    # What the rounding itself costs depends on the weights (the same random init as Llama's) and on how the
    # layers amplify it: at most twice Llama's mean error in logit stds (measured: 0.3-1.0x, Phi-3 1.3-1.4x).
    # (Llama's q4_0 error is large on these random weights: tests/kernels/test_quant.py bounds perplexity
    # instead.) A MoE model's weight rounding tips routers' near-ties within its first tokens here
    # (before_routing_ differs), which no bound of this kind covers: the exactness above is its check.
    if engines(variant, **fields).engine.spec.num_experts:
        return
    _, mean_err = relative_errors(ours, engines(variant, weight_dtype="float32").score(tokens))
    assert 0 < mean_err < 2 * llama_errors(tokens, {"weight_dtype": "float32"}, fields)[1]


@pytest.mark.parametrize("weight_dtype, activation_dtype", [("bfloat16", "bfloat16"), ("q8_0", "int8"),
                                                            ("q4_0", "int8")])
@pytest.mark.parametrize("variant", WITH_MOE)
def test_reduced_activations_stay_close_to_float32_activations(variant, weight_dtype, activation_dtype,
                                                               engines, llama_errors):
    # The same weights with float32 activations are the reference: the difference is the activations'
    # rounding alone. The Llama suite bounds it by perplexity on the trained demo model
    # (tests/models/test_activation_quality.py); on these random models its max and mean are held to twice
    # Llama's here, times logit_scale (measured: at most 1.1x Llama's, Phi-3 up to 2.0x against its 3.6x).
    tokens = random_prompt(60, seed=3)
    reference = {"weight_dtype": weight_dtype, "activation_dtype": "float32"}
    fields = {"weight_dtype": weight_dtype, "activation_dtype": activation_dtype}
    llm = engines(variant, **fields)
    chosen = {d["choice"] for d in llm.diagnostics() if d["topic"] == "activation_dtype"}
    missing = missing_features(BF16_FEATURES if activation_dtype == "bfloat16" else INT8_FEATURES)
    ran = "float32" if missing else activation_dtype
    assert chosen == {ran}  # every matrix, the LM head too (a CPU without the kernel: float32 fallback)
    exact = engines(variant, **reference)
    errors = relative_errors(llm.score(tokens), exact.score(tokens), before_routing_differs(llm, exact))
    bounds = llama_errors(tokens, reference, fields)
    assert all(e <= 2 * logit_scale(llm) * b for e, b in zip(errors, bounds)), (errors, bounds)
    assert (errors[0] > 0) == (ran != "float32")


# ---- speculation -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_dirs(model_dirs, tmp_path_factory):
    """variant -> a draft model of its family and vocabulary: its weights plus noise, so that some drafts
    pass and some not."""
    root = tmp_path_factory.mktemp("drafts")
    return {v: perturbed_copy(model_dirs[v], root / v, scale=0.3) for v in WITH_MOE}


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("variant", WITH_MOE)
def test_greedy_speculation_gives_the_tokens_of_none(variant, method, model_dirs, draft_dirs, alone):
    spec = {"method": method, "num_speculative_tokens": 4, "mode": "on"}
    if method == "draft":
        spec["draft_model"] = str(draft_dirs[variant])
    llm = ns.LLM(model_dirs[variant], **FP32, speculation=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone(variant)
    stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0, stats
    if method == "draft":
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    assert stats["num_free_blocks"] == stats["num_blocks"]


# ---- LoRA ------------------------------------------------------------------------------------------

# PEFT names a model's own linear layers: Phi-3's q|k|v and gate|up are single fused modules
TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dirs(model_dirs, tmp_path_factory):
    """variant -> a PEFT adapter on every projection, with a rank and an alpha pattern on (for Phi-3)
    fused modules, so that each module's rank and scaling are resolved by its own name."""
    root = tmp_path_factory.mktemp("arch_adapters")
    cache = {}

    def get(variant: str, seed: int = 1):
        if (variant, seed) not in cache:
            fused = variant == "phi3"
            cache[variant, seed] = make_adapter(
                model_dirs[variant], root / f"{variant}-{seed}", seed=seed,
                modules=TARGETS.get(variant, SEVEN),
                rank_pattern={"gate_up_proj" if fused else "up_proj": 2},
                alpha_pattern={"qkv_proj" if fused else "q_proj": 16})
        return cache[variant, seed]

    return get


@pytest.mark.parametrize("lora_merge", ["never", "always"])
@pytest.mark.parametrize("variant", NEW)
def test_adapter_logits_and_greedy_tokens_match_peft(variant, lora_merge, model_dirs, adapter_dirs,
                                                     hf_models):
    path = adapter_dirs(variant)
    base = AutoModelForCausalLM.from_pretrained(model_dirs[variant], dtype=torch.float32,
                                                attn_implementation="eager")
    peft = PeftModel.from_pretrained(base, path).eval()
    llm = ns.LLM(model_dirs[variant], **FP32, lora_merge=lora_merge)
    llm.register_adapter("a", path)
    tokens = random_prompt(40, seed=5)
    got = llm.score(tokens, adapter="a")
    np.testing.assert_allclose(got, hf_logits(peft, tokens), atol=1e-4, rtol=0)
    assert np.abs(got - hf_logits(hf_models[variant], tokens)).max() > 0.1  # the adapter does change logits
    # past Phi-3's original context: HF rotates by the long factors, as this engine (max_model_len 512) does
    prompts = [random_prompt(n, seed=20 + n) for n in (33, 45)]
    outs = llm.generate(prompts, GREEDY, adapter="a")
    assert [o.token_ids for o in outs] == [hf_greedy(peft, p, GREEDY.max_tokens) for p in prompts]
    assert (llm.stats()["num_merged_tokens"] > 0) == (lora_merge == "always")


@pytest.mark.parametrize("combination", ["cat", "svd"])
def test_composed_phi3_adapters_match_peft_on_its_fused_modules(combination, model_dirs, adapter_dirs):
    # PEFT composes a fused module as one matrix (svd: the best rank-R approximation of all of q|k|v's
    # delta, not of each part's): so does numaserve, which serves the result as the parts' rows
    d = model_dirs["phi3"]
    adapters = {"a": adapter_dirs("phi3", 1), "b": adapter_dirs("phi3", 2)}
    llm = ns.LLM(d, **FP32)
    for name, path in adapters.items():
        llm.register_adapter(name, path)
    weights = {"a": 0.7, "b": -0.4}
    llm.compose_adapter("mix", weights, combination=combination)
    tokens = random_prompt(40, seed=8)  # past the original context: the long factors, in HF as here
    np.testing.assert_allclose(llm.score(tokens, adapter="mix"),
                               hf_logits(peft_composed(d, adapters, weights, combination), tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant, renamed, supported", [
    ("phi3", ("qkv_proj", "q_proj"), "qkv_proj, o_proj, gate_up_proj, down_proj"),
    ("qwen3", ("q_proj", "qkv_proj"), ", ".join(SEVEN)),
])
def test_an_adapter_of_modules_the_model_does_not_have_is_refused_naming_the_ones_it_has(
        variant, renamed, supported, model_dirs, adapter_dirs, tmp_path):
    path = shutil.copytree(adapter_dirs(variant), tmp_path / "adapter")
    tensors = load_file(path / "adapter_model.safetensors")
    old, new = renamed
    save_file({k.replace(f".{old}.", f".{new}."): v for k, v in tensors.items()},
              path / "adapter_model.safetensors")
    llm = ns.LLM(model_dirs[variant], **FP32)
    architecture = load_spec(model_dirs[variant]).architecture
    with pytest.raises(ns.AdapterError, match=f"{new}.*{architecture} \\(target_modules {supported}\\)"):
        llm.register_adapter("x", path)


# ---- Phi-3 within its original context: LongRoPE's short factors --------------------------------------

def test_phi3_served_within_its_original_context_matches_hf(model_dirs, hf_models):
    hf = hf_models["phi3"]
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 32
    short = ns.LLM(model_dirs["phi3"], **FP32, max_model_len=32)
    tokens = random_prompt(32, seed=9)
    reference = hf_logits(hf, tokens)  # HF rotates a sequence of at most 32 tokens by the short factors
    np.testing.assert_allclose(short.score(tokens), reference, atol=1e-4, rtol=0)
    long = ns.LLM(model_dirs["phi3"], **FP32)  # served to 512 positions: the long factors
    assert np.abs(long.score(tokens) - reference).max() > 0.1
    prompts = [random_prompt(n, seed=30 + n) for n in (1, 9, 20)]
    params = [ns.SamplingParams(max_tokens=32 - len(p), temperature=0, ignore_eos=True) for p in prompts]
    outs = short.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 32 - len(p)) for p in prompts]


def test_a_phi3_self_draft_within_its_original_context_accepts_every_draft(model_dirs):
    # the draft model rotates by the target engine's factors (max_model_len), not by its own context's
    d = model_dirs["phi3"]
    llm = ns.LLM(d, **FP32, max_model_len=32, speculation={
        "method": "draft", "draft_model": str(d), "num_speculative_tokens": 4, "mode": "on"})
    llm.generate([random_prompt(n, seed=n) for n in (3, 10, 19)], GREEDY)
    stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0


# ---- EAGLE on a Qwen3 target -------------------------------------------------------------------------

EAGLE = {"method": "eagle", "num_speculative_tokens": 4, "mode": "on"}


def llama_layer_head(hf_config) -> EagleHead:
    """A random EAGLE head as numaserve runs one (models/proposers/eagle_head.py): a Llama decoder layer of
    the target's shape and first layer's rope, whatever the target's family."""
    c = hf_config
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=1,
                         intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                         rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_parameters["rope_theta"])
    return random_head(config)


def test_an_eagle_head_drafts_for_a_qwen3_target_and_changes_no_token(model_dirs, hf_models, tmp_path, alone):
    directory = shutil.copytree(model_dirs["qwen3"], tmp_path / "qwen3")
    hf = hf_models["qwen3"]
    # the head's forward against its torch module, over scattered KV blocks (head_dim 24 != hidden / heads)
    (hidden, logits), (expected, expected_logits), _ = head_against_torch(directory, hf,
                                                                          llama_layer_head(hf.config))
    np.testing.assert_allclose(hidden, expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-4, rtol=0)
    llm = ns.LLM(directory, **FP32, speculation=EAGLE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone("qwen3")
    assert llm.stats()["spec_num_draft_tokens"] > 0


def test_an_eagle_head_of_the_targets_own_layer_type_is_refused_by_name(model_dirs, hf_models, tmp_path):
    directory = shutil.copytree(model_dirs["qwen3"], tmp_path / "qwen3")
    save_head(directory, EagleHead(hf_models["qwen3"].config))  # a Qwen3 layer: q/k norms
    with pytest.raises(ns.CheckpointError, match="self_attn.k_norm.weight, .*q_norm.weight are not part of "
                                                  "an EAGLE head's layer, which is a Llama decoder layer"):
        ns.LLM(directory, **FP32, speculation=EAGLE)
