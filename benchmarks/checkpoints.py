"""Random-weight checkpoints for benchmarks (Llama, and other families at the same shapes), built once and
cached outside the repo."""

import json
import math
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from models.architectures import ARCHITECTURES, Architecture

CACHE = Path(os.environ.get("NUMASERVE_CACHE", Path.home() / ".cache" / "numaserve")) / "bench-models"

_TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
              "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000}
_56M = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": 32000}
# Qwen3-30B-A3B's layer (hidden 2048, 32 / 4 heads of 128, 64 experts of 768, top 8) and vocabulary, untied
_QWEN3_MOE = {"family": "qwen3moe", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
              "head_dim": 128, "intermediate_size": 6144, "num_experts": 64, "num_experts_per_tok": 8,
              "moe_intermediate_size": 768, "vocab_size": 151936}

SHAPES = {  # name -> config.json fields: the family's (FAMILIES) then these; "family" defaults to llama
    # ~56M parameters: big enough that weights, not Python, dominate a decode step
    "llama-56m": _56M,
    "tinyllama-1.1b": _TINYLLAMA,
    # TinyLlama's 22 layers and vocabulary at width 256: a step whose kernels do ~1% of TinyLlama's work, what
    # a step costs whatever the bandwidth and cores (benchmarks/project_tensor_parallel.py)
    "tinyllama-skinny": _TINYLLAMA | {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
                                      "num_key_value_heads": 4},
    # TinyLlama's shape in other families (benchmarks/bench_architectures.py)
    "qwen3-1.1b": _TINYLLAMA | {"family": "qwen3", "head_dim": 64},
    "gemma3-1.1b": _TINYLLAMA | {"family": "gemma3", "head_dim": 64, "query_pre_attn_scalar": 64},
    "qwen3-56m": _56M | {"family": "qwen3", "head_dim": 64},
    "gemma3-56m": _56M | {"family": "gemma3", "head_dim": 64, "query_pre_attn_scalar": 64},
    # 10 such layers: 3.83B parameters (0.88B active), 4.07 GB in q8_0, 7.7 GB in float16 (bench_moe.py)
    "qwen3moe-10l": _QWEN3_MOE | {"num_hidden_layers": 10},
    "qwen3moe-small": {"family": "qwen3moe", "hidden_size": 512, "num_hidden_layers": 4,
                       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                       "intermediate_size": 1408, "num_experts": 16, "num_experts_per_tok": 4,
                       "moe_intermediate_size": 256, "vocab_size": 32000},
}

FAMILIES = {  # config.json fields of each family besides its shape, as its released checkpoints have them
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "hidden_act": "silu"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "bos_token_id": 1, "eos_token_id": 2,
              "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
              "use_sliding_window": False},
    # every 6th layer global, the rest a window of 512 (layer_types written out); tied, as Gemma is
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
               "max_position_embeddings": 32768, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
               "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
               "final_logit_softcapping": None, "attn_logit_softcapping": None},
    "qwen3moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "bos_token_id": 1,
                 "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu",
                 "attention_bias": False, "use_sliding_window": False, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": []},
}
SINGLE_FILE_BYTES = 3 << 30  # larger checkpoints go in shards of about SHARD_BYTES, built one at a time
SHARD_BYTES = 1 << 30


def checkpoint_config(name: str) -> dict:
    """The config.json of SHAPES[name]."""
    shape = dict(SHAPES[name])
    config = FAMILIES[shape.pop("family", "llama")] | shape
    arch = ARCHITECTURES[config["architectures"][0]]
    if config.get("sliding_window"):
        config["layer_types"] = list(arch.layer_types(config, config["num_hidden_layers"]))
    return config


