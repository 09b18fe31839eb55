"""adapter_config.json of a PEFT LoRA adapter: what numaserve serves of it, and each module's rank and
scaling; the seven projections an adapter may adapt (Phi-3's: four, two of them fused), with their parents
and shapes.

PEFT resolves a module's rank and alpha by its key in the base model ("model.layers.3.self_attn.q_proj"):
the first key of rank_pattern / alpha_pattern that matches a dotted suffix of it as a regular expression
wins, else r / lora_alpha. The scaling is alpha / r, or alpha / sqrt(r) with use_rslora.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from cluster_configs.errors import AdapterError
from models.model_spec import ModelSpec

MODULE_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MODULES = tuple(MODULE_PARENTS)  # what the slots and merged copies hold (a fused module as its parts)
# Phi-3 stores q|k|v and gate|up fused: its adapters target these, each module's rows its parts' in order
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PARENTS = MODULE_PARENTS | {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}

# config fields that change what the adapter computes beyond W x + s B A x: refused by name when set
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales every adapted weight's columns by a learned magnitude; merge it "
                "into the base model (peft's merge_and_unload) or train a plain LoRA",
    "lora_bias": "LoRA biases (lora_bias) are not supported; train with lora_bias=False",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported; "
                      "train with fan_in_fan_out=False",
    "modules_to_save": "modules_to_save (full trained copies of modules such as lm_head) are not supported; "
                       "train without them",
    "trainable_token_indices": "trainable_token_indices (retrained embedding rows) is not supported",
    "layer_replication": "layer_replication (a model with repeated layers) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "target_parameters": "target_parameters (LoRA on bare parameters) is not supported; target modules",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
}


@dataclass(frozen=True)
class LoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_and_scaling(self, layer: int, module: str) -> tuple[int, float]:
        key = module_key(layer, module)
        r = self.rank_pattern.get(pattern_key(self.rank_pattern, key), self.r)
        alpha = self.alpha_pattern.get(pattern_key(self.alpha_pattern, key), self.lora_alpha)
        return r, (alpha / math.sqrt(r) if self.use_rslora else alpha / r)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """module -> (out_features, in_features)."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def target_modules(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """module an adapter of this model may adapt -> (out_features, in_features): the model's own linear
    layers, so for Phi-3 the fused qkv_proj and gate_up_proj in place of their parts."""
    shapes = module_shapes(spec)
    if not spec.arch.fused_projections:
        return shapes
    fused = {name: (sum(shapes[p][0] for p in parts), shapes[parts[0]][1])
             for name, parts in FUSED_MODULES.items()}
    return {"qkv_proj": fused["qkv_proj"], "o_proj": shapes["o_proj"], "gate_up_proj": fused["gate_up_proj"],
            "down_proj": shapes["down_proj"]}


def module_key(layer: int, module: str) -> str:
    """The module's name in the base model, as PEFT matches patterns against it."""
    return f"model.layers.{layer}.{PARENTS[module]}.{module}"


def pattern_key(patterns: dict, key: str) -> str:
    """The first pattern matching a dotted suffix of key (PEFT's rule), else key itself."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), key)


def read_lora_config(path: Path) -> LoraConfig:
    config_path = path / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{config_path}: missing; a PEFT adapter directory needs adapter_config.json "
                           "(save it with peft_model.save_pretrained(dir))") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type={config['peft_type']!r}; only LORA adapters are served")
    for key, why in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"{config_path}: {key}={config[key]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: bias={config['bias']!r}: trained base-model biases are not "
                           "supported; train with bias='none'")
    r = config.get("r")
    if not _positive_int(r):
        raise AdapterError(f"{config_path}: 'r' must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)  # peft's LoraConfig default
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(_positive_int(v) for v in rank_pattern.values()):
        raise AdapterError(f"{config_path}: rank_pattern must map module patterns to positive integers, "
                           f"got {rank_pattern!r}")
    if (not _number(alpha) or not isinstance(alpha_pattern, dict)
            or not all(map(_number, alpha_pattern.values()))):
        raise AdapterError(f"{config_path}: lora_alpha and alpha_pattern's values must be numbers, got "
                           f"{alpha!r} and {alpha_pattern!r}")
    for p in (*rank_pattern, *alpha_pattern):
        try:
            re.compile(p)
        except re.error as e:
            raise AdapterError(f"{config_path}: pattern {p!r} is not a regular expression ({e})") from None
    return LoraConfig(r, float(alpha), bool(config.get("use_rslora")), dict(rank_pattern),
                      dict(alpha_pattern))


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
