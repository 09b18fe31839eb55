"""Speculation policy: per step and request, the draft depth that maximizes measured goodput.

Goodput of a step = expected tokens it appends / its expected cost. A request drafting d tokens appends
1 + sum_{i<d} prod_{j<=i} a_j tokens in expectation (a_j: the EMA of the conditional acceptance at draft
position j). A step costs fixed_s + per_token_s * num_tokens, fitted by least squares to the recent steps'
measured (num_tokens, seconds), plus the proposer's passes: one per draft position, each
draft_s_per_position + draft_s_per_token * its tokens, fitted the same way to the passes it timed. Before
the proposer has been timed its cost is the proposer's own prior, a fraction of the target step's (a
draft model: its share of the target's layers and of its parameters), so a draft model that cannot pay
is not tried at full depth first. The same acceptance that pays
at batch 1 loses at batch 32: a decode step at batch 1 reads all weights for one token, so drafts ride
almost free, while at batch 32 a draft token costs as much as another request's token and must be
accepted often enough to beat it.

Draft tokens compete across requests by their marginal expected tokens: every prefix of that ranking is
the best allocation of its size, so `choose_depths` evaluates goodput for each total and keeps the best.

Modes scale what a draft token is charged (`draft_cost_factor`):
- auto: its measured cost, raised under pressure: waiting requests (a draft token takes budget a prefill
  chunk could use) and a filling KV pool (draft slots push toward preemption);
- latency_first: the running requests come first: waiting requests add nothing;
- throughput_first: 1.25x its cost (only clearly paying drafts) and waiting requests count fully;
- on: always the configured depth. Every mode respects max_compute_fraction and the token budget; all but
  "on" stop drafting when the KV pool is nearly full.
When no draft has been verified for PROBE_INTERVAL steps, the policy probes at depth 1 so that a
returning acceptance is seen (acceptance is only measured where drafts are made), unless drafting could
not pay even at full acceptance (a proposer as dear as the target). A proposer that must
catch up on every token it missed (a draft model runs them through its own KV) probes one request, and
each probe that does not bring drafting back doubles the wait (up to MAX_PROBE_BACKOFF times).

Who runs what: the engine's SpeculationController (scheduling/speculation/controller.py) measures (acceptance
EMAs, step and proposer cost samples, probe counts) and `telemetry()` hands that state over as a
SpecTelemetry record; the pure `speculation_policy(telemetry)` decides the SpeculationPolicy;
`choose_depths` applies it to each step's actual batch. The in-process LLM runs all three itself. In a
deployment a worker sends its SpecTelemetry inside StepTelemetry, the scheduler actor runs
speculation_policy on it (scheduling/policy.py) and pushes the answer back with the batching policy.
Before the first answer a worker runs its own controller; after it, it keeps the last pushed policy until
the next, also while the scheduler is dead or restarting (the scheduler keeps no speculation state, so a
restarted one answers as the old one would have).
"""

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from cluster_configs.speculation_config import SpeculationConfig
from scheduling.speculation.estimators import PRIOR_SLOPE_RATIO, fit_step_cost

PROBE_INTERVAL = 64  # steps without a verified draft before a depth-1 probe
MAX_PROBE_BACKOFF = 16  # a catching-up proposer's probes wait at most this times PROBE_INTERVAL
KV_SOFT, KV_HIGH = 0.80, 0.95  # KV usage where draft pressure starts / drafting stops
MODE_BIAS = {"auto": 1.0, "latency_first": 1.0, "throughput_first": 1.25}
QUEUE_WEIGHT = {"auto": 0.5, "latency_first": 0.0, "throughput_first": 1.0}
KV_WEIGHT = 1.0


@dataclass(frozen=True)
class SpeculationPolicy:
    """What a worker needs to choose each step's depths: small plain data, pushed by the scheduler."""
    mode: str  # SpeculationConfig.mode
    max_depth: int  # 0 = no drafting (method off, or the KV pool nearly full)
    accept_rates: tuple[float, ...]  # per-position acceptance EMA, len = num_speculative_tokens
    fixed_s: float  # step cost fit: fixed_s + per_token_s * num_tokens
    per_token_s: float
    draft_s_per_position: float  # a proposer pass (one per draft position): this + draft_s_per_token * tokens
    draft_cost_factor: float  # draft tokens are charged this times their cost (mode bias x pressure)
    max_compute_fraction: float
    probe: bool = False  # depth 1 this step, to re-measure acceptance
    draft_s_per_token: float = 0.0
    probe_width: int | None = None  # requests a probe drafts for (None: all)
    # the slope over every recent step (prefill chunks and tree steps too): what a token costs past the sizes
    # per_token_s was fitted at, where a memory-bound step turns compute-bound (a tree's extra nodes)
    wide_per_token_s: float | None = None  # None: per_token_s

    @classmethod
    def off(cls) -> "SpeculationPolicy":
        return cls("auto", 0, (), 1.0, PRIOR_SLOPE_RATIO, 0.0, 1.0, 1.0)


