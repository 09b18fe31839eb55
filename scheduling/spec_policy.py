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

Who runs what: the engine's SpeculationController measures (acceptance EMAs, step and proposer cost
samples, probe counts) and `telemetry()` hands that state over as a SpecTelemetry record; the pure
`speculation_policy(telemetry)` decides the SpeculationPolicy; `choose_depths` applies it to each step's
actual batch. The in-process LLM runs all three itself. In a deployment a worker sends its SpecTelemetry
inside StepTelemetry, the scheduler actor runs speculation_policy on it (scheduling/policy.py) and pushes
the answer back with the batching policy. Before the first answer a worker runs its own controller;
after it, it keeps the last pushed policy until the next, also while the scheduler is dead or restarting
(the scheduler keeps no speculation state, so a restarted one answers as the old one would have).
"""

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from cluster_configs.speculation_config import SpeculationConfig

PRIOR_ACCEPT = 0.6  # acceptance assumed at a position before any draft there was verified
PRIOR_WEIGHT = 2.0  # the prior counts as this many verified drafts
PRIOR_SLOPE_RATIO = 1 / 16  # per-token / fixed cost of a step until two token counts were measured
ACCEPT_ALPHA = 0.02  # EMA weight of one verified draft, once a position has seen 1 / ACCEPT_ALPHA of them
COST_WINDOW = 256  # recent steps the cost fit uses
MIN_LOCAL_SAMPLES = 8  # steps near the decision's size that make a local cost fit
PROBE_INTERVAL = 64  # steps without a verified draft before a depth-1 probe
MAX_PROBE_BACKOFF = 16  # a catching-up proposer's probes wait at most this times PROBE_INTERVAL
KV_SOFT, KV_HIGH = 0.80, 0.95  # KV usage where draft pressure starts / drafting stops
MODE_BIAS = {"auto": 1.0, "latency_first": 1.0, "throughput_first": 1.25}
QUEUE_WEIGHT = {"auto": 0.5, "latency_first": 0.0, "throughput_first": 1.0}
KV_WEIGHT = 1.0


@dataclass(frozen=True)
class SpecStepStats:
    """One engine step, as speculation saw it."""
    num_tokens: int  # tokens of the target forward, drafts included
    seconds: float  # wall time of the target forward and verification
    num_requests: int  # requests in the step (batch size)
    num_waiting: int  # queue depth after the step was planned
    kv_usage: float  # used / total KV blocks
    draft_seconds: float = 0.0  # the proposer's time
    max_draft_depth: int = 0  # the deepest draft (a draft model runs this many forwards)
    num_drafts_per_position: tuple[int, ...] = ()  # drafts verified at position i (all earlier ones accepted)
    num_accepted_per_position: tuple[int, ...] = ()
    draft_passes: tuple[tuple[int, float], ...] = ()  # the proposer's passes: (tokens, seconds) each


def count_positions(results: Iterable[tuple[int, int]], depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(num drafted, num accepted) per request -> (drafts verified, drafts accepted) per position."""
    verified, accepted = [0] * depth, [0] * depth
    for num_drafted, num_accepted in results:
        for i in range(min(num_drafted, num_accepted + 1)):
            verified[i] += 1
        for i in range(num_accepted):
            accepted[i] += 1
    return tuple(verified), tuple(accepted)


