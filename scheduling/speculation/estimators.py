"""Speculation's estimators: what a step measured (SpecStepStats), the acceptance per draft position
(AcceptanceEMA), and the cost of a step or a proposer pass as a function of its tokens (StepCostModel).
scheduling/speculation/depth_policy.py decides from them; scheduling/speculation/controller.py keeps them per
engine."""

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

PRIOR_ACCEPT = 0.6  # acceptance assumed at a position before any draft there was verified
PRIOR_WEIGHT = 2.0  # the prior counts as this many verified drafts
PRIOR_SLOPE_RATIO = 1 / 16  # per-token / fixed cost of a step until two token counts were measured
ACCEPT_ALPHA = 0.02  # EMA weight of one verified draft, once a position has seen 1 / ACCEPT_ALPHA of them
COST_WINDOW = 256  # recent steps the cost fit uses
MIN_LOCAL_SAMPLES = 8  # steps near the decision's size that make a local cost fit


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


def count_positions(results: Iterable[tuple[int, int]],
                    depth: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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
