"""Tiny random Hugging Face checkpoints (saved with save_pretrained) for the tests."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
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
