"""Mixture-of-experts models end to end (Qwen3-MoE, Mixtral): LoRA on their attention against peft, LoRA on
their experts refused, the routing in the engine's diagnostics. Exactness of the forward itself:
tests/models/test_hf_parity.py; the expert layer: tests/models/test_moe.py."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import numaserve as ns
from cluster_configs.errors import AdapterError
from tests.conftest import random_prompt
from tests.models.test_hf_parity import hf_logits
from tests.models.test_lora import make_adapter, peft_reference

FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("lora_merge", ["never", "always"])
def test_lora_on_the_attention_of_a_moe_model_matches_peft(variant, lora_merge, model_dirs, tmp_path):
    adapter = make_adapter(model_dirs[variant], tmp_path / "attn", seed=3, modules=ATTENTION)
    llm = ns.LLM(model_dirs[variant], **FP32, lora_merge=lora_merge)
    llm.register_adapter("attn", adapter)
    tokens = random_prompt(30, seed=4)
    reference = hf_logits(peft_reference(model_dirs[variant], adapter), tokens)
    np.testing.assert_allclose(llm.score(tokens, adapter="attn"), reference, atol=1e-4, rtol=0)


def _adapter_dir(path, tensors: dict[str, tuple[int, int]], targets: list[str]):
    """A PEFT-format adapter written by hand: tensor name -> (rows, cols), B non-zero."""
    path.mkdir()
    rng = np.random.default_rng(0)
    save_file({name: rng.normal(size=shape).astype(np.float32) for name, shape in tensors.items()},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets, "bias": "none"}))
    return path


@pytest.mark.parametrize("variant, module, key", [
    ("qwen3_moe", "gate_proj", "model.layers.1.mlp.experts.3.gate_proj"),  # an expert
    ("qwen3_moe", "gate", "model.layers.2.mlp.gate"),  # the router
    ("qwen3_moe", "down_proj", "model.layers.1.mlp.down_proj"),  # a dense MLP name on a MoE layer
    ("mixtral", "w1", "model.layers.0.block_sparse_moe.experts.0.w1"),
])
def test_lora_on_experts_is_refused_naming_what_is_supported(variant, module, key, model_dirs, tmp_path):
    base = f"base_model.model.{key}"
    adapter = _adapter_dir(tmp_path / "experts", {f"{base}.lora_A.weight": (4, 64),
                                                  f"{base}.lora_B.weight": (32, 4)}, [module])
    llm = ns.LLM(model_dirs[variant], **FP32)
    with pytest.raises(AdapterError, match="mixture-of-experts layer's experts or router.*q_proj"):
        llm.register_adapter("experts", adapter)
    # the engine keeps serving
    assert len(llm.generate([[5, 6, 7]], ns.SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_a_peft_adapter_on_the_mlp_of_a_moe_model_is_refused(model_dirs, tmp_path):
    # peft adapts transformers 5's fused expert parameters (target_parameters): refused, naming the fix
    adapter = make_adapter(model_dirs["qwen3_moe"], tmp_path / "mlp", seed=5,
                           modules=["gate_proj", "up_proj", "down_proj"])
    llm = ns.LLM(model_dirs["qwen3_moe"], **FP32)
    with pytest.raises(AdapterError, match="target_parameters.*not supported"):
        llm.register_adapter("mlp", adapter)


def test_the_routing_is_in_the_diagnostics(model_dirs):
    llm = ns.LLM(model_dirs["qwen3_moe"], **FP32)
    llm.generate([random_prompt(6, seed=1)], ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    experts = {d["subject"]: d for d in llm.diagnostics() if d["topic"] == "experts"}
    assert set(experts) == {"layers.1", "layers.2"}  # layer 0 is dense
    counts = llm.engine.model.expert_log.counts
    # 6 prompt tokens and 3 decoded ones (the 4th token is sampled, never run), 2 experts each
    assert counts.sum(axis=1).tolist() == [0, 18, 18]
    busiest = int(np.argmax(counts[1]))
    reason = experts["layers.1"]["reason"]
    assert experts["layers.1"]["choice"] == "top-2 of 8"
    assert reason.startswith("18 (token, expert) routings") and f"busiest: {busiest} (" in reason
