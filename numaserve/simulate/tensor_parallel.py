"""A tensor-parallel worker in the simulator: a group of `size` ranks, each on its own NUMA node.

Each rank streams 1 / size of the weights from its own node's memory (the step's memory-bound part divides by
size: every node's bandwidth reads at once), does 1 / size of each row's products and of the attention (its
heads), and its KV pool holds its heads (the group's pool holds size times the tokens). What it adds: two
all-reduces a layer and the embedding's, of the step's rows x hidden float32, and the logits' gather (a row of
vocab / size a rank, priced as an all-reduce of that size); the Python around the forward (fixed_s: rank 0
schedules and samples) does not divide. The all-reduce's cost is a line fitted to
`python -m benchmarks.bench_all_reduce`'s medians (latency + bytes / rate)."""

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from numaserve.simulate.step_cost import StepCostModel, StepShape

# a source checkout's all-reduce benchmark (benchmarks/ is not installed)
ALL_REDUCE_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "all_reduce.json"


@dataclass(frozen=True)
class AllReduceCost:
    """One all-reduce of nbytes between the group's ranks: latency_s + nbytes * per_byte_s."""

    latency_s: float
    per_byte_s: float
    source: str = "built-in guess"

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.per_byte_s


# bench_all_reduce on the 2-core Zen 3 VM, 2026-11-29 (two pinned processes): 1 x 4096 float32 9.6 us,
# 32 x 4096 219 us
BUILT_IN_ALL_REDUCE = AllReduceCost(latency_s=8e-6, per_byte_s=4.0e-10)


def fit_all_reduce(path: Path = ALL_REDUCE_JSON) -> AllReduceCost:
    """The line through the benchmark's medians (bytes -> seconds) of least relative squares (a plain fit
    would follow the large sizes and miss the small ones' latency, what decode pays); BUILT_IN_ALL_REDUCE
    without the file."""
    if not path.exists():
        return BUILT_IN_ALL_REDUCE
    rows = json.loads(path.read_text())["rows"].values()
    nbytes = np.array([r["bytes"] for r in rows], np.float64)
    seconds = np.array([r["median_us"] for r in rows], np.float64) * 1e-6
    per_byte, latency = np.polyfit(nbytes, seconds, 1, w=1.0 / seconds)
    return AllReduceCost(max(float(latency), 0.0), max(float(per_byte), 0.0),
                         f"{path.name} ({len(nbytes)} sizes, {json.loads(path.read_text())['date']})")


@dataclass(frozen=True)
class ModelDims:
    """What the collectives move: the residual stream's width, the layers, the vocabulary."""

    num_layers: int = 22  # TinyLlama's shape: the step-cost model's
    hidden: int = 2048
    vocab: int = 32000


@dataclass(frozen=True)
class TensorParallelStepCost:
    """A group's step: `node`'s costs (one node's whole model) over size ranks, plus the collectives."""

    node: StepCostModel
    size: int
    all_reduce: AllReduceCost
    dims: ModelDims = ModelDims()

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")

    @property
    def rank(self) -> StepCostModel:
        """One rank's share of a node's step (fixed_s stays whole)."""
        n = self.size
        return replace(self.node, weights_s=self.node.weights_s / n, row_s=self.node.row_s / n,
                       context_token_s=self.node.context_token_s / n,
                       prefill_pair_s=self.node.prefill_pair_s / n)

    @property
    def draft_pass_s(self) -> float:
        return self.node.draft_pass_s

    def collectives_s(self, shape: StepShape) -> float:
        if self.size == 1:
            return 0.0
        rows = shape.num_decode_rows + shape.num_prefill_tokens + shape.num_draft_rows
        sampled = shape.num_decode_rows + shape.num_draft_rows
        d = self.dims
        residual = (2 * d.num_layers + 1) * self.all_reduce.seconds(rows * d.hidden * 4)
        return residual + self.all_reduce.seconds(max(sampled, 1) * -(-d.vocab // self.size) * 4)

    def seconds(self, shape: StepShape) -> float:
        return self.rank.seconds(shape) + self.collectives_s(shape)
