"""LoraPlanner: how a step's adapted rows run: on merged copies (lora_merge "always": every adapter whose
copy fits; "auto": at most the step's most-used adapter) or on the low-rank path, with the slots, the
merged copies and the measured costs that decide it (scheduling/lora/merge_policy.py)."""

from collections import Counter
from collections.abc import Callable
from typing import Protocol

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from memory.weights import LayerWeights
from models.lora.adapter import LoraAdapter
from models.lora.merge import MergedCache, MergedRows, MergedWeights, merge_adapter, merged_nbytes
from models.lora.slots import LoraRows, LoraSlots
from models.model_spec import ModelSpec
from scheduling.lora.merge_policy import MergeMeter, candidate, choose_merge, saving_s


class SharedMerged(Protocol):
    """Where an engine's merged copies are shared with others that serve the same model and config (in a
    deployment: the adapter-cache actor), so each is built once."""

    def get(self, name: str) -> MergedWeights | None: ...

    def put(self, merged: MergedWeights) -> None: ...


class LoraPlanner:
    def __init__(self, slots: LoraSlots, base_layers: tuple[LayerWeights, ...], spec: ModelSpec, mode: str,
                 merged_bytes: int, weight_bytes: int, shared: SharedMerged | None = None,
                 decisions: DecisionLog | None = None):
        self.slots = slots
        self.decisions = decisions or DecisionLog()
        self.base_layers, self.spec = base_layers, spec
        self.shared = shared
        self.num_merged_shared = self.num_merged_builds = 0  # merged copies taken from `shared` / built here
        self.merged_build_s = 0.0
        self.mode = mode if merged_bytes > 0 else "never"
        self.merged = MergedCache(merged_bytes)
        self.meter = MergeMeter(weight_bytes)
        self.num_lora_tokens = self.num_merged_tokens = 0  # rows run on the low-rank path / on merged copies
        self._last = (0, 0)  # the last step's (rows, low-rank rows), for observe
        self._copy_bytes: dict[str, int] = {}  # adapter -> its merged copy's bytes (a name keeps its weights)

    def plan(self, row_adapter: list[str | None],
             adapter: Callable[[str], LoraAdapter]) -> tuple[LoraRows | None, MergedRows | None]:
        """row_adapter: each row's adapter (rows of one adapter adjacent); adapter: name -> its weights."""
        rows_by_adapter = Counter(a for a in row_adapter if a is not None)
        self._last = (len(row_adapter), 0)
        if not rows_by_adapter:
            return None, None
        merged = self._merged_rows(row_adapter, rows_by_adapter, adapter)
        names = set() if merged is None else {w.name for _, _, w in merged.runs}
        self._record_paths(rows_by_adapter, len(row_adapter), names)
        if merged is not None:
            self.num_merged_tokens += sum(end - start for start, end, _ in merged.runs)
            row_adapter = [None if a in names else a for a in row_adapter]
        names = sorted({a for a in row_adapter if a is not None})
        if not names:
            return None, merged
        slot = self.slots.slots_for(names, adapter) | {None: -1}
        num_lowrank = sum(a is not None for a in row_adapter)
        self.num_lora_tokens += num_lowrank
        self._last = (len(row_adapter), num_lowrank)
        return self.slots.rows(np.asarray([slot[a] for a in row_adapter], np.int32)), merged

    def forget(self, name: str) -> None:
        """A retired adapter's slot and merged copy are dropped (no request uses it)."""
        self.slots.forget(name)
        self.merged.drop(name)
        self._copy_bytes.pop(name, None)

    def _record_paths(self, rows_by_adapter: Counter, num_rows: int, merged_names: set[str]) -> None:
        """A "lora_path" decision per adapter when its path (merged / low-rank) changes; repeats are
        counted."""
        costs = self.meter.costs()
        for name, num in rows_by_adapter.items():
            path = "merged" if name in merged_names else "low-rank"
            self.decisions.record("lora_path", path,
                                  f"lora_merge={self.mode}: {num} of {num_rows} rows; measured "
                                  f"low-rank {costs.lowrank_s_per_row * 1e6:.1f} us/row, weight pass "
                                  f"{costs.weight_pass_s * 1e3:.2f} ms", subject=name)

    def observe(self, projection_s: float) -> None:
        """After the step's forward: its measured low-rank kernel and projection seconds feed the cost
        model."""
        num_rows, num_lowrank = self._last
        self.meter.observe(num_lowrank, self.slots.kernel_seconds, num_rows, projection_s)
        self.slots.kernel_seconds = 0.0

    def _merged_copy(self, adapter: LoraAdapter) -> MergedWeights:
        shared = self.shared.get(adapter.name) if self.shared is not None else None
        if shared is not None:
            self.num_merged_shared += 1
            return shared
        shard = self.slots.shard  # a tensor-parallel rank merges its part into its part of the weights
        built = merge_adapter(self.base_layers, adapter.rank_part(shard, self.spec),
                              shard.local_spec(self.spec))
        self.meter.built(built.seconds)
        self.num_merged_builds += 1
        self.merged_build_s += built.seconds
        if self.shared is not None:
            self.shared.put(built)
        return built

    def stats(self) -> dict:
        costs = self.meter.costs()
        return self.slots.stats() | self.merged.stats() | {
            "num_lora_tokens": self.num_lora_tokens, "num_merged_tokens": self.num_merged_tokens,
            "lora_merged_builds": self.num_merged_builds, "lora_merged_build_s": self.merged_build_s,
            "lora_merged_shared": self.num_merged_shared,
            "lora_merge": self.mode, "lora_lowrank_s_per_row": costs.lowrank_s_per_row,
            "lora_weight_pass_s": costs.weight_pass_s}

    def _merged_rows(self, row_adapter, rows_by_adapter: Counter, adapter) -> MergedRows | None:
        if self.mode == "never":
            return None
        costs = self.meter.costs()
        name = candidate(rows_by_adapter)
        paying = self.meter.paying(name, saving_s(rows_by_adapter[name], len(row_adapter), costs) > 0)
        held = {n for n in rows_by_adapter if self.merged.holds(n)}

        def copy_bytes(name: str) -> int:
            if name not in self._copy_bytes:
                self._copy_bytes[name] = merged_nbytes(self.base_layers, adapter(name))
            return self._copy_bytes[name]

        def fits(names: list[str]) -> bool:
            return self.merged.fits(sum(map(copy_bytes, names)))

        choice = choose_merge(self.mode, dict(rows_by_adapter), len(row_adapter), held, fits, paying, costs)
        for name in choice.build:
            self.merged.put(self._merged_copy(adapter(name)), keep=set(choice.adapters))
        if not choice.adapters:
            return None
        runs = []
        for name in choice.adapters:
            rows = [i for i, a in enumerate(row_adapter) if a == name]
            runs.append((rows[0], rows[-1] + 1, self.merged.get(name)))
        return MergedRows(tuple(sorted(runs, key=lambda r: r[0])), tuple(map(adapter, choice.build)),
                          self.merged.names)
