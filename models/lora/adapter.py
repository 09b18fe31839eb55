"""LoRA adapters in the PEFT format, applied un-merged so one batch can mix adapters.

An adapted linear computes W x + scaling * B (A x), A: [r, in], B: [out, r], with each module's own rank
and scaling (models/lora/config.py). A module fused in the checkpoint (Phi-3's qkv_proj, gate_up_proj) is
kept as PEFT holds it (composition treats it as one matrix, as PEFT does) and served as its parts: the
same A and scaling, B cut into the parts' rows (the columns of our fused projections).
"""

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster_configs.errors import AdapterError, CheckpointError
from models.lora.config import FUSED_MODULES, module_key, module_shapes, read_lora_config, target_modules
from models.model_spec import ModelSpec
from models.safetensors_io import read_header, read_tensor

if TYPE_CHECKING:
    from models.tensor_parallel.shard import TensorShard

_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")


@dataclass(frozen=True)
class LoraModule:
    a: np.ndarray  # [r, in] f32
    b: np.ndarray  # [out, r] f32
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self) -> np.ndarray:
        """scaling * B A: [out, in] f32, what merging adds to the base weight."""
        return (self.scaling * (self.b.astype(np.float64) @ self.a.astype(np.float64))).astype(np.float32)


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    layers: tuple[dict[str, LoraModule], ...]  # per layer: module -> its LoRA
    # what PEFT's add_weighted_adapter reads of the config (models/lora/compose.py): r, or the largest of r
    # and rank_pattern's ranks, and use_rslora
    config_rank: int
    use_rslora: bool = False
    # a fused module -> its parts and their rows, in row order (Phi-3's qkv_proj: q_proj, k_proj, v_proj)
    fused: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)

    @property
    def module_layers(self) -> tuple[dict[str, LoraModule], ...]:
        """Per layer: each of lora_config.MODULES it adapts -> its LoRA (a fused module's parts: its A and
        scaling, their rows of its B); what the slots and merged copies hold."""
        if not self.fused:
            return self.layers
        return tuple({part: m for name, lora in layer.items() for part, m in _parts(name, lora, self.fused)}
                     for layer in self.layers)

    def rank_part(self, shard: "TensorShard", spec: ModelSpec) -> "LoraAdapter":
        """A tensor-parallel rank's part (spec: the whole model's): each module's factors cut as
        shard.lora_factors cuts them, fused modules as their parts; the adapter itself on one rank."""
        if shard.size == 1:
            return self
        layers = tuple({m: LoraModule(*shard.lora_factors(module_key(i, m), spec, lora.a, lora.b),
                                      lora.scaling)
                        for m, lora in layer.items()} for i, layer in enumerate(self.module_layers))
        return LoraAdapter(self.name, layers, self.config_rank, self.use_rslora)

    @property
    def max_rank(self) -> int:
        return max(m.rank for layer in self.layers for m in layer.values())

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for layer in self.layers for m in layer.values())


def load_lora(name: str, path: str | Path, spec: ModelSpec, max_rank: int | None = None) -> LoraAdapter:
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"{path}: not a directory; pass a PEFT adapter directory")
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise AdapterError(f"{weights_path}: missing; save adapters with safetensors (pickled "
                           "adapter_model.bin files are refused: they can run arbitrary code)")
    config = read_lora_config(path)
    shapes = target_modules(spec)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        for key, entry in read_header(weights_path).items():
            m = _KEY.fullmatch(key)
            if _adapts_experts(key, m, spec):
                raise AdapterError(f"{weights_path}: tensor {key!r} adapts a mixture-of-experts layer's "
                                   "experts or router, which numaserve does not support yet; train the "
                                   "adapter on the attention projections (q_proj, k_proj, v_proj, o_proj)")
            if m is None or m.group(2) not in shapes or int(m.group(1)) >= spec.num_layers:
                raise AdapterError(f"{weights_path}: tensor {key!r} does not adapt a supported module of "
                                   f"this {spec.num_layers}-layer {spec.architecture} (target_modules "
                                   f"{', '.join(shapes)})")
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = read_tensor(entry)
    except CheckpointError as e:  # a corrupt file: the adapter's error, in the loader's words
        raise AdapterError(str(e)) from None
    if not pairs:
        raise AdapterError(f"{weights_path}: holds no LoRA tensors")
    layers: list[dict[str, LoraModule]] = [{} for _ in range(spec.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        out_features, in_features = shapes[module]
        rank, scaling = config.rank_and_scaling(layer, module)
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise AdapterError(f"{weights_path}: layer {layer} {module} has lora_A without lora_B "
                               "or vice versa")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"{path}: layer {layer} {module} has rank {rank}, above "
                               f"max_lora_rank={max_rank}; raise max_lora_rank")
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise AdapterError(f"{weights_path}: layer {layer} {module}: lora_A {a.shape} / lora_B "
                               f"{b.shape}, expected {(rank, in_features)} / {(out_features, rank)} "
                               f"(rank {rank} from r and rank_pattern): the adapter was trained for "
                               "another base model")
        layers[layer][module] = LoraModule(np.ascontiguousarray(a, np.float32),
                                           np.ascontiguousarray(b, np.float32), scaling)
    part_rows = {m: out for m, (out, _) in module_shapes(spec).items()}
    fused = {name: tuple((p, part_rows[p]) for p in parts) for name, parts in FUSED_MODULES.items()
             if name in shapes}
    return LoraAdapter(name, tuple(layers), config.max_rank, config.use_rslora, fused)


def _adapts_experts(key: str, m: re.Match | None, spec: ModelSpec) -> bool:
    """A tensor adapting a MoE layer's MLP: its experts, its router, or an MLP module of a layer with
    experts."""
    if m is None:
        return spec.num_experts > 0 and any(part in key for part in (".experts.", ".block_sparse_moe.",
                                                                     ".mlp.gate."))
    layer = int(m.group(1))
    return layer < spec.num_layers and spec.is_moe(layer) and ".mlp." in key


def _parts(name: str, lora: LoraModule, fused: dict) -> list[tuple[str, LoraModule]]:
    if name not in fused:
        return [(name, lora)]
    ends = np.cumsum([rows for _, rows in fused[name]])
    return [(part, LoraModule(lora.a, np.ascontiguousarray(lora.b[end - rows:end]), lora.scaling))
            for (part, rows), end in zip(fused[name], ends)]


def adapter_digest(adapter: LoraAdapter) -> str:
    """A digest of what an adapter computes (every module's factors and scaling, its rank settings): equal
    for equal weights under any name (the prefix cache's disk tier keys KV by it, not by the name)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((adapter.config_rank, adapter.use_rslora, sorted(adapter.fused.items()))).encode())
    for i, layer in enumerate(adapter.layers):
        for name in sorted(layer):
            m = layer[name]
            h.update(repr((i, name, m.scaling, m.a.shape, m.b.shape, m.a.dtype.str, m.b.dtype.str)).encode())
            h.update(np.ascontiguousarray(m.a).data)
            h.update(np.ascontiguousarray(m.b).data)
    return h.hexdigest()
