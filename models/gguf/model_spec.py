"""GGUF metadata <-> ModelSpec: each family's llama.cpp keys ({arch}.*, models/gguf/families.py) and rope
tensors, and numaserve.spec: the fields those do not give back exactly (float32 keys, layer ropes llama.cpp
has no key for) as JSON. The reader prefers numaserve.spec; llama.cpp ignores it. The writer derives the spec
back from the llama.cpp keys it wrote and records only what differs."""

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from cluster_configs.errors import CheckpointError
from models.architectures import Architecture, architecture
from models.gguf.families import GGUFFamily, gguf_family, has_qkv_bias
from models.gguf.format import REQUIRED, SPEC_KEY, f32, metadata_key, rope_scaling, rope_tensors
from models.model_spec import ModelSpec
from models.rope import Rope, inv_freq

Shapes = dict[str, tuple[int, ...]]  # tensor name -> shape (numpy order)
Vector = Callable[[str], np.ndarray | None]  # a 1-D tensor's values as float32, None when absent
U32, F32, STR, BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.BOOL
# ModelSpec multipliers <-> llama.cpp keys: (field, key under {arch}., inverse: llama.cpp divides by it)
_SCALE_KEYS = (("embedding_multiplier", "embedding_scale", False),
               ("attention_multiplier", "attention.scale", False),
               ("residual_multiplier", "residual_scale", False),
               ("logit_multiplier", "logit_scale", True),
               ("attn_softcap", "attn_logit_softcapping", False),
               ("final_softcap", "final_logit_softcapping", False))
_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, ZeroDivisionError)


# ---- reading ---------------------------------------------------------------------------------------------

def spec_from_gguf(path: Path, metadata: dict, shapes: Shapes, vector: Vector) -> ModelSpec:
    """The spec of a file: from llama.cpp's keys, then numaserve.spec's exact fields."""
    try:
        spec = _derive(path, metadata, shapes, vector)
        overrides = _overrides(metadata.get(SPEC_KEY))
        spec = dataclasses.replace(spec, **overrides)
    except _ERRORS as e:
        raise CheckpointError(f"{path}: the metadata is inconsistent ({type(e).__name__}: {e}); the file is "
                              "corrupt: re-download or re-convert it") from None
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(f"{path}: {spec.num_heads} attention heads are not a multiple of "
                              f"{spec.num_kv_heads} key/value heads")
    return spec