@dataclass(frozen=True)
class SpecTelemetry:
    """All that speculation_policy reads about one engine, as plain data: its config and proposer, the
    controller's estimators and the last step's load. A worker sends it inside StepTelemetry."""
    config: SpeculationConfig
    accept_rates: tuple[float, ...]  # per-position acceptance EMA, len = num_speculative_tokens
    step_costs: tuple[tuple[int, float], ...]  # recent steps (the cost fit's window): (tokens, seconds)
    draft_pass_costs: tuple[tuple[int, float], ...] = ()  # recent proposer passes: (tokens, seconds)
    cost_prior: tuple[float, float] = (0.0, 0.0)  # Proposer.cost_prior
    catches_up: bool = False  # Proposer.catches_up
    num_requests: int = 0  # the last step's batch size (0: no step yet)
    num_waiting: int = 0  # queue depth after that step was planned
    kv_usage: float = 0.0  # used / total KV blocks after that step
    num_steps_without_drafts: int = 0  # steps with requests since a draft was last verified
    num_idle_probes: int = 0  # probes since drafting last paid by itself

    def summary(self) -> dict:
        """For stats(): the fields without the cost windows, which are counted instead."""
        fields = {k: v for k, v in vars(self).items()
                  if k not in ("config", "step_costs", "draft_pass_costs")}
        return {"method": self.config.method, "mode": self.config.mode, **fields,
                "num_step_costs": len(self.step_costs), "num_draft_pass_costs": len(self.draft_pass_costs)}


def probe_interval(catches_up: bool, num_idle_probes: int) -> int:
    """Steps without a verified draft before a probe; a catching-up proposer backs off while probes find
    no pay."""
    return PROBE_INTERVAL * (min(2 ** num_idle_probes, MAX_PROBE_BACKOFF) if catches_up else 1)


def speculation_policy(t: SpecTelemetry) -> SpeculationPolicy:
    """The policy for one engine, from its telemetry alone (no state: the engine and the scheduler actor
    both call this)."""
    cfg = t.config
    if not cfg.enabled:
        return SpeculationPolicy.off()
    max_depth = cfg.num_speculative_tokens
    if cfg.mode != "on" and t.kv_usage >= KV_HIGH:
        max_depth = 0
    factor = 1.0
    if cfg.mode != "on":
        queue = min(1.0, t.num_waiting / max(1, t.num_requests))
        kv = min(1.0, max(0.0, (t.kv_usage - KV_SOFT) / (KV_HIGH - KV_SOFT)))
        factor = MODE_BIAS[cfg.mode] * (1.0 + QUEUE_WEIGHT[cfg.mode] * queue) * (1.0 + KV_WEIGHT * kv)
    # the decisions are about steps of about num_requests * (1 + depth) tokens: fit the cost there
    num_requests = max(t.num_requests, 1)
    fixed_s, per_token_s = fit_step_cost(t.step_costs, 2 * num_requests * (1 + max_depth))
    if t.draft_pass_costs:  # a pass feeds about one token per drafting request
        draft_fixed_s, draft_per_token_s = fit_step_cost(t.draft_pass_costs, 2 * num_requests)
    else:
        draft_fixed_s, draft_per_token_s = t.cost_prior[0] * fixed_s, t.cost_prior[1] * per_token_s
    wide_per_token_s = max(fit_step_cost(t.step_costs)[1], per_token_s)
    policy = SpeculationPolicy(cfg.mode, max_depth, t.accept_rates, fixed_s, per_token_s, draft_fixed_s,
                               factor, cfg.max_compute_fraction, False, draft_per_token_s,
                               1 if t.catches_up else None, wide_per_token_s)
    if (cfg.mode != "on" and max_depth > 0
            and t.num_steps_without_drafts >= probe_interval(t.catches_up, t.num_idle_probes)
            and pays_at_full_acceptance(policy, num_requests)):
        policy = replace(policy, probe=True)
    return policy


def pays_at_full_acceptance(policy: SpeculationPolicy, num_requests: int) -> bool:
    """Would drafting pay for a decode batch of this size if every draft were accepted? If not, a probe
    could only find that it does not (a proposer dearer than the target's own steps)."""
    full = replace(policy, accept_rates=(1.0,) * len(policy.accept_rates))
    return max(choose_depths(full, num_requests, [policy.max_depth] * num_requests)) > 0


