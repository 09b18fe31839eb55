"""config.json as the Hub holds it (written by transformers 4.x: rope_theta, rope_scaling,
rope_local_base_freq, sliding_window_pattern, partial_rotary_factor, ...) reads into the same spec as the
config transformers 5 writes for the same model (rope_parameters, layer_types): transformers' own
conversion is the reference."""

import json

import pytest
from transformers import AutoConfig

from cluster_configs.errors import CheckpointError
from models.model_spec import load_spec

BASE = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 7,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# (architecture, model_type, the 4.x fields)
LEGACY = {
    "gemma2": ("Gemma2ForCausalLM", "gemma2", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 512, "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", {
        "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 512, "sliding_window_pattern": 3,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"}),
    "phi3": ("Phi3ForCausalLM", "phi3", {
        "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "original_max_position_embeddings": 1024,
        "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                         "long_factor": [2.0, 2.1, 2.2, 2.3, 2.4, 2.5]}}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {
        "head_dim": 24, "rope_theta": 1000000.0, "use_sliding_window": True, "sliding_window": 64,
        "max_window_layers": 4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 512}}),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", {"rope_theta": 2000000.0, "no_rope_layer_interval": 3}),
    "granite": ("GraniteForCausalLM", "granite", {
        "rope_theta": 10000.0, "embedding_multiplier": 12.0, "attention_multiplier": 0.0078125,
        "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe", {
        "head_dim": 16, "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 2,
        "mlp_only_layers": [5]}),
}


def _write(directory, config: dict):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("family", LEGACY)
def test_a_legacy_config_reads_as_transformers_converts_it(family, tmp_path):
    architecture, model_type, fields = LEGACY[family]
    legacy = BASE | fields | {"architectures": [architecture], "model_type": model_type}
    legacy_dir = _write(tmp_path / "legacy", legacy)
    converted = AutoConfig.for_model(**{k: v for k, v in legacy.items()})
    converted.architectures = [architecture]
    converted.save_pretrained(tmp_path / "converted")
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert "rope_parameters" in saved  # transformers 5's format, not the one we wrote
    ours, reference = load_spec(legacy_dir), load_spec(tmp_path / "converted")
    assert ours == reference
    # and the quirks are on (not both read as defaults)
    assert ours.layer_ropes != (ours.layer_ropes[0],) * 7 or ours.embedding_multiplier != 1.0 or any(
        ours.layer_windows) or ours.num_experts


def test_gemma3_legacy_fields_mean_what_they_say(tmp_path):
    _, model_type, fields = LEGACY["gemma3"]
    spec = load_spec(_write(tmp_path / "g", BASE | fields | {"architectures": ["Gemma3ForCausalLM"],
                                                             "model_type": model_type}))
    # every 3rd layer global, the others a window of 512 with the local base and no scaling
    assert spec.layer_windows == (512, 512, 0, 512, 512, 0, 512)
    local, full = spec.layer_ropes[0], spec.layer_ropes[2]
    assert (local.theta, local.scaling) == (10000.0, None)
    assert (full.theta, full.scaling["rope_type"], full.scaling["factor"]) == (1000000.0, "linear", 8.0)
    assert spec.embedding_multiplier == 8.0 and spec.softmax_scale == 0.25  # sqrt(64); 16 ** -0.5


def test_smollm3_interval_drops_rope_from_every_nth_layer(tmp_path):
    _, model_type, fields = LEGACY["smollm3"]
    spec = load_spec(_write(tmp_path / "s", BASE | fields | {"architectures": ["SmolLM3ForCausalLM"],
                                                             "model_type": model_type}))
    assert [r.rotary_dim for r in spec.layer_ropes] == [16, 16, 0, 16, 16, 0, 16]


def test_unsupported_rope_and_architecture_are_refused_naming_what_is(tmp_path):
    config = BASE | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="yarn.*expected rope_type one of"):
        load_spec(_write(tmp_path / "yarn", config))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM.*not supported.*Qwen3MoeForCausalLM"):
        load_spec(_write(tmp_path / "neox", BASE | {"architectures": ["GPTNeoXForCausalLM"]}))