def _derive(path: Path, metadata: dict, shapes: Shapes, vector: Vector) -> ModelSpec:
    family = gguf_family(path, metadata.get("general.architecture"))

    def key(name: str, default=REQUIRED):
        return metadata_key(path, metadata, f"{family.name}.{name}", family.implied.get(name, default))

    num_experts = int(key("expert_count", 0))
    if num_experts and not family.with_experts:
        raise CheckpointError(f"{path}: {family.name}.expert_count={num_experts}: numaserve serves "
                              "mixture-of-experts GGUF files of qwen3moe and of llama (Mixtral); serve a "
                              "dense "
                              f"{family.name} model or the Hugging Face directory")
    name = family.with_experts if num_experts else family.architecture
    arch = architecture(name)
    hidden = int(key("embedding_length"))
    num_heads, num_layers = int(key("attention.head_count")), int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if key("attention.value_length", head_dim) != head_dim or rotary_dim > head_dim or rotary_dim % 2:
        raise CheckpointError(f"{path}: key length {head_dim}, value length "
                              f"{key('attention.value_length')}, rope dimensions {rotary_dim}: split "
                              "key/value sizes are not supported, and the rope must rotate an even number of "
                              "a head's dimensions")
    tokens = metadata.get("tokenizer.ggml.tokens")
    embd = shapes.get("token_embd.weight")
    vocab_size = key("vocab_size", len(tokens) if tokens else embd[0] if embd else REQUIRED)
    window = int(key("attention.sliding_window", 0))
    types = _layer_types(arch, key("attention.sliding_window_pattern", None), window, num_layers)
    context = int(key("context_length"))
    eos = (metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    num_layers_moe = (True,) * num_layers if num_experts else ()
    experts = {} if not num_experts else {  # llama.cpp: every layer, the top-k weights renormalised
        "moe_layers": num_layers_moe, "num_experts": num_experts,
        "num_experts_per_tok": int(key("expert_used_count")), "normalize_routing": True,
        "moe_intermediate_size": int(key("expert_feed_forward_length", key("feed_forward_length")))}
    return ModelSpec(
        architecture=name,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=f32(key("attention.layer_norm_rms_epsilon")),
        layer_ropes=_layer_ropes(path, family, metadata, key, vector, types, rotary_dim, context),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in shapes,
        qkv_bias=has_qkv_bias(shapes),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
        **_scales(family, arch, key, hidden, num_heads, head_dim, num_layers),
        **experts,
    )


def _layer_types(arch: Architecture, pattern, window: int, num_layers: int) -> tuple[str, ...]:
    """llama.cpp's sliding_window_pattern (true: a sliding layer; an int n: all but every n-th), else the
    family's own pattern (Gemma 2: alternating; Gemma 3: every 6th global; Phi-3: all)."""
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return tuple("sliding_attention" if p else "full_attention" for p in pattern)
    if pattern:
        return tuple("sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                     for i in range(num_layers))
    return arch.layer_types({"sliding_window": window}, num_layers)


def _layer_ropes(path: Path, family: GGUFFamily, metadata: dict, key, vector: Vector, types: tuple[str, ...],
                 rotary_dim: int, context: int) -> tuple[Rope, ...]:
    theta = f32(key("rope.freq_base", 10000.0))
    scaling = rope_scaling(path, metadata, key, vector, theta, rotary_dim, context)
    full = Rope(theta, scaling, rotary_dim)
    local_theta = key("rope.freq_base_swa", family.plain_swa_rope or None)
    local_scaling = None if family.plain_swa_rope else scaling
    local = full if local_theta is None else Rope(f32(local_theta), local_scaling, rotary_dim)
    ropes = [local if t == "sliding_attention" else full for t in types]
    period = family.no_rope_period
    return tuple(dataclasses.replace(r, rotary_dim=0) if period and (i + 1) % period == 0 else r
                 for i, r in enumerate(ropes))


def _scales(family: GGUFFamily, arch: Architecture, key, hidden: int, num_heads: int, head_dim: int,
            num_layers: int) -> dict:
    """The spec's multipliers and soft-caps: the keys where present, else what the family implies."""
    scalar = family.wide_query_scalar
    values = {
        "embedding_multiplier": float(math.sqrt(hidden)) if arch.scale_embeddings else 1.0,
        "attention_multiplier": None if scalar is None else
        float(hidden // num_heads if num_layers in scalar else head_dim) ** -0.5,
    }
    for name, gguf_key, inverse in _SCALE_KEYS:
        value = key(gguf_key, None)
        if value is not None:
            values[name] = 1.0 / f32(value) if inverse else f32(value)
    return values


def _overrides(text: str | None) -> dict:
    if text is None:
        return {}
    values = json.loads(text)
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    if not isinstance(values, dict) or not values.keys() <= fields:
        raise ValueError(f"{SPEC_KEY} is not a JSON object of ModelSpec fields")
    decode = {"layer_ropes": lambda v: tuple(Rope(**r) for r in v), "layer_windows": tuple,
              "eos_token_ids": tuple, "moe_layers": tuple}
    return {name: decode.get(name, lambda v: v)(value) for name, value in values.items()}


# ---- writing ---------------------------------------------------------------------------------------------

def spec_metadata(spec: ModelSpec, family: GGUFFamily, shapes: Shapes,
                  tokenizer_ids: dict[str, int]) -> dict[str, tuple]:
    """key -> (value, GGUFValueType[, array item type]): llama.cpp's keys for spec under family.name, and
    numaserve.spec with the fields those (with the rope tensors and the tensors' shapes) do not give back
    exactly. tokenizer_ids: the file's tokenizer.ggml.*_token_id values."""
    a, rope, windows = family.name, spec.rope, spec.layer_windows
    meta = {f"{a}.{k}": (v, U32) for k, v in (
        ("vocab_size", spec.vocab_size), ("context_length", spec.max_position_embeddings),
        ("embedding_length", spec.hidden_size), ("block_count", spec.num_layers),
        ("feed_forward_length", spec.intermediate_size), ("attention.head_count", spec.num_heads),
        ("attention.head_count_kv", spec.num_kv_heads), ("attention.key_length", spec.head_dim),
        ("attention.value_length", spec.head_dim), ("rope.dimension_count", rope.rotary_dim))}
    if spec.num_experts:
        meta |= {f"{a}.{k}": (v, U32) for k, v in (
            ("expert_count", spec.num_experts), ("expert_used_count", spec.num_experts_per_tok),
            ("expert_feed_forward_length", spec.moe_intermediate_size))}
    meta |= {f"{a}.rope.freq_base": (rope.theta, F32),
             f"{a}.attention.layer_norm_rms_epsilon": (spec.rms_norm_eps, F32)}
    if rope.kind == "linear":
        meta |= {f"{a}.rope.scaling.type": ("linear", STR),
                 f"{a}.rope.scaling.factor": (rope.scaling["factor"], F32)}
    if rope.kind == "longrope":
        original = rope.scaling["original_max_position_embeddings"]
        meta |= {f"{a}.rope.scaling.attn_factor": (inv_freq(rope)[1], F32),
                 f"{a}.rope.scaling.original_context_length": (original, U32)}
    if any(windows):
        pattern = [bool(w) for w in windows]
        meta |= {f"{a}.attention.sliding_window": (max(windows), U32),
                 f"{a}.attention.sliding_window_pattern": (pattern, GGUFValueType.ARRAY, BOOL)}
        local = [r for r, w in zip(spec.layer_ropes, windows) if w and r.rotary_dim]
        if local and local[0].theta != rope.theta:
            meta[f"{a}.rope.freq_base_swa"] = (local[0].theta, F32)

    vectors = rope_tensors(spec)

    def derive(candidate: dict) -> ModelSpec:
        as_read = {k: float(np.float32(v)) if t == F32 else v for k, (v, t, *_) in candidate.items()}
        return _derive(Path(f"<{a} export>"), as_read | tokenizer_ids | {"general.architecture": a}, shapes,
                       vectors.get)

    implied = derive(meta)
    for name, gguf_key, inverse in _SCALE_KEYS:
        value = spec.softmax_scale if name == "attention_multiplier" else getattr(spec, name)
        if gguf_key in family.required or getattr(spec, name) != getattr(implied, name):
            meta[f"{a}.{gguf_key}"] = (1.0 / value if inverse else value, F32)
    derived = derive(meta)
    differ = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ModelSpec)
              if getattr(spec, f.name) != getattr(derived, f.name)}
    if differ:
        meta[SPEC_KEY] = (json.dumps(_jsonable(differ), sort_keys=True), STR)
    return meta


def _jsonable(values: dict) -> dict:
    return {k: [dataclasses.asdict(r) for r in v] if k == "layer_ropes" else v for k, v in values.items()}
