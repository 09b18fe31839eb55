"""Every engine feature on K-quant weights: a Llama whose rows are whole 256-value super-blocks, quantized
at load to llama.cpp's Q4_K_M mix (Q4_K, with Q6_K for the LM head and for attn_v / ffn_down of the layers
that get more bits). With float32 activations the served values are exactly the quantized ones, so
transformers over them (float64) is the reference; int8 activations through the int8 kernels (VNNI's or
AVX2's) keep batching, chunked prefill, preemption, prefix caching and speculation exact (every kernel sums
in one order); PEFT adapters match peft on the rounded base, and a merged adapter keeps each matrix's
format."""

import shutil

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

import numaserve as ns
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from memory.matrices import BlockInt8Matrix, WeightMatrix, parts
from models.gguf.writer import convert_to_gguf
from models.linear import dequantize
from models.loader import load_model
from tests.conftest import random_prompt
from tests.models.test_architectures import GREEDY, PROMPTS, preempting_pool
from tests.models.test_lora import make_adapter
from tests.support.model_factory import build_model

OVERRIDES = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "head_dim": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2}
INT8 = {"weight_dtype": "q4_k_m", "activation_dtype": "int8", "kv_dtype": "float32"}
MORE_BITS = (2, 3)  # llama.cpp's use_more_bits for 4 layers


@pytest.fixture(scope="module")
def kq_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquant") / "llama"
    build_model(d, "llama", **OVERRIDES)
    return d


@pytest.fixture(scope="module")
def rounded(kq_dir) -> LlamaForCausalLM:
    return rounded_model(kq_dir)


def rounded_model(kq_dir) -> LlamaForCausalLM:
    """transformers (float64) over exactly the values numaserve serves at q4_k_m."""
    model = LlamaForCausalLM.from_pretrained(kq_dir, dtype=torch.float32).eval()
    spec, weights, _ = load_model(kq_dir, "q4_k_m")
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    state = {"model.embed_tokens.weight": dequantize(weights.embed),
             "lm_head.weight": dequantize(weights.lm_head)}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        qkv, gate_up = dequantize(layer.qkv), dequantize(layer.gate_up)
        state |= {p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
                  p + "self_attn.v_proj.weight": qkv[q + kv:],
                  p + "self_attn.o_proj.weight": dequantize(layer.o),
                  p + "mlp.gate_proj.weight": gate_up[:inter], p + "mlp.up_proj.weight": gate_up[inter:],
                  p + "mlp.down_proj.weight": dequantize(layer.down)}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    return model.double()