def random_checkpoint(name: str, seed: int = 0) -> Path:
    """Directory of a random-weight checkpoint of SHAPES[name] in float16 safetensors (matrices std 0.02, as
    HF initializes; norms scaling by 1), in Hugging Face's tensor names and layout (MoE: one tensor per
    expert); sharded with an index past SINGLE_FILE_BYTES, so memory holds one shard at a time."""
    directory = CACHE / name
    if (directory / "model.safetensors").exists() or (directory / "model.safetensors.index.json").exists():
        return directory
    config = checkpoint_config(name)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    arch = ARCHITECTURES[config["architectures"][0]]
    plan = _tensor_plan(config, arch)  # in the order their values are drawn
    total = sum(2 * math.prod(dims) for _, dims, _ in plan)
    shards, shard, nbytes = [], {}, 0
    for i, (tensor, dims, norm) in enumerate(plan):
        shard[tensor] = np.full(dims, 1.0 - arch.norm_offset, np.float16) if norm else normal(*dims)
        nbytes += shard[tensor].nbytes
        if i == len(plan) - 1 or (total > SINGLE_FILE_BYTES and nbytes >= SHARD_BYTES):
            path = directory / f"shard-{len(shards):05d}.tmp"
            save_file(shard, path)
            shards.append((path, list(shard)))
            shard, nbytes = {}, 0
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if len(shards) == 1:
        os.replace(shards[0][0], directory / "model.safetensors")
        return directory
    weight_map = {}
    for k, (path, tensors) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path, directory / final)
        weight_map |= dict.fromkeys(tensors, final)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "index.tmp").write_text(json.dumps(index, indent=2))
    os.replace(directory / "index.tmp", directory / "model.safetensors.index.json")
    return directory


def _tensor_plan(config: dict, arch: Architecture) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is a norm) of every tensor of the checkpoint."""
    h, v = config["hidden_size"], config["vocab_size"]
    plan = [("model.embed_tokens.weight", (v, h), False)]
    if not config["tie_word_embeddings"]:
        plan.append(("lm_head.weight", (v, h), False))
    plan.append(("model.norm.weight", (h,), True))
    for i in range(config["num_hidden_layers"]):
        plan += _layer_plan(f"model.layers.{i}.", config, arch)
    return plan


def _layer_plan(prefix: str, config: dict, arch: Architecture) -> list[tuple[str, tuple[int, ...], bool]]:
    """One decoder layer's tensors: norms, attention (q/k norms per head if the family has them), then the
    MLP or the router and experts."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    d = config.get("head_dim") or h // heads
    q, kv = heads * d, config["num_key_value_heads"] * d
    p = prefix + "self_attn."
    plan = [(prefix + f"{name}.weight", (h,), True) for name in arch.norms.values()]
    plan += [(p + "q_proj.weight", (q, h), False), (p + "k_proj.weight", (kv, h), False),
             (p + "v_proj.weight", (kv, h), False), (p + "o_proj.weight", (h, q), False)]
    if arch.qk_norm == "head":
        plan += [(p + "q_norm.weight", (d,), True), (p + "k_norm.weight", (d,), True)]
    if arch.experts is None:
        inter, m = config["intermediate_size"], prefix + "mlp."
        return plan + [(m + "gate_proj.weight", (inter, h), False), (m + "up_proj.weight", (inter, h), False),
                       (m + "down_proj.weight", (h, inter), False)]
    inter, block = config["moe_intermediate_size"], prefix + arch.experts.block
    gate, up, down = arch.experts.projections
    plan.append((f"{block}.gate.weight", (config["num_experts"], h), False))
    for e in range(config["num_experts"]):
        x = f"{block}.experts.{e}."
        plan += [(x + f"{gate}.weight", (inter, h), False), (x + f"{up}.weight", (inter, h), False),
                 (x + f"{down}.weight", (h, inter), False)]
    return plan


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
    from models.proposers.eagle_head import CONFIG_FILE as EAGLE_CONFIG
    from models.proposers.eagle_head import D2T
    from models.proposers.eagle_head import HEAD_FILE as EAGLE_FILE
    from models.proposers.medusa_head import CONFIG_FILE as MEDUSA_CONFIG
    from models.proposers.medusa_head import HEADS_FILE as MEDUSA_FILE
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
    """One Llama decoder layer's tensors (norms at 1, matrices from normal(rows, cols))."""
    config = FAMILIES["llama"] | shape
    return {name: np.ones(dims, np.float16) if norm else normal(*dims)
            for name, dims, norm in _layer_plan(prefix, config, ARCHITECTURES["LlamaForCausalLM"])}
