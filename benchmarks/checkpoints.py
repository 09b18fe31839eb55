"""Random-weight Llama checkpoints for benchmarks, built once and cached outside the repo."""

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CACHE = Path(os.environ.get("NUMASERVE_CACHE", Path.home() / ".cache" / "numaserve")) / "bench-models"

SHAPES = {
    # ~56M parameters: big enough that weights, not Python, dominate a decode step
    "llama-56m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
                      "num_key_value_heads": 4, "vocab_size": 32000},
    "tinyllama-1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
                           "num_key_value_heads": 4, "vocab_size": 32000},
}


def random_checkpoint(name: str, seed: int = 0) -> Path:
    """Directory of a random-weight LlamaForCausalLM in float16 safetensors (std 0.02, as HF initializes)."""
    directory = CACHE / name
    if (directory / "model.safetensors").exists():
        return directory
    shape = SHAPES[name]
    directory.mkdir(parents=True, exist_ok=True)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": normal(shape["vocab_size"], h),
               "lm_head.weight": normal(shape["vocab_size"], h), "model.norm.weight": np.ones(h, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": np.ones(h, np.float16),
                    p + "post_attention_layernorm.weight": np.ones(h, np.float16),
                    p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
                    p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
                    p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
                    p + "mlp.down_proj.weight": normal(h, inter)}
    save_file(tensors, directory / "model.safetensors.tmp")
    config = shape | {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
                      "rope_theta": 10000.0, "max_position_embeddings": 2048, "bos_token_id": 1,
                      "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(directory / "model.safetensors.tmp", directory / "model.safetensors")
    return directory


def with_word_tokenizer(name: str) -> Path:
    """random_checkpoint(name) with a tokenizer.json whose every id is a word ("t0" ... "t31999", no special
    tokens): each generated token then has text, as it would with a real model, so servers stream it."""
    source = random_checkpoint(name)
    directory = CACHE / f"{name}-words"
    if (directory / "tokenizer.json").exists():
        return directory
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        if not (directory / file).exists():
            (directory / file).symlink_to(source / file)
    vocab_size = SHAPES[name]["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json.tmp"))
    os.replace(directory / "tokenizer.json.tmp", directory / "tokenizer.json")
    return directory
