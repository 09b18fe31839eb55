"""What a modelled worker's engine step costs, and what the deployment around it costs per call.

StepCostModel follows how a step runs: its rows (decode, draft and prefill tokens alike: one flat batch) go
through the matrix products, which stream every weight once whatever the rows (memory-bound: weights_s) and
do work per row (compute-bound: row_s); the step takes about the larger of the two, a smooth max
(weights_s^p + (row_s x rows)^p)^(1/p) with p = sharpness. Attention adds per (token, visible slot) pair: a
decode or draft row's context tokens (context_token_s) and a prefill chunk's pairs (prefill_pair_s), then a
fixed cost per step (Python around the forward, sampling). benchmarks/simulate/step_cost_fit.py fits it to
the real engine's steps (benchmarks/fit_step_cost.py) and writes benchmarks/results/step_cost.json, which
`default_step_cost()` reads when run from a source checkout that has it (`numaserve simulate --step-cost`
names another).

Without it the built-in guess comes from the README's q8_0 decode table (TinyLlama shape, int8 activations,
this 2-core VM, 2026-11-26): batch 1 at 26.7 ms a step is one stream of the weights; prefill of 512 tokens at
218.7 tok/s gives 4.6 ms a row; with p = 2 these give batch 8 45.5 ms (measured 45.8) and batch 32 147 ms
(measured 147). The attention costs are guesses (5 us a pair).
"""

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

# a source checkout's fitted model (benchmarks/ is not installed)
STEP_COST_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "step_cost.json"


@dataclass(frozen=True)
class StepShape:
    """What a step costs is a function of."""
    num_decode_rows: int
    num_prefill_tokens: int
    num_draft_rows: int
    num_context_tokens: int  # the decode and draft rows' contexts (slots each attends to)
    num_prefill_pairs: int  # (prefill token, visible slot) pairs of the prefill chunks: prefill_pairs()


def prefill_pairs(num_new_tokens: int, num_computed_tokens: int) -> int:
    """A prefill chunk's attention pairs: each new token sees the computed slots and the new ones up to it."""
    return num_new_tokens * num_computed_tokens + num_new_tokens * (num_new_tokens + 1) // 2


@dataclass(frozen=True)
class StepCostModel:
    fixed_s: float  # per step besides the forward's kernels: Python around it, sampling
    weights_s: float  # streaming the weights once (memory-bound)
    row_s: float  # one row's matrix products (compute-bound): a decode, draft or prefill token
    sharpness: float  # p of the smooth max of the two; large p: the plain max
    context_token_s: float  # per context token a decode or draft row attends to
    prefill_pair_s: float  # per (prefill token, visible slot) pair
    draft_pass_s: float = 5e-6  # the modelled n-gram proposer's lookup, per drafting request
    source: str = "built-in guess"

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if isinstance(v, float) and not v >= 0.0}
        if bad:
            raise ValueError(f"StepCostModel costs must be >= 0, got {bad}")
        if not self.sharpness >= 1.0:
            raise ValueError(f"sharpness must be >= 1 (1: the sum), got {self.sharpness}")

    def seconds(self, shape: StepShape) -> float:
        rows = shape.num_decode_rows + shape.num_prefill_tokens + shape.num_draft_rows
        p = self.sharpness
        matmul = (self.weights_s ** p + (self.row_s * rows) ** p) ** (1.0 / p)
        return (self.fixed_s + matmul + self.context_token_s * shape.num_context_tokens
                + self.prefill_pair_s * shape.num_prefill_pairs)

    def scaled(self, compute: float, bandwidth: float, source: str) -> "StepCostModel":
        """The same engine on another machine with the same cores: the weights' stream divides by the
        bandwidth ratio; rows and attention by the compute ratio (attention reads its KV at ~1-3 GB/s here,
        far below the memory's ~40: it is compute-bound); the fixed cost (one core's Python) stays."""
        return replace(self, weights_s=self.weights_s / bandwidth, row_s=self.row_s / compute,
                       context_token_s=self.context_token_s / compute,
                       prefill_pair_s=self.prefill_pair_s / compute, source=source)


BUILT_IN = StepCostModel(fixed_s=0.0, weights_s=0.0267, row_s=0.0046, sharpness=2.0, context_token_s=5e-6,
                         prefill_pair_s=5e-6)
FITTED = ("fixed_s", "weights_s", "row_s", "sharpness", "context_token_s", "prefill_pair_s")


def default_step_cost(path: Path = STEP_COST_JSON) -> StepCostModel:
    """This machine's fitted model (benchmarks/fit_step_cost.py's output) when present, else BUILT_IN."""
    if not path.exists():
        return BUILT_IN
    try:
        fitted = json.loads(path.read_text())["model"]
        return StepCostModel(**{k: fitted[k] for k in FITTED}, source=str(path.name))
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path.name} is not a fitted step-cost model ({type(e).__name__}: {e}); write one "
                         "with `python -m benchmarks.fit_step_cost`") from None


def two_socket_32c(base: StepCostModel) -> StepCostModel:
    """One worker per socket of a 2 x 32-core box, against this 2-core VM. Assumed: the same cores and SIMD
    (compute x16, 32 cores against 2), and 8 DDR5 channels per socket reading ~200 GB/s against the ~40 GB/s
    this VM's read probe shows (bandwidth x5). Not measured: a named preset for planning."""
    return base.scaled(compute=16.0, bandwidth=5.0, source=f"two_socket_32c of {base.source}")


# name -> the model from a fitted file (when it exists)
PRESETS = {"this_machine": default_step_cost,
           "two_socket_32c": lambda path=STEP_COST_JSON: two_socket_32c(default_step_cost(path))}


@dataclass(frozen=True)
class DeploymentCost:
    """CPU seconds the router and the callers (ns.Client, HTTP actors: one per machine) spend per call; each
    is one Python event loop, modelled as a FIFO server. Measured (README, "HTTP load benchmark"): 1.2 ms of
    router CPU and 0.9 ms of HTTP-actor CPU per relayed chunk. Guessed: an admission (tokenized by the
    caller, then routed) and the end call."""
    router_admission_s: float = 0.5e-3
    router_finish_s: float = 0.2e-3
    router_chunk_s: float = 1.2e-3  # "relay" routing only: every chunk crosses the router
    caller_admission_s: float = 0.5e-3  # tokenize and validate in the caller
    caller_chunk_s: float = 0.9e-3


FREE_DEPLOYMENT = DeploymentCost(0.0, 0.0, 0.0, 0.0, 0.0)  # every call free: only the workers' steps cost
