"""The scheduler's policy: from each worker's step telemetry, its token budget, sequence cap and admission
bound, and for a speculating worker its speculation policy.

Workers report StepTelemetry about every 100 ms; the scheduler answers with that worker's Policy, which
the worker (token_budget, max_num_seqs, speculation) and the router (admission_bound) apply whenever it
arrives.

- Sequence cap, AIMD on KV pressure: a preemption or a nearly full KV pool cuts max_num_seqs to 3/4 of
  what is running (recompute wastes more than queueing); a roomy pool adds back 1/16 of the limit.
- Token budget, toward target_step_s: long steps mean long gaps between a running request's tokens
  (a big prefill chunk rode along), so the budget shrinks in proportion; short steps let it double
  again. It never drops below one decode token per running request, nor below MIN_TOKEN_BUDGET (the
  smallest prompt chunk that keeps prefill near its best fraction of the dot-product peak).
- Admission bound = max_num_seqs + max_queued: a worker whose cap was cut also admits fewer, so the
  router's Overloaded pushes back on clients instead of queues growing without end.
- Speculation: spec_policy.speculation_policy of each SpecTelemetry the worker sent, one per draft method
  it weighs (one, or every candidate of method "auto"), answered in the same order (the same function
  the in-process engine runs); it reads that telemetry alone, so a restarted scheduler answers the same.
"""

from dataclasses import dataclass

from scheduling.speculation.depth_policy import SpecTelemetry, SpeculationPolicy, speculation_policy

KV_HIGH = 0.95  # kv_usage at or above this counts as pressure
KV_LOW = 0.80  # below this the cap may grow again
# a step's token budget, at least: the smallest prompt chunk whose prefill rate is within 5% of the best
# chunk's (`python -m benchmarks.bench_chunks`, docs/performance.md "Prefill chunks"): below it a chunk
# rereads the weights for too few tokens
MIN_TOKEN_BUDGET = 64


def admission_bound(max_num_seqs: int, max_queued: int) -> int:
    """Requests the router may have outstanding on a worker: those it runs plus those it may queue."""
    return max_num_seqs + max_queued


@dataclass(frozen=True)
class StepTelemetry:
    worker_id: str
    num_running: int
    num_waiting: int
    num_steps: int  # steps since the previous report
    num_batched_tokens: int  # tokens those steps ran (prefill chunks + decode)
    step_time_s: float  # mean wall time of those steps (0 when idle)
    kv_usage: float  # used / total KV blocks
    num_preemptions: int  # since the worker started
    # per draft method; None: the worker does not speculate
    speculation: tuple[SpecTelemetry, ...] | None = None


@dataclass(frozen=True)
class Policy:
    token_budget: int
    max_num_seqs: int
    admission_bound: int  # requests the router may have outstanding on this worker
    # for a worker that sent SpecTelemetry, in its order
    speculation: tuple[SpeculationPolicy, ...] | None = None


@dataclass(frozen=True)
class PolicyLimits:
    max_token_budget: int  # EngineConfig.max_num_batched_tokens
    max_num_seqs: int  # EngineConfig.max_num_seqs
    max_queued: int  # ClusterConfig.max_queued_per_worker
    target_step_s: float  # ClusterConfig.target_step_ms / 1000


class BatchingPolicy:
    def __init__(self, limits: PolicyLimits):
        self.limits = limits
        self.policies: dict[str, Policy] = {}
        self._num_preemptions: dict[str, int] = {}

    def initial(self) -> Policy:
        lim = self.limits
        return Policy(lim.max_token_budget, lim.max_num_seqs,
                      admission_bound(lim.max_num_seqs, lim.max_queued))

    def policy(self, worker_id: str) -> Policy:
        return self.policies.get(worker_id) or self.initial()

    def update(self, t: StepTelemetry) -> Policy:
        lim, cur = self.limits, self.policy(t.worker_id)
        new_preemptions = t.num_preemptions - self._num_preemptions.get(t.worker_id, t.num_preemptions)
        self._num_preemptions[t.worker_id] = t.num_preemptions

        max_num_seqs = cur.max_num_seqs
        if new_preemptions > 0 or t.kv_usage >= KV_HIGH:
            max_num_seqs = max(1, min(max_num_seqs, max(t.num_running, 1)) * 3 // 4)
        elif t.kv_usage < KV_LOW:
            max_num_seqs = min(lim.max_num_seqs, max_num_seqs + max(1, lim.max_num_seqs // 16))

        budget = cur.token_budget
        if t.num_steps and t.step_time_s > lim.target_step_s:
            budget = int(budget * lim.target_step_s / t.step_time_s)
        elif t.num_steps and t.step_time_s < lim.target_step_s / 2:
            budget *= 2
        floor = min(lim.max_token_budget, max(MIN_TOKEN_BUDGET, t.num_running))
        budget = max(floor, min(lim.max_token_budget, budget))

        speculation = tuple(map(speculation_policy, t.speculation)) if t.speculation is not None else None
        policy = Policy(budget, max_num_seqs, admission_bound(max_num_seqs, lim.max_queued), speculation)
        self.policies[t.worker_id] = policy
        return policy
