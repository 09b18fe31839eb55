"""LoRA adapters in the PEFT format, applied un-merged so one batch can mix adapters.

An adapted linear computes W x + scaling * B (A x), A: [r, in], B: [out, r], scaling = alpha / r
(alpha / sqrt(r) with rsLoRA).
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster_configs.errors import AdapterError
from memory.weights import WeightMatrix
from models.linear import linear
from models.safetensors_io import read_header, read_tensor
from models.spec import ModelSpec

# module -> (fused weight of ours, which rows of it the module's outputs are)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scaling: float
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]  # per layer: module -> (A [r, in], B [out, r])


def module_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """module -> (out_features, in_features)."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}


def _read_config(path: Path) -> dict:
    config_path = path / "adapter_config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{config_path}: missing; a PEFT adapter directory needs adapter_config.json "
                           "(save it with peft_model.save_pretrained(dir))") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{config_path}: not valid JSON ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_path}: peft_type={config['peft_type']!r}; only LORA adapters are served")
    if config.get("fan_in_fan_out") or config.get("bias", "none") != "none":
        raise AdapterError(f"{config_path}: fan_in_fan_out and LoRA biases are not supported; train with "
                           "fan_in_fan_out=False, bias='none'")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"{config_path}: 'r' must be a positive integer, got {config.get('r')!r}")
    return config


def load_lora(name: str, path: str | Path, spec: ModelSpec, max_rank: int | None = None) -> LoraAdapter:
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory; pass a PEFT adapter directory")
    config = _read_config(path)
    rank = config["r"]
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"{path}: rank {rank} exceeds max_lora_rank={max_rank}; raise max_lora_rank")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.exists():
        raise AdapterError(f"{weights_path}: missing; save adapters with safetensors (pickled "
                           "adapter_model.bin files are refused: they can run arbitrary code)")
    layers: list[dict] = [{} for _ in range(spec.num_layers)]
    shapes = module_shapes(spec)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, entry in read_header(weights_path).items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(2) not in MODULES or int(m.group(1)) >= spec.num_layers:
            raise AdapterError(f"{weights_path}: tensor {key!r} does not adapt a supported module of this "
                               f"{spec.num_layers}-layer model ({', '.join(MODULES)})")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = read_tensor(entry)
    for (layer, module), ab in pairs.items():
        out_features, in_features = shapes[module]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise AdapterError(f"{weights_path}: layer {layer} {module} has lora_A without lora_B or vice versa")
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(f"{weights_path}: layer {layer} {module}: lora_A {a.shape} / lora_B {b.shape}, "
                               f"expected {(rank, in_features)} / {(out_features, rank)}: the adapter was "
                               "trained for another base model")
        layers[layer][module] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
    if not pairs:
        raise AdapterError(f"{weights_path}: holds no LoRA tensors")
    return LoraAdapter(name, rank, scaling, tuple(layers))


def add_lora(out: np.ndarray, x: np.ndarray, adapter_rows: list[tuple[LoraAdapter, np.ndarray]], layer: int,
             modules: tuple[tuple[str, slice], ...]) -> None:
    """out[rows, cols] += scaling * (x[rows] @ A.T) @ B.T for each adapter's rows and each module's columns.

    out: [T, N] (a fused projection), x: [T, K]; modules: (module name, its columns in out).
    """
    for adapter, rows in adapter_rows:
        weights = adapter.layers[layer]
        xr = x[rows]
        for module, cols in modules:
            ab = weights.get(module)
            if ab is not None:
                out[rows, cols] += adapter.scaling * _project(_project(xr, ab[0]), ab[1])


def _project(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    # x: [T, K] f32, w: [N, K] f32 -> [T, N] f32 through the batch-invariant kernel (models/linear.py), not
    # BLAS, so a token's adapter delta does not depend on how many rows share its adapter
    return linear(x, WeightMatrix("float32", w))
