"""SpeculationController: one engine's speculation measurements (step stats in), telemetry and, run
in-process, the policy out (scheduling/speculation/depth_policy.py says who decides where)."""

from cluster_configs.speculation_config import SpeculationConfig
from scheduling.speculation.depth_policy import (
    SpecTelemetry,
    SpeculationPolicy,
    probe_interval,
    speculation_policy,
)
from scheduling.speculation.estimators import AcceptanceEMA, SpecStepStats, StepCostModel


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
        self._timed_step = self._timed_proposer = False  # a first step (or proposer call) was seen

    def observe(self, stats: SpecStepStats) -> None:
        """A first call pays one-off costs (kernels loaded from numba's cache, memory first touched): the
        first step and the proposer's first passes are not samples of their cost. A proposer priced by such
        an outlier could look too dear to ever draft, and so never be timed again."""
        self.last = stats
        if self._timed_step:
            self.cost.add(stats.num_tokens, stats.seconds)
        self._timed_step = True
        if self._timed_proposer:
            for num_tokens, seconds in stats.draft_passes:
                self.draft_cost.add(num_tokens, seconds)
        self._timed_proposer |= bool(stats.draft_passes)
        self.acceptance.update(stats.num_drafts_per_position, stats.num_accepted_per_position)
        drafted = sum(stats.num_drafts_per_position) > 0
        self.num_steps_without_drafts = (0 if drafted
                                         else self.num_steps_without_drafts + (stats.num_requests > 0))
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
                             last.kv_usage if last else 0.0, self.num_steps_without_drafts,
                             self.num_idle_probes)

    def policy(self) -> SpeculationPolicy:
        """Decide here (the in-process engine, or a worker before the scheduler first answered)."""
        policy = speculation_policy(self.telemetry())
        self.adopt(policy)
        return policy

    def adopt(self, policy: SpeculationPolicy) -> None:
        """A policy came into force, this controller's or one pushed from its telemetry: count its probe."""
        self.num_idle_probes += policy.probe
        self._probing = policy.probe