class AcceptanceEMA:
    """Per-position conditional acceptance. Until a position has seen about 1 / ACCEPT_ALPHA verified drafts
    its rate is their mean, the prior counting as PRIOR_WEIGHT drafts (so a proposer that never hits is
    found out in a few drafts, not a few hundred); after that, an EMA weighing each draft ACCEPT_ALPHA.
    A position never verified yet takes the rate of the one before it: a run that always passes at
    position 0 is not assumed to fail at position 1 just because it has not been tried there."""

    def __init__(self, rates: Sequence[float]):
        self.rates = np.array(rates, np.float64)
        self.counts = np.zeros(len(self.rates))  # drafts verified at each position

    @classmethod
    def prior(cls, depth: int) -> "AcceptanceEMA":
        return cls([PRIOR_ACCEPT] * depth)

    def update(self, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        for i, (n, a) in enumerate(zip(num_drafts, num_accepted)):
            if n > 0 and i < len(self.rates):
                self.counts[i] += n
                weight = max(n / (PRIOR_WEIGHT + self.counts[i]), 1.0 - (1.0 - ACCEPT_ALPHA) ** n)
                self.rates[i] += weight * (a / n - self.rates[i])
        for i in range(1, len(self.rates)):
            if self.counts[i] == 0:
                self.rates[i] = self.rates[i - 1]


class StepCostModel:
    """seconds(num_tokens) = fixed_s + per_token_s * num_tokens, least squares over recent steps (of the
    target, or of the proposer's passes)."""

    def __init__(self, window: int = COST_WINDOW):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)

    def add(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self.samples.append((num_tokens, seconds))

    def fit(self, max_tokens: int | None = None) -> tuple[float, float]:
        return fit_step_cost(self.samples, max_tokens)


def fit_step_cost(samples: Sequence[tuple[int, float]], max_tokens: int | None = None) -> tuple[float, float]:
    """(tokens, seconds) samples -> (fixed_s, per_token_s); before data, the prior shape at unit scale.

    A decode step is memory-bound (flat in its token count) until compute catches up, so one line
    through decode steps and long prefill chunks would overstate what a few draft tokens cost. With
    max_tokens, the fit uses the steps up to that size when they span at least two token counts.
    """
    if not samples:
        return 1.0, PRIOR_SLOPE_RATIO
    t, s = np.array(samples, np.float64).T
    if max_tokens is not None:
        near = t <= max_tokens
        if near.sum() >= MIN_LOCAL_SAMPLES and np.ptp(t[near]) >= 1:
            t, s = t[near], s[near]
    if np.ptp(t) < 1:  # one token count: the slope is not identifiable, keep the prior's shape
        fixed = s.mean() / (1.0 + PRIOR_SLOPE_RATIO * t.mean())
        return fixed, PRIOR_SLOPE_RATIO * fixed
    per_token = max(float(np.cov(t, s, bias=True)[0, 1] / t.var()), 0.0)
    fixed = max(float(s.mean() - per_token * t.mean()), 0.0)
    return fixed, per_token


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
        fields = {k: v for k, v in vars(self).items() if k not in ("config", "step_costs", "draft_pass_costs")}
        return {"method": self.config.method, "mode": self.config.mode, **fields,
                "num_step_costs": len(self.step_costs), "num_draft_pass_costs": len(self.draft_pass_costs)}


def probe_interval(catches_up: bool, num_idle_probes: int) -> int:
    """Steps without a verified draft before a probe; a catching-up proposer backs off while probes find no pay."""
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
    policy = SpeculationPolicy(cfg.mode, max_depth, t.accept_rates, fixed_s, per_token_s, draft_fixed_s, factor,
                               cfg.max_compute_fraction, False, draft_per_token_s, 1 if t.catches_up else None)
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


class SpeculationController:
    """Step stats in, telemetry (and, run in-process, the policy) out. Owned by the engine.

    cost_prior: the proposer's pass cost before it was timed, as fractions (of the target step's fixed
    cost, of its per-token cost); catches_up: resuming drafting costs the proposer every token it missed
    (Proposer.cost_prior, Proposer.catches_up)."""

    def __init__(self, config: SpeculationConfig, cost_prior: tuple[float, float] = (0.0, 0.0),
                 catches_up: bool = False):
        self.config = config
        self.cost_prior = cost_prior
        self.catches_up = catches_up
        self.acceptance = AcceptanceEMA.prior(config.num_speculative_tokens)
        self.cost = StepCostModel()
        self.draft_cost = StepCostModel()
        self.last: SpecStepStats | None = None
        self.num_steps_without_drafts = 0
        self.num_idle_probes = 0  # probes since drafting last paid by itself
        self._probing = False  # the policy in force is a probe

    def observe(self, stats: SpecStepStats) -> None:
        self.last = stats
        self.cost.add(stats.num_tokens, stats.seconds)
        for num_tokens, seconds in stats.draft_passes:
            self.draft_cost.add(num_tokens, seconds)
        self.acceptance.update(stats.num_drafts_per_position, stats.num_accepted_per_position)
        drafted = sum(stats.num_drafts_per_position) > 0
        self.num_steps_without_drafts = 0 if drafted else self.num_steps_without_drafts + (stats.num_requests > 0)
        if drafted and not self._probing:
            self.num_idle_probes = 0

    @property
    def probe_interval(self) -> int:
        return probe_interval(self.catches_up, self.num_idle_probes)

    def telemetry(self) -> SpecTelemetry:
        last = self.last
        return SpecTelemetry(self.config, tuple(self.acceptance.rates.tolist()), tuple(self.cost.samples),
                             tuple(self.draft_cost.samples), self.cost_prior, self.catches_up,
                             last.num_requests if last else 0, last.num_waiting if last else 0,
                             last.kv_usage if last else 0.0, self.num_steps_without_drafts, self.num_idle_probes)

    def policy(self) -> SpeculationPolicy:
        """Decide here (the in-process engine, or a worker before the scheduler first answered)."""
        policy = speculation_policy(self.telemetry())
        self.adopt(policy)
        return policy

    def adopt(self, policy: SpeculationPolicy) -> None:
        """A policy came into force, this controller's or one pushed from its telemetry: count its probe."""
        self.num_idle_probes += policy.probe
        self._probing = policy.probe


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
    caps = [max(0, min(policy.max_depth, m)) for m in max_depths]
    if policy.probe:
        width = len(caps) if policy.probe_width is None else policy.probe_width
        caps = [min(c, 1) if r < width else 0 for r, c in enumerate(caps)]
    cap_total = max_draft_tokens(num_base_tokens, policy.max_compute_fraction, token_budget)
    if not any(caps) or cap_total <= 0:
        return [0] * len(caps)
    # marginal expected tokens of each request's j-th draft; ties go to shallower drafts, then earlier requests
    candidates = []
    for r, cap in enumerate(caps):
        rates = policy.accept_rates if accept_rates is None or accept_rates[r] is None else accept_rates[r]
        gain = 1.0
        for j in range(cap):
            gain *= rates[j]
            candidates.append((-gain, j, r))
    candidates.sort()
    candidates = candidates[:cap_total]
    if policy.mode == "on" or policy.probe:
        num_drafts = len(candidates)
    else:
        gains = -np.array([c[0] for c in candidates])
        deepest = np.maximum.accumulate([c[1] + 1 for c in candidates])
        d = np.arange(1, len(candidates) + 1)
        base_s = max(policy.fixed_s + policy.per_token_s * num_base_tokens, 1e-12)
        draft_s = (policy.per_token_s + policy.draft_s_per_token) * d + policy.draft_s_per_position * deepest
        goodput = (len(caps) + np.cumsum(gains)) / (base_s + policy.draft_cost_factor * draft_s)
        best = int(np.argmax(goodput))
        num_drafts = best + 1 if goodput[best] > len(caps) / base_s else 0
    depths = [0] * len(caps)
    for _, j, r in candidates[:num_drafts]:
        depths[r] = max(depths[r], j + 1)
    return depths