def max_draft_tokens(num_base_tokens: int, max_compute_fraction: float, token_budget: int | None) -> int:
    """Draft tokens a step may add so that drafts / all tokens <= max_compute_fraction, within the budget."""
    f = max_compute_fraction
    cap = math.inf if f >= 1.0 else math.floor(f * num_base_tokens / (1.0 - f) + 1e-9)
    if token_budget is not None:
        cap = min(cap, token_budget)
    return int(min(cap, 1 << 30))


def choose_depths(policy: SpeculationPolicy, num_base_tokens: int, max_depths: Sequence[int],
                  accept_rates: Sequence[Sequence[float] | None] | None = None,
                  token_budget: int | None = None) -> list[int]:
    """Draft depth per decoding request of a step.

    num_base_tokens: the step's tokens without drafts (decode tokens + prefill chunks); max_depths: per
    decoding request, the most drafts it may take (the engine caps by remaining max_tokens / model length);
    accept_rates: per request its own acceptance EMA, None for the policy's; token_budget: draft tokens
    the step's budget has room for.
    """
    caps = tuple(min(max(int(d), 0), policy.max_depth) for d in max_depths)
    if accept_rates is None:  # a policy holds for several steps and steps repeat: decided once per shape
        return list(_choose_depths_cached(policy, num_base_tokens, caps, token_budget))
    return _choose_depths(policy, num_base_tokens, caps, accept_rates, token_budget)


@functools.lru_cache(maxsize=1024)
def _choose_depths_cached(policy: SpeculationPolicy, num_base_tokens: int, caps: tuple[int, ...],
                          token_budget: int | None) -> tuple[int, ...]:
    return tuple(_choose_depths(policy, num_base_tokens, caps, None, token_budget))


def _choose_depths(policy: SpeculationPolicy, num_base_tokens: int, max_depths: tuple[int, ...],
                   accept_rates: Sequence[Sequence[float] | None] | None,
                   token_budget: int | None) -> list[int]:
    caps = np.asarray(max_depths, np.int64)  # [R], already within 0 .. policy.max_depth
    if policy.probe:
        width = len(caps) if policy.probe_width is None else policy.probe_width
        caps = np.where(np.arange(len(caps)) < width, np.minimum(caps, 1), 0)
    cap_total = max_draft_tokens(num_base_tokens, policy.max_compute_fraction, token_budget)
    depths = np.zeros(len(caps), np.int64)
    if not caps.any() or cap_total <= 0:
        return depths.tolist()
    k = int(caps.max())
    rates = np.empty((len(caps), k))  # [R, k]: each request's acceptance per position
    rates[:] = np.asarray(policy.accept_rates[:k], np.float64)
    if accept_rates is not None:
        for r, own in enumerate(accept_rates):
            if own is not None:
                rates[r] = np.asarray(own[:k], np.float64)
    # marginal expected tokens of each request's j-th draft (a running product, position by position);
    # ranked by gain, ties to shallower drafts, then earlier requests
    r_idx, j_idx = np.nonzero(np.arange(k) < caps[:, None])
    gains = np.cumprod(rates, axis=1)[r_idx, j_idx]
    order = np.lexsort((r_idx, j_idx, -gains))[:cap_total]
    r_idx, j_idx, gains = r_idx[order], j_idx[order], gains[order]
    if policy.mode == "on" or policy.probe:
        num_drafts = len(order)
    else:
        deepest = np.maximum.accumulate(j_idx + 1)
        d = np.arange(1, len(order) + 1)
        goodput = (len(caps) + np.cumsum(gains)) / step_seconds(policy, num_base_tokens, d, deepest)
        best = int(np.argmax(goodput))
        num_drafts = (best + 1 if goodput[best] > len(caps) / step_seconds(policy, num_base_tokens, 0, 0)
                      else 0)
    np.maximum.at(depths, r_idx[:num_drafts], j_idx[:num_drafts] + 1)
    return depths.tolist()


def step_seconds(policy: SpeculationPolicy, num_base_tokens: int, num_drafts, deepest):
    """The policy's expected seconds of a step: its base tokens, num_drafts draft tokens (verified and
    drafted) and the proposer's passes to the deepest draft, charged draft_cost_factor times (scalars or
    arrays)."""
    base_s = max(policy.fixed_s + policy.per_token_s * num_base_tokens, 1e-12)
    draft_s = ((policy.per_token_s + policy.draft_s_per_token) * num_drafts
               + policy.draft_s_per_position * deepest)
    return base_s + policy.draft_cost_factor * draft_s

