"""ModelSpec: the architecture facts of a checkpoint, read from its config.json."""

import json
from dataclasses import dataclass
from pathlib import Path

from cluster_configs.errors import CheckpointError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    layer_windows: tuple[int, ...]  # per layer: sliding-window length, 0 = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Weights a forward reads per token: the layers' matrices and the LM head."""
        h = self.hidden_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size
        return self.num_layers * per_layer + self.vocab_size * h


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


def _layer_windows(cfg: dict, architecture: str, num_layers: int) -> tuple[int, ...]:
    window = cfg.get("sliding_window") or 0
    if architecture == "MistralForCausalLM":
        return (window,) * num_layers
    if architecture == "Qwen2ForCausalLM" and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", num_layers) else "full_attention"
            for i in range(num_layers)]
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (0,) * num_layers


def load_spec(model_dir: Path) -> ModelSpec:
    path = model_dir / "config.json"
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    architecture = next((a for a in archs if a in ARCHITECTURES), None)
    if architecture is None:
        raise _fail(path, f"architectures={archs!r} is not supported; "
                          f"numaserve serves {', '.join(ARCHITECTURES)}")
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        num_layers = int(cfg["num_hidden_layers"])
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        gen_path = model_dir / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.exists() else {}
        eos = _eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
        spec = ModelSpec(
            architecture=architecture,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            layer_windows=_layer_windows(cfg, architecture, num_layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except KeyError as e:
        raise _fail(path, f"field {e.args[0]!r} is missing; it is required for {architecture}") from None
    except (TypeError, ValueError) as e:
        raise _fail(path, f"a field has the wrong type ({e}); "
                          "compare with the transformers config class") from None
    if spec.num_heads % spec.num_kv_heads:
        raise _fail(path, f"num_attention_heads={spec.num_heads} is not a multiple of "
                          f"num_key_value_heads={spec.num_kv_heads}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _fail(path, f"hidden_act={cfg['hidden_act']!r} is not supported; expected 'silu'")
    if cfg.get("mlp_bias"):
        raise _fail(path, "mlp_bias=true is not supported; expected false")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "linear", "default"):
        raise _fail(path, f"rope scaling {scaling!r} is not supported; "
                          "expected rope_type 'llama3' or 'linear'")
    return spec
