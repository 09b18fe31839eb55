"""LoraSlots: the adapters a worker holds ready for the kernels, at most max_loras, least recently used out.

Per layer and module one stacked buffer of max_loras slots (kernels/lora.py's layout): A [S, R, in] and B^T
[S, R, out] and the module's scaling, R = max_lora_rank, zero-filled (pages are committed only where a
slot's rank writes them). Reading A and B is most of what an adapter costs at decode, so they are stored
like the base weights they adapt (slot_dtype): float32 for a float32 or float16 engine (exact against PEFT;
float16 weights are served exactly, so are their adapters), bf16 for a bf16 one (each value's relative error
2^-9, half the bytes), q8_0 for a quantized one (34 bytes per 32 values, GGML's rounding, the base linear's
dequantization) when every dimension is a multiple of 32. A step's adapters are all given slots before it
runs (the batcher admits at most max_loras distinct adapters into the running set), loading any that are not
held and evicting the least recently used adapter the step does not use.
"""

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kernels.formats.bf16 import to_bf16
from kernels.formats.quant import QK, quantize_q8_0
from kernels.lora import lora_shrink_expand
from memory.heap import untouched_zeros
from models.lora.adapter import LoraAdapter
from models.lora.config import MODULES, module_shapes
from models.model_spec import ModelSpec
from models.tensor_parallel.shard import WHOLE_MODEL, TensorShard

FUSED_MODULES = 3  # modules of the widest fused projection (q, k, v): add_lora pads its tuples to this
STORED = {"float32": np.float32, "bfloat16": np.uint16, "q8_0": np.int8}  # slot dtype -> its arrays' dtype


def slot_dtype(weight_dtype: str, spec: ModelSpec) -> str:
    """How an engine with these base weights stores its adapters' A and B (see the module's docstring)."""
    if weight_dtype in ("float32", "float16"):
        return "float32"
    whole_blocks = all(n % QK == 0 and k % QK == 0 for n, k in module_shapes(spec).values())
    return "q8_0" if weight_dtype not in ("float32", "bfloat16") and whole_blocks else "bfloat16"


def store(dtype: str, w: np.ndarray, data: np.ndarray, scales: np.ndarray) -> None:
    """w: [r, width] f32 -> data [r, width] in dtype's storage (q8_0: and scales [r, width // 32] fp16
    bits)."""
    if dtype == "q8_0":
        quantize_q8_0(np.ascontiguousarray(w, np.float32), data, scales)
    else:
        data[:] = w if dtype == "float32" else to_bf16(w)


