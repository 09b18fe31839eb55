"""Random-weight Llama checkpoints for benchmarks, built once and cached outside the repo."""

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CACHE = Path(os.environ.get("NUMASERVE_CACHE", Path.home() / ".cache" / "numaserve")) / "bench-models"

SHAPES = {
    # ~56M parameters: big enough that weights, not Python, dominate a decode step
    "llama-56m": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
                      "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
    "tinyllama-1.1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                           "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000},
}


def random_checkpoint(name: str, seed: int = 0) -> Path:
    """Directory of a random-weight LlamaForCausalLM in float16 safetensors (std 0.02, as HF initializes)."""
    directory = CACHE / name
    if (directory / "model.safetensors").exists():
        return directory
    shape = SHAPES[name]
    directory.mkdir(parents=True, exist_ok=True)
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    tensors = {"model.embed_tokens.weight": normal(shape["vocab_size"], h),
               "lm_head.weight": normal(shape["vocab_size"], h), "model.norm.weight": np.ones(h, np.float16)}
    for i in range(layers):
        tensors |= _layer(f"model.layers.{i}.", shape, normal)
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


def with_random_heads(name: str, num_medusa_heads: int = 3, seed: int = 1) -> Path:
    """random_checkpoint(name) with random Medusa heads (one residual block each) and a random EAGLE head
    beside it, of the model's width: what drafting costs at that shape (their acceptance is meaningless).
    The EAGLE head's draft vocabulary is a quarter of the vocabulary (every 4th id), as the demo model's
    head drafts from the quarter of its vocabulary most frequent in its training data."""
    from models.eagle import CONFIG_FILE as EAGLE_CONFIG
    from models.eagle import D2T
    from models.eagle import HEAD_FILE as EAGLE_FILE
    from models.medusa import CONFIG_FILE as MEDUSA_CONFIG
    from models.medusa import HEADS_FILE as MEDUSA_FILE
    from models.safetensors_io import read_header

    source = random_checkpoint(name)
    directory = CACHE / f"{name}-heads"
    if (directory / EAGLE_FILE).exists() and D2T in read_header(directory / EAGLE_FILE):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        if not (directory / file).exists():
            (directory / file).symlink_to(source / file)
    shape = SHAPES[name]
    h, v = shape["hidden_size"], shape["vocab_size"]
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    medusa = {}
    for k in range(num_medusa_heads):
        medusa |= {f"{k}.0.linear.weight": normal(h, h), f"{k}.0.linear.bias": np.zeros(h, np.float16),
                   f"{k}.1.weight": normal(v, h)}
    save_file(medusa, directory / MEDUSA_FILE)
    (directory / MEDUSA_CONFIG).write_text(json.dumps({"medusa_num_heads": num_medusa_heads,
                                                       "medusa_num_layers": 1}))
    draft_ids = np.arange(0, v, 4, dtype=np.int64)
    eagle = {"fc.weight": normal(h, 2 * h), "fc.bias": np.zeros(h, np.float16),
             "model.norm.weight": np.ones(h, np.float16), D2T: draft_ids - np.arange(len(draft_ids))
             } | _layer("model.layers.0.", shape, normal)
    (directory / EAGLE_CONFIG).write_text(json.dumps({"eagle_num_layers": 1}))
    save_file(eagle, directory / (EAGLE_FILE + ".tmp"))
    os.replace(directory / (EAGLE_FILE + ".tmp"), directory / EAGLE_FILE)
    return directory


def _layer(prefix: str, shape: dict, normal) -> dict:
    """One decoder layer's tensors (norms at 1, matrices from normal(rows, cols))."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    return {prefix + "input_layernorm.weight": np.ones(h, np.float16),
            prefix + "post_attention_layernorm.weight": np.ones(h, np.float16),
            prefix + "self_attn.q_proj.weight": normal(h, h),
            prefix + "self_attn.k_proj.weight": normal(kv, h),
            prefix + "self_attn.v_proj.weight": normal(kv, h),
            prefix + "self_attn.o_proj.weight": normal(h, h),
            prefix + "mlp.gate_proj.weight": normal(inter, h),
            prefix + "mlp.up_proj.weight": normal(inter, h),
            prefix + "mlp.down_proj.weight": normal(h, inter)}
