"""ModelSpec: the architecture facts of a checkpoint, read from its config.json."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cluster_configs.errors import CheckpointError
from models.architectures import ARCHITECTURES, Architecture, architecture
from models.rope import ROPE_TYPES, Rope


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_ropes: tuple[Rope, ...]  # per layer
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    layer_windows: tuple[int, ...]  # per layer: sliding-window length, 0 = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # the family's numbers (models/architectures.py describes the rest); the defaults are Llama's
    embedding_multiplier: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite)
    attention_multiplier: float | None = None  # scores = q.k times this; None: 1 / sqrt(head_dim)
    attn_softcap: float = 0.0  # scores -> cap * tanh(scores / cap) (Gemma 2); 0 = none
    residual_multiplier: float = 1.0  # each block's output times this before the residual add (Granite)
    logit_multiplier: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (Gemma 2); 0 = none
    # mixture of experts (models/moe/layer.py): layers with experts, each token through its top-k of them
    moe_layers: tuple[bool, ...] = ()  # per layer: True where its MLP is experts; () = a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    normalize_routing: bool = True  # renormalise a token's top-k routing weights to sum 1
    # a tensor-parallel rank's experts [first, end) under expert parallelism
    # (models/tensor_parallel/shard.py); None: all num_experts
    held_experts: tuple[int, int] | None = None

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def arch(self) -> Architecture:
        return architecture(self.architecture)

    @property
    def softmax_scale(self) -> float:
        m = self.attention_multiplier
        return 1.0 / math.sqrt(self.head_dim) if m is None else m

    @property
    def rope(self) -> Rope:
        """The global (full-attention) layers' rotary embedding: what GGUF's llama.rope.* keys describe."""
        full = [r for r, w in zip(self.layer_ropes, self.layer_windows) if not w and r.rotary_dim]
        return (full or [r for r in self.layer_ropes if r.rotary_dim] or list(self.layer_ropes))[0]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Weights a forward reads per token: the layers' matrices (a MoE layer's router and top-k experts:
        the active parameters) and the LM head."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        dense = 3 * h * self.intermediate_size
        sparse = self.num_experts * h + self.num_experts_per_tok * 3 * h * self.moe_intermediate_size
        return sum(attention + (sparse if self.is_moe(i) else dense)
                   for i in range(self.num_layers)) + self.vocab_size * h


def _fail(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise _fail(path, "missing; a Hugging Face model directory needs config.json "
                          "(save it with model.save_pretrained(dir))") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"is not valid JSON ({e}); re-save it with save_pretrained") from None


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _layer_types(cfg: dict, arch: Architecture, num_layers: int) -> tuple[str, ...]:
    types = cfg.get("layer_types") or arch.layer_types(cfg, num_layers)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(types)


def _rope_parameters(cfg: dict, layer_type: str) -> dict:
    """Hugging Face's rope parameters of a layer type, from either config format: transformers 5's
    rope_parameters (flat, or nested by layer type) or 4.x's rope_theta, rope_scaling, partial_rotary_factor
    and Gemma 3's rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif not params:
        params = dict(cfg.get("rope_scaling") or {})
        if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq"):
            params = {"rope_theta": cfg["rope_local_base_freq"]}  # Gemma 3's local layers: plain rope
    params = dict(params)
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = {"su": "longrope"}.get(kind, kind)
    if params["rope_type"] in ("llama3", "longrope"):
        # Phi-3 keeps its pretraining length beside the rope parameters; HF gives that one priority
        key = "original_max_position_embeddings"
        params[key] = cfg.get(key) or params.get(key) or cfg.get("max_position_embeddings", 2048)
    if params["rope_type"] == "longrope" and params.get("factor") is None:
        params["factor"] = (cfg.get("max_position_embeddings", 2048)
                            / params["original_max_position_embeddings"])
    return params


def _rope(cfg: dict, layer_type: str, head_dim: int, uses_rope: bool) -> Rope:
    params = _rope_parameters(cfg, layer_type)
    theta = float(params.pop("rope_theta"))
    rotary_dim = int(head_dim * float(params.pop("partial_rotary_factor"))) if uses_rope else 0
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope scaling {params!r} is not supported; expected rope_type one of {ROPE_TYPES}")
    return Rope(theta, None if params["rope_type"] == "default" else params, rotary_dim)