class LoraSlots:
    def __init__(self, spec: ModelSpec, max_loras: int, max_rank: int, dtype: str = "float32",
                 shard: TensorShard = WHOLE_MODEL):
        """spec: the whole model's; shard: the tensor-parallel rank whose part of each adapter the slots hold
        (its modules' shapes, TensorShard.lora_factors)."""
        self.spec, self.shard = spec, shard
        shapes = module_shapes(shard.local_spec(spec))
        L, S, R = spec.num_layers, max_loras, max_rank
        self.dtype = dtype  # "float32" | "bfloat16" | "q8_0"
        store = STORED[dtype]

        # q8_0's fp16 scale per 32 columns; [L, S, 1, 1] unread otherwise
        def scales(width: int) -> np.ndarray:
            return np.zeros((L, S, R, width // QK) if dtype == "q8_0" else (L, S, 1, 1), np.uint16)

        self.a = {m: untouched_zeros((L, S, R, k), store) for m, (_, k) in shapes.items()}  # [L, S, R, in]
        self.bt = {m: untouched_zeros((L, S, R, n), store) for m, (n, _) in shapes.items()}  # [L, S, R, out]
        self.a_scales = {m: scales(k) for m, (_, k) in shapes.items()}  # [L, S, R, in // 32]
        self.bt_scales = {m: scales(n) for m, (n, _) in shapes.items()}  # [L, S, R, out // 32]
        self.ranks = {m: np.zeros((L, S), np.int32) for m in MODULES}  # 0: the slot's adapter leaves m alone
        self.scalings = {m: np.zeros((L, S), np.float32) for m in MODULES}
        self.held: OrderedDict[str, int] = OrderedDict()  # adapter name -> slot, least recently used first
        self.free = list(range(S - 1, -1, -1))
        self.loads: list[tuple[int, LoraAdapter]] = []  # (slot, adapter) loaded since take_loads()
        self.num_hits = self.num_misses = self.num_evictions = self.bytes_loaded = 0
        self.kernel_seconds = 0.0  # time in the low-rank kernels, summed (the runner reads and resets it)

    @property
    def max_loras(self) -> int:
        return len(self.ranks[MODULES[0]][0])

    def slots_for(self, names: Iterable[str], adapter: Callable[[str], LoraAdapter]) -> dict[str, int]:
        """A slot for each adapter a step uses (at most max_loras), loading the missing ones by name."""
        names = list(dict.fromkeys(names))
        if len(names) > self.max_loras:
            raise ValueError(f"a step uses {len(names)} adapters, more than max_loras={self.max_loras}")
        for name in names:
            if name in self.held:
                self.num_hits += 1
                self.held.move_to_end(name)
            else:
                self.num_misses += 1
                self.load(adapter(name), self._take_slot(names))
        return {name: self.held[name] for name in names}

    def _take_slot(self, in_use: list[str]) -> int:
        if self.free:
            return self.free.pop()
        victim = next(n for n in self.held if n not in in_use)  # least recently used first
        self.num_evictions += 1
        return self.held.pop(victim)

    def load(self, adapter: LoraAdapter, slot: int) -> None:
        """The adapter (its part on this rank) into the slot."""
        for m in MODULES:
            self.ranks[m][:, slot] = 0
        for i, layer in enumerate(adapter.rank_part(self.shard, self.spec).module_layers):
            for m, lora in layer.items():
                r = lora.rank
                store(self.dtype, lora.a, self.a[m][i, slot, :r], self.a_scales[m][i, slot, :r])
                store(self.dtype, lora.b.T, self.bt[m][i, slot, :r], self.bt_scales[m][i, slot, :r])
                self.ranks[m][i, slot] = r
                self.scalings[m][i, slot] = lora.scaling
        self.bytes_loaded += adapter.nbytes
        for stale in [n for n, s in self.held.items() if s == slot]:  # a follower's: rank 0 evicted it
            del self.held[stale]
        self.held[adapter.name] = slot
        if self.shard.size > 1 and self.shard.rank == 0:  # the followers are told; they tell nobody
            self.loads.append((slot, adapter))

    def forget(self, name: str) -> None:
        """The adapter's slot back to the free ones (a retired adapter no request uses)."""
        slot = self.held.pop(name, None)
        if slot is not None:
            for m in MODULES:
                self.ranks[m][:, slot] = 0
            self.free.append(slot)

    def take_loads(self) -> list[tuple[int, LoraAdapter]]:
        """The (slot, adapter) loads since the last call: what rank 0 sends its followers before the forward
        that reads them (models/tensor_parallel/collectives.py)."""
        loads, self.loads = self.loads, []
        return loads

    def rows(self, row_slot: np.ndarray) -> "LoraRows":
        """A step's rows in the kernel's terms: row_slot [T] int32 (-1: no adapter), cut into runs of one
        slot."""
        starts = np.flatnonzero(np.diff(row_slot, prepend=-2) != 0)  # where each run of equal slots begins
        ends = np.append(starts[1:], len(row_slot))
        keep = row_slot[starts] >= 0
        return LoraRows(starts[keep].astype(np.int64), ends[keep].astype(np.int64), row_slot[starts[keep]],
                        self)

    def stats(self) -> dict:
        """hits / misses: a step's adapters found in a slot or loaded into one (one count per step and
        adapter)."""
        return {"lora_slot_hits": self.num_hits, "lora_slot_misses": self.num_misses,
                "lora_slot_evictions": self.num_evictions, "lora_slot_bytes_loaded": self.bytes_loaded,
                "lora_slots_held": list(self.held)}


@dataclass(frozen=True)
class LoraRows:
    """A step's rows with an adapter, as runs of rows of one slot (LoraSlots.rows)."""
    starts: np.ndarray  # [G] int64: run g is rows starts[g]:ends[g]
    ends: np.ndarray  # [G] int64
    slots: np.ndarray  # [G] int32: its slot
    holder: LoraSlots


def padded(per_module: Sequence) -> tuple:
    """per_module as a tuple of FUSED_MODULES entries, its last repeated (kernels/lora.py reads the first
    len(per_module)): numba compiles the kernel once for every fused projection, not once per length."""
    return tuple(per_module) + (per_module[-1],) * (FUSED_MODULES - len(per_module))


def add_lora(out: np.ndarray, x: np.ndarray, lora: LoraRows | None, layer: int,
             modules: tuple[tuple[str, slice], ...]) -> None:
    """out[t, cols] += row t's adapter delta for each module's columns (kernels/lora.py), in one call.

    out: [T, N] (a fused projection), x: [T, K] C-contiguous; modules: (module name, its columns in out),
    in column order.
    """
    if lora is None:
        return
    start = time.perf_counter()
    h = lora.holder
    names = [m for m, _ in modules]
    offsets = np.array([0] + [cols.indices(out.shape[1])[1] for _, cols in modules], np.int64)
    parts = (h.a, h.a_scales, h.bt, h.bt_scales, h.ranks, h.scalings)
    lora_shrink_expand(x, lora.starts, lora.ends, lora.slots,
                       *(padded([part[m][layer] for m in names]) for part in parts), offsets, out)
    h.kernel_seconds += time.perf_counter() - start
