"""Merged LoRA weights: W + scaling * B A for every adapted projection, in the base weight's own format.

A merged copy serves one adapter's rows with the base linear alone (no low-rank work), at the price of a
second copy of the projections: as many bytes as the model's linear weights (float32 exact; bf16
rounded; q8_0 / q4_0 requantized, so its outputs differ from the low-rank path's by one more
quantization). MergedCache keeps an engine's merged copies, least recently used out past max_bytes.
"""

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from memory.matrices import Bf16Matrix, BlockInt8Matrix, Int8Matrix, Matrix, StackedMatrix, WeightMatrix
from memory.weights import PROJECTIONS, LayerWeights
from models.linear import dequantize
from models.lora.adapter import LoraAdapter
from models.lora.config import module_shapes
from models.model_spec import ModelSpec

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}  # a layer's fused weights and the modules they stack, in row order


@dataclass(frozen=True)
class MergedLayer:
    """One layer's merged copies of the fused projections an adapter adapts; None where the base's serves."""
    qkv: Matrix | None = None  # [q_size + 2 * kv_size, hidden]
    o: Matrix | None = None  # [hidden, q_size]
    gate_up: Matrix | None = None  # [2 * intermediate, hidden]
    down: Matrix | None = None  # [hidden, intermediate]

    def projection(self, name: str) -> Matrix | None:
        """The merged copy of a projection named in PROJECTIONS, None if the adapter leaves it alone."""
        return getattr(self, name)

    def adapted(self) -> dict[str, Matrix]:
        """name -> merged copy of each projection the adapter adapts."""
        return {name: w for name in PROJECTIONS if (w := self.projection(name)) is not None}


@dataclass(frozen=True)
class MergedWeights:
    name: str  # the adapter's
    layers: tuple[MergedLayer, ...]  # [num_layers]
    nbytes: int
    seconds: float  # what building it took

    def local_copy(self) -> "MergedWeights":
        """The same weights in this process's own memory (from read-only object-store buffers, say: a
        worker's copy is then NUMA-local, first touched by its pinned thread)."""
        def copy(w):
            return replace(w, data=np.array(w.data), scales=None if w.scales is None else np.array(w.scales))
        return replace(self, layers=tuple(replace(layer, **{k: copy(w) for k, w in layer.adapted().items()})
                                          for layer in self.layers))


def merge_adapter(base_layers: Sequence[LayerWeights], adapter: LoraAdapter,
                  spec: ModelSpec) -> MergedWeights:
    """The adapter merged into a copy of every fused projection it adapts (the others stay the base's)."""
    start = time.perf_counter()
    shapes = module_shapes(spec)  # module -> (out, in)
    layers, nbytes = [], 0
    for base, lora in zip(base_layers, adapter.module_layers):
        merged = MergedLayer()
        for key, modules in FUSED.items():
            if not any(m in lora for m in modules):
                continue  # the base weight serves
            delta = np.concatenate([lora[m].delta() if m in lora else np.zeros(shapes[m], np.float32)
                                    for m in modules])
            w = base.projection(key)
            copy = _reencoded(w, dequantize(w) + delta)
            merged = replace(merged, **{key: copy})
            nbytes += copy.nbytes
        layers.append(merged)
    return MergedWeights(adapter.name, tuple(layers), nbytes, time.perf_counter() - start)


def merged_nbytes(base_layers: Sequence[LayerWeights], adapter: LoraAdapter) -> int:
    """What merge_adapter's copy of these layers would hold, in bytes."""
    return sum(base.projection(key).nbytes for base, lora in zip(base_layers, adapter.module_layers)
               for key, modules in FUSED.items() if any(m in lora for m in modules))


@dataclass(frozen=True)
class MergedRows:
    """A step's rows that run on merged copies: per adapter one run of the batch (rows come grouped by
    adapter), in row order: (start, end, its merged weights). For tensor-parallel followers, which merge
    their own parts: the adapters whose copies this step made (built), and the names held after it."""
    runs: tuple[tuple[int, int, MergedWeights], ...]
    built: tuple[LoraAdapter, ...] = ()
    held: tuple[str, ...] = ()


def _reencoded(base: Matrix, dense: np.ndarray) -> Matrix:
    """dense [N, K] f32 in base's format and layout (a StackedMatrix part by part)."""
    if isinstance(base, StackedMatrix):
        return StackedMatrix(tuple(_reencoded(p, dense[a:b])
                                   for p, (a, b) in zip(base.parts, base.row_ranges())))
    if isinstance(base, (Int8Matrix, Bf16Matrix, BlockInt8Matrix)):  # packed for its activations: so is it
        return base.repacked(WeightMatrix.from_float(dense, base.dtype))
    return WeightMatrix.from_float(dense, base.dtype)


class MergedCache:
    """An engine's merged copies by adapter name, least recently used out past max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._held: OrderedDict[str, MergedWeights] = OrderedDict()
        self.num_evictions = 0

    def get(self, name: str) -> MergedWeights | None:
        merged = self._held.get(name)
        if merged is not None:
            self._held.move_to_end(name)
        return merged

    def holds(self, name: str) -> bool:
        return name in self._held

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._held)

    def put(self, merged: MergedWeights, keep: set[str]) -> None:
        """Hold a new copy; past max_bytes drop the least recently used ones not in keep (the step's)."""
        self._held[merged.name] = merged
        for name in [n for n in self._held if n not in keep and n != merged.name]:
            if self.nbytes <= self.max_bytes:
                break
            del self._held[name]
            self.num_evictions += 1

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.max_bytes

    def drop(self, name: str) -> None:
        self._held.pop(name, None)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self._held.values())

    def stats(self) -> dict:
        return {"lora_merged_evictions": self.num_evictions, "lora_merged_bytes": self.nbytes,
                "lora_merged_held": list(self._held)}
