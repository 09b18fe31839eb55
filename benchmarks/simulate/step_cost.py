"""What a modelled worker's engine step costs, and what the deployment around it costs per call.

StepCostModel: seconds = fixed_s + decode_row_s * decode rows + prefill_token_s * prefill tokens
+ draft_row_s * draft rows + context_token_s * context tokens read (the KV attention reads: each decoding
row's context). benchmarks/fit_step_cost.py fits it by least squares to the real engine's steps and writes
benchmarks/results/step_cost.json; `default_step_cost()` reads that file when present.

Without it the built-in guess comes from the README's q8_0 decode table (TinyLlama shape, int8
activations, this 2-core VM, 2026-11-26): batch 1 37.4 tok/s (26.7 ms a step), batch 8 174.8 (45.8 ms),
batch 32 217.6 (147 ms, ~6,000 context tokens), prefill of 512 tokens at 218.7 tok/s (4.6 ms a token). A
line through the batch-1 and batch-8 steps gives 24 ms fixed and 2.7 ms a decode row; the batch-32 step's
remainder, 30 ms over ~6,000 context tokens, 5 us a context token. A draft row is verified like a decode
row (a flat-batch row with a short attention), so it is priced as one.
"""

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

STEP_COST_JSON = Path(__file__).resolve().parents[1] / "results" / "step_cost.json"


@dataclass(frozen=True)
class StepCostModel:
    fixed_s: float  # a step's cost besides its rows: streaming the weights once, Python around the forward
    decode_row_s: float
    prefill_token_s: float
    draft_row_s: float
    context_token_s: float  # per context token a decoding row's attention reads
    draft_pass_s: float = 5e-6  # the modelled n-gram proposer's lookup, per drafting request
    source: str = "built-in guess"

    def __post_init__(self):
        bad = {k: v for k, v in asdict(self).items() if isinstance(v, float) and not v >= 0.0}
        if bad:
            raise ValueError(f"StepCostModel costs must be >= 0, got {bad}")

    def seconds(self, num_decode_rows: int, num_prefill_tokens: int, num_draft_rows: int,
                num_context_tokens: int) -> float:
        return (self.fixed_s + self.decode_row_s * num_decode_rows + self.prefill_token_s * num_prefill_tokens
                + self.draft_row_s * num_draft_rows + self.context_token_s * num_context_tokens)

    def scaled(self, compute: float, bandwidth: float, source: str) -> "StepCostModel":
        """The same engine on another machine: row costs (matrix products) divide by the compute ratio, the
        fixed cost (weights streamed once a step) and context reads (KV streamed) by the bandwidth ratio."""
        return replace(self, fixed_s=self.fixed_s / bandwidth, decode_row_s=self.decode_row_s / compute,
                       prefill_token_s=self.prefill_token_s / compute, draft_row_s=self.draft_row_s / compute,
                       context_token_s=self.context_token_s / bandwidth, source=source)


BUILT_IN = StepCostModel(fixed_s=0.024, decode_row_s=0.0027, prefill_token_s=0.0046, draft_row_s=0.0027,
                         context_token_s=5e-6)


def default_step_cost(path: Path = STEP_COST_JSON) -> StepCostModel:
    """This machine's fitted model (benchmarks/fit_step_cost.py's output) when present, else BUILT_IN."""
    if not path.exists():
        return BUILT_IN
    fitted = json.loads(path.read_text())["model"]
    names = ("fixed_s", "decode_row_s", "prefill_token_s", "draft_row_s", "context_token_s")
    return StepCostModel(**{k: fitted[k] for k in names}, source=str(path.name))


def two_socket_32c(base: StepCostModel) -> StepCostModel:
    """One worker per socket of a 2 x 32-core box, against this 2-core VM. Assumed: the same cores and SIMD
    (compute x16, 32 cores against 2), and 8 DDR5 channels per socket reading ~200 GB/s against the ~40 GB/s
    this VM's read probe shows (bandwidth x5). Not measured: a named preset for planning."""
    return base.scaled(compute=16.0, bandwidth=5.0, source=f"two_socket_32c of {base.source}")


PRESETS = {"this_machine": default_step_cost, "two_socket_32c": lambda: two_socket_32c(default_step_cost())}


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
