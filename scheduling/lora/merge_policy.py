"""Merge or not: per step, whether one adapter's rows run on its merged weights (models/lora/merge.py) instead
of the base weights plus the low-rank path (kernels/lora.py).

Cost model of one step, fed by measured times (MergeMeter keeps them as moving averages):
- low-rank: the LoRA kernels' measured seconds per adapted row, times the adapter's rows;
- merged: nothing for the adapter's rows, but if other rows share the step the projections run twice, once
  over the merged copy: the measured seconds of the projections on a small step (a pass over the weights,
  which is what a decode step's linear layers cost; the rows' own arithmetic is paid either way).
So merging pays when an adapter holds every row of a step (a single-tenant burst), or enough rows (a long
prefill) that its low-rank work outweighs a second pass over the weights. A copy that is not built yet
costs its build (measured at the last build; before any, the weights' bytes at BUILD_BYTES_PER_S) once: it
is built only after BURST_STEPS steps in a row in which merging that adapter would have paid, and only if
those steps' savings would have paid for the build.
Modes (EngineConfig.lora_merge): "never"; "always": every adapter's rows run on its merged copy (built when
needed, as far as the copies fit lora_merged_bytes together), so a request takes the same path whatever
it is batched with; "auto": the model above, for the adapter with most rows in the step (its requests'
rows then round one way or the other depending on the step).
"""

from collections.abc import Callable
from dataclasses import dataclass

BURST_STEPS = 8
BUILD_BYTES_PER_S = 2e8  # dequantize + add + requantize, a prior until a build is timed
EMA = 0.2


@dataclass(frozen=True)
class MergeCosts:
    lowrank_s_per_row: float  # the LoRA kernels' seconds per adapted row
    weight_pass_s: float  # the projections' seconds on a small step
    build_s: float  # building one merged copy


@dataclass(frozen=True)
class MergeChoice:
    adapters: tuple[str, ...] = ()  # whose rows run on merged weights this step (none: every row low-rank)
    build: tuple[str, ...] = ()  # of those, the ones whose merged copy is built first


def saving_s(rows: int, num_rows: int, costs: MergeCosts) -> float:
    """Seconds merging an adapter with `rows` of a step's `num_rows` rows would save this step."""
    return rows * costs.lowrank_s_per_row - (costs.weight_pass_s if rows < num_rows else 0.0)


def candidate(rows_by_adapter: dict[str, int]) -> str:
    """The adapter a step would merge: the one with most rows (ties: the first name)."""
    return max(sorted(rows_by_adapter), key=rows_by_adapter.__getitem__)


def choose_merge(mode: str, rows_by_adapter: dict[str, int], num_rows: int, built: set[str],
                 fits: Callable[[list[str]], bool], num_paying_steps: int, costs: MergeCosts) -> MergeChoice:
    """rows_by_adapter: the step's adapted rows per adapter; built: adapters with a merged copy held; fits:
    whether these adapters' copies would fit the merged-bytes bound together; num_paying_steps: steps in a
    row, this one included, in which merging the candidate would have saved time."""
    if mode == "never" or not rows_by_adapter:
        return MergeChoice()
    if mode == "always":  # most rows first, as many as fit together
        chosen: list[str] = []
        for name in sorted(rows_by_adapter, key=lambda n: (-rows_by_adapter[n], n)):
            if fits(chosen + [name]):
                chosen.append(name)
        return MergeChoice(tuple(chosen), tuple(n for n in chosen if n not in built))
    name = candidate(rows_by_adapter)
    saving = saving_s(rows_by_adapter[name], num_rows, costs)
    if saving <= 0:
        return MergeChoice()
    if name in built:
        return MergeChoice((name,))
    if num_paying_steps >= BURST_STEPS and num_paying_steps * saving >= costs.build_s and fits([name]):
        return MergeChoice((name,), (name,))
    return MergeChoice()


class MergeMeter:
    """Moving averages of what the cost model reads, from each step's measured times."""

    def __init__(self, weight_bytes: int):
        self.lowrank_s_per_row = 0.0  # unknown until measured: no merging on a guess
        self.weight_pass_s = weight_bytes / 1e10  # a prior: the weights read at 10 GB/s
        self.build_s = weight_bytes / BUILD_BYTES_PER_S
        self.candidate: str | None = None
        self.num_paying_steps = 0

    def costs(self) -> MergeCosts:
        return MergeCosts(self.lowrank_s_per_row, self.weight_pass_s, self.build_s)

    def paying(self, name: str | None, paid: bool) -> int:
        """Count the steps in a row in which merging `name` would have paid; -> the count."""
        if not paid or name != self.candidate:
            self.candidate, self.num_paying_steps = (name if paid else None), 0
        self.num_paying_steps += paid
        return self.num_paying_steps

    def observe(self, lowrank_rows: int, lowrank_s: float, num_rows: int, linear_s: float,
                small_step_rows: int = 32) -> None:
        if lowrank_rows:
            self._average("lowrank_s_per_row", lowrank_s / lowrank_rows)
        if num_rows <= small_step_rows:
            self._average("weight_pass_s", linear_s)

    def built(self, seconds: float) -> None:
        self.build_s = seconds

    def _average(self, field: str, value: float) -> None:
        old = getattr(self, field)
        setattr(self, field, value if old == 0.0 else old + EMA * (value - old))