def logits64(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_q4_k_m_gives_the_sensitive_matrices_more_bits(kq_dir):
    llm = ns.LLM(kq_dir, **INT8)
    weights = llm.engine.model.weights
    assert (weights.lm_head.dtype, weights.embed.dtype) == ("q6_k", "q4_k")
    for i, layer in enumerate(weights.layers):
        v = "q6_k" if i in MORE_BITS else "q4_k"
        assert [p.dtype for p in parts(layer.qkv)] == (["q4_k", v] if i in MORE_BITS else ["q4_k"])
        assert (layer.o.dtype, layer.gate_up.dtype, layer.down.dtype) == ("q4_k", "q4_k", v)


@pytest.mark.skipif(bool(missing_features(AVX2_FEATURES)), reason="this CPU lacks AVX2, F16C")
def test_q4_k_m_matrices_are_packed_for_their_int8_kernels(kq_dir):
    for layer in ns.LLM(kq_dir, **INT8).engine.model.weights.layers:
        assert all(isinstance(p, BlockInt8Matrix) for p in parts(layer.qkv))


def test_float32_activations_equal_transformers_on_the_quantized_values(kq_dir, rounded):
    tokens = random_prompt(50, seed=8)
    ours = ns.LLM(kq_dir, weight_dtype="q4_k_m", activation_dtype="float32", kv_dtype="float32").score(tokens)
    np.testing.assert_allclose(ours, logits64(rounded, tokens), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def alone(kq_dir) -> list[list[int]]:
    llm = ns.LLM(kq_dir, **INT8, enable_prefix_caching=False)
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("setup", ["batched", "chunked_prefill", "preempted"])
def test_batched_chunked_and_preempted_int8_runs_give_each_prompts_tokens_alone(setup, kq_dir, alone):
    fields = {"batched": {"max_num_batched_tokens": 256},
              "chunked_prefill": {"block_size": 4, "max_num_batched_tokens": 8},
              "preempted": preempting_pool(kq_dir)}[setup]
    llm = ns.LLM(kq_dir, **INT8, **fields)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    if setup == "preempted":
        assert llm.stats()["num_preemptions"] > 0


def test_a_prefix_cache_hit_and_speculation_give_the_tokens_of_neither(kq_dir, alone):
    llm = ns.LLM(kq_dir, **INT8)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone  # now from the prefix cache
    assert llm.stats()["prefix_hit_rate"] > 0
    spec = ns.LLM(kq_dir, **INT8, speculation={"method": "ngram", "num_speculative_tokens": 4, "mode": "on"})
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == alone
    assert spec.stats()["spec_num_draft_tokens"] > 0


def q8_0_rounded_adapter(adapter, out):
    """A copy of a PEFT adapter holding what numaserve's slots serve for a quantized base: A's rows and B^T's
    rows in q8_0 (models/lora/slots.py)."""
    shutil.copytree(adapter, out)
    tensors = load_file(out / "adapter_model.safetensors")
    for name, w in tensors.items():
        rows = w.numpy().T if "lora_B" in name else w.numpy()
        rounded = dequantize(WeightMatrix.from_float(np.ascontiguousarray(rows), "q8_0"))
        tensors[name] = torch.from_numpy(np.ascontiguousarray(rounded.T if "lora_B" in name else rounded))
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def test_an_adapter_on_the_quantized_base_matches_peft_and_a_merged_one_keeps_the_formats(kq_dir, tmp_path):
    adapter = make_adapter(kq_dir, tmp_path / "adapter", seed=3)
    peft = PeftModel.from_pretrained(rounded_model(kq_dir).float(),
                                     q8_0_rounded_adapter(adapter, tmp_path / "rounded")).eval().double()
    tokens = random_prompt(40, seed=9)
    expected = logits64(peft, tokens)
    llm = ns.LLM(kq_dir, weight_dtype="q4_k_m", activation_dtype="float32", kv_dtype="float32")
    llm.register_adapter("a", adapter)
    np.testing.assert_allclose(llm.score(tokens, adapter="a"), expected, atol=1e-4, rtol=0)
    merged = ns.LLM(kq_dir, weight_dtype="q4_k_m", activation_dtype="float32", kv_dtype="float32",
                    lora_merge="always")
    merged.register_adapter("a", adapter)
    got = merged.score(tokens, adapter="a")
    assert merged.stats()["num_merged_tokens"] > 0
    copy = merged.engine.runner.lora.merged.get("a")
    for base, layer in zip(merged.engine.model.weights.layers, copy.layers):
        for key, m in layer.adapted().items():  # requantized in each part's own format
            assert [p.dtype for p in parts(m)] == [p.dtype for p in parts(base.projection(key))]
    # requantizing base + delta rounds the whole matrix again: on this random model that moves the logits as
    # much as quantizing the float weights does (measured 7.8 against 7.5; q4_0 8.5 against 9.0), so the
    # bound is that of quantization itself
    exact = ns.LLM(kq_dir, weight_dtype="float32", kv_dtype="float32")
    assert np.abs(got - expected).max() < 1.5 * np.abs(llm.score(tokens) - exact.score(tokens)).max()


def test_a_q4_k_m_mixture_of_experts_exported_to_gguf_serves_what_it_served(tmp_path):
    # experts stacked from the GGUF's 3-D tensors (Q4_K gate/up; Q6_K down in the layers with more bits)
    moe = tmp_path / "moe"
    build_model(moe, "qwen3_moe", hidden_size=256, moe_intermediate_size=256, intermediate_size=512,
                head_dim=64)
    path = convert_to_gguf(moe, tmp_path / "moe-q4_k_m.gguf", "q4_k_m")
    tokens = random_prompt(30, seed=12)
    for activation_dtype in ("float32", "int8"):
        direct = ns.LLM(moe, weight_dtype="q4_k_m", activation_dtype=activation_dtype, kv_dtype="float32")
        served = ns.LLM(path, activation_dtype=activation_dtype, kv_dtype="float32")
        experts = served.engine.model.weights.layers[-1].experts
        assert (experts.gate_up.dtype, experts.down.dtype) == ("q4_k", "q6_k")
        assert np.array_equal(served.score(tokens), direct.score(tokens))
