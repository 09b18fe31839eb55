"""Tiny random Hugging Face checkpoints (saved with save_pretrained) for the tests."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

VOCAB_SIZE = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "numaserve serves language models on CPUs, one worker per NUMA node. ",
    "Grüße aus Köln! Ünïcödé tëxt, emoji 🙂 and ∑ symbols. ",
    "In the beginning was the word, and the word was a token. Tokens flow through layers. ",
]

COMMON = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.15}

VARIANTS = {
    # GQA, head_dim != hidden / heads, llama3 rope scaling, untied lm_head
    "llama": (LlamaConfig, LlamaForCausalLM, {
        "head_dim": 24, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # tied embeddings, linear rope scaling, sharded safetensors
    "llama_tied": (LlamaConfig, LlamaForCausalLM, {
        "tie_word_embeddings": True, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "num_key_value_heads": 1}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8, "head_dim": 16}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": False}),
    # per-head q/k norms, head_dim != hidden / heads, its second layer sliding (max_window_layers)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {
        "head_dim": 24, "rope_theta": 1000000.0, "use_sliding_window": True, "sliding_window": 8,
        "max_window_layers": 1}),
    # sandwich norms, GeGLU, sqrt(hidden) embeddings, query_pre_attn_scalar != head_dim, attention and final
    # soft-caps low enough to bite, alternating window 8 / global layers, tied
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "pad_token_id": 0}),
    # + q/k norms, each layer type its own rope (local plain 10k, global linear x4 on 1e6), final soft-cap
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 20, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                               "rope_theta": 1000000.0}},
        "final_logit_softcapping": 4.0, "pad_token_id": 0}),
    # fused qkv and gate_up, LongRoPE on 3/4 of each head (Phi-4-mini); served up to its 512 positions, past
    # the original 32: the long factors (tests/models/test_architectures.py serves it within 32 too)
    "phi3": (Phi3Config, Phi3ForCausalLM, {
        "original_max_position_embeddings": 32, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}}),
    # every multiplier away from 1, tied
    "granite": (GraniteConfig, GraniteForCausalLM, {
        "embedding_multiplier": 6.0, "attention_multiplier": 0.2, "residual_multiplier": 0.4,
        "logits_scaling": 3.0, "tie_word_embeddings": True}),
    # norms after attention and MLP only, q/k norms over all heads
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {"pad_token_id": 0}),
    # its second layer without rope, tied
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {
        "no_rope_layers": [1, 0], "pad_token_id": 0, "tie_word_embeddings": True}),
    # 8 experts, top 2, not renormalised (Mixtral is); its first layer dense (mlp_only_layers)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "num_hidden_layers": 3, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": False, "mlp_only_layers": [0]}),
    # 4 experts, top 2, window 8
    "mixtral": (MixtralConfig, MixtralForCausalLM, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}),
}


# TinyLlama-1.1B-Chat's (Zephyr's) template: the HTTP server renders it as apply_chat_template does
CHAT_TEMPLATE = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + "
    "eos_token }}\n{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}")


def build_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_model(directory: Path, variant: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = VARIANTS[variant]
    config = config_cls(**(COMMON | extra | overrides))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    shard = "20KB" if variant == "llama_tied" else "1GB"
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    build_tokenizer(directory)
    return model