def _rope_layers(cfg: dict, num_layers: int) -> list[int]:
    """Per layer 1 if it applies rope (SmolLM3: no_rope_layers, else every no_rope_layer_interval-th
    layer without)."""
    interval = cfg.get("no_rope_layer_interval")
    if cfg.get("no_rope_layers") is None and interval:
        return [int((i + 1) % interval != 0) for i in range(num_layers)]
    return cfg.get("no_rope_layers") or [1] * num_layers


def _moe_fields(cfg: dict, arch: Architecture, num_layers: int) -> dict:
    experts = arch.experts
    if experts is None:
        return {}
    num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])  # Qwen3-MoE: either, by version
    sparse = experts.sparse_layers(cfg, num_layers) if num_experts else (False,) * num_layers
    top_k = int(cfg["num_experts_per_tok"])
    if num_experts and not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the {num_experts} experts")
    return {"moe_layers": sparse, "num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            "normalize_routing": experts.normalize_key is None or bool(cfg.get(experts.normalize_key))}


def _multiplier(cfg: dict, key: str, default: float = 1.0) -> float:
    value = cfg.get(key)
    return default if value is None else float(value)


def load_spec(model_dir: Path) -> ModelSpec:
    path = model_dir / "config.json"
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in ARCHITECTURES), None)
    if name is None:
        raise _fail(path, f"architectures={archs!r} is not supported; "
                          f"numaserve serves {', '.join(ARCHITECTURES)}")
    arch = architecture(name)
    cfg = arch.defaults | cfg
    try:
        spec = _build_spec(name, arch, cfg, model_dir)
    except KeyError as e:
        raise _fail(path, f"field {e.args[0]!r} is missing; it is required for {name}") from None
    except (TypeError, ValueError) as e:
        raise _fail(path, f"a field has the wrong type or value ({e}); "
                          "compare with the transformers config class") from None
    _check(spec, arch, cfg, path)
    return spec


def _check(spec: ModelSpec, arch, cfg: dict, path: Path) -> None:
    """What numaserve does not serve, refused by name."""
    name = spec.architecture
    if spec.num_heads % spec.num_kv_heads:
        raise _fail(path, f"num_attention_heads={spec.num_heads} is not a multiple of "
                          f"num_key_value_heads={spec.num_kv_heads}")
    act = cfg.get("hidden_activation", cfg.get("hidden_act", "silu"))
    expected = {"silu": ("silu",), "gelu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}[arch.activation]
    if act not in expected:
        raise _fail(path, f"hidden_act={act!r} is not supported for {name}; expected {expected[0]!r}")
    if cfg.get("mlp_bias"):
        raise _fail(path, "mlp_bias=true is not supported; expected false")


def _build_spec(name: str, arch, cfg: dict, model_dir: Path) -> ModelSpec:
    """The spec of config.json's fields (cfg, with the architecture's defaults under them); KeyError,
    TypeError or ValueError where a field is missing or wrong."""
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    types = _layer_types(cfg, arch, num_layers)
    no_rope = _rope_layers(cfg, num_layers)
    window = int(cfg.get("sliding_window") or 0)
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.exists() else {}
    eos = _eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    logits_scaling = _multiplier(cfg, "logits_scaling")
    moe = _moe_fields(cfg, arch, num_layers)
    return ModelSpec(
        architecture=name,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        layer_ropes=tuple(_rope(cfg, t, head_dim, bool(no_rope[i])) for i, t in enumerate(types)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch.qkv_bias or bool(cfg.get("attention_bias", False)),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        # Gemma: HF multiplies by sqrt(hidden) rounded to the activations' dtype (float32 here)
        embedding_multiplier=(float(math.sqrt(hidden)) if arch.scale_embeddings
                              else _multiplier(cfg, "embedding_multiplier")),
        attention_multiplier=(float(cfg["query_pre_attn_scalar"]) ** -0.5
                              if cfg.get("query_pre_attn_scalar") else cfg.get("attention_multiplier")),
        attn_softcap=_multiplier(cfg, "attn_logit_softcapping", 0.0),
        residual_multiplier=_multiplier(cfg, "residual_multiplier"),
        logit_multiplier=1.0 / logits_scaling,
        final_softcap=_multiplier(cfg, "final_logit_softcapping", 0.0),
        **moe,
    )
