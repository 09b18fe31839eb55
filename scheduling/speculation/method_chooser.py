"""MethodChooser: speculation method "auto": every draft method the model has, one chosen per step.

It holds one Speculator per candidate method (n-gram lookup always; Medusa or EAGLE when their heads sit
beside the model; a draft model when one is configured), each with its own proposer and controller. Each
step every candidate decides its depths under its own policy (its measured acceptance per position, the
measured step and pass costs: scheduling/speculation/depth_policy.py); the candidates whose policy drafts,
and "none"
(a plain step; not in mode "on"), are the step's options. Which option drafts is decided by what each
option has delivered: per batch size (decoding requests, rounded down to a power of two), an EMA of the
decode tokens per second of the steps it ran. An option not yet measured at a batch size, or not for
REMEASURE_STEPS of its decode steps, is run for MEASURE_STEPS steps (the first not counted: a head
catching up on the positions another option verified); otherwise the best measured option runs. The
cost models decide depths; what they leave out (Python between a head's passes, a proposer that makes
no drafts, a catch-up) cannot mislead the choice, which follows the batch size by construction.
A candidate whose policy probes (no draft of its own verified for a while) drafts one step, so that a
method its policy priced out is re-measured too. Every candidate observes every step: the step's cost as
it is, its drafts and acceptance only when they were its own. A change of option is a recorded decision.
"""

from dataclasses import dataclass

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.speculation_config import SpeculationConfig
from scheduling.batcher import Batcher
from scheduling.model_runner import RunOutput
from scheduling.outputs import SamplerOutput
from scheduling.plan import StepPlan
from scheduling.speculation.depth_policy import SpecTelemetry, SpeculationPolicy
from scheduling.speculation.speculator import POLICY_REFRESH_STEPS, SPEC_COUNTERS, Speculator, hidden_features
from scheduling.step_stats import StepStats

MEASURE_STEPS = 6  # decode steps an option runs when it is measured (the first not counted)
REMEASURE_STEPS = 256  # decode steps at a batch size after which an option is measured again
MEASURE_ALPHA = 0.2  # EMA weight of one decode step in an option's delivered tokens/s
NONE = "none"  # the option of a plain step


@dataclass
class Delivered:
    """What one option delivered at one batch size."""
    tokens_per_s: float
    measured_at: int  # the decode step (of that batch size) it was last measured at


class MethodChooser:
    def __init__(self, config: SpeculationConfig, candidates: dict[str, Speculator],
                 decisions: DecisionLog | None = None):
        self.config = config
        self.candidates = candidates
        # one refresh per POLICY_REFRESH_STEPS steps among them all (~0.1 ms each)
        for s in candidates.values():
            s.refresh_steps = POLICY_REFRESH_STEPS * len(candidates)
        self.decisions = decisions or DecisionLog()
        self.chosen: str | None = None  # the method that drafted the last step with drafts
        self.depth = 0  # the deepest draft of the last step with decoding requests
        self.num_drafts_by_method = dict.fromkeys(candidates, 0)
        self.delivered: dict[tuple[int, str], Delivered] = {}  # (batch size bucket, option) -> its measure
        self.num_decode_steps: dict[int, int] = {}  # per batch size bucket
        self._option: str | None = None  # this step's option (None: no decoding request)
        self._bucket = 0
        self._last_option: str | None = None  # the previous decode step's
        self._trial: tuple[str, int] | None = None  # an option being measured: (option, steps left)
        self._decode_step = False  # this step measures its option (see propose)
        self._probed: set[str] = set()  # methods whose probe in force has drafted its step
        self._draft_seconds = 0.0  # this step's proposer seconds

    @property
    def needs_hidden(self) -> bool:
        return any(s.needs_hidden for s in self.candidates.values())

    def propose(self, plan: StepPlan, batcher: Batcher) -> StepPlan:
        """Choose this step's option; -> the plan with its method's drafts."""
        for req in plan.preempted:
            self.free(req.request_id)
        choices = {name: s.choose(plan) for name, s in self.candidates.items()}
        self._option, self._draft_seconds = None, 0.0
        if all(c is None for c in choices.values()):
            return plan
        self.depth = 0
        drafting = [name for name, c in choices.items() if any(c.depths)]
        # a probe policy stays in force for a few steps; here each probe drafts once (with every method
        # probing in turn, a few steps each would add up to a third of all steps)
        self._probed &= {name for name, c in choices.items() if c.policy.probe}
        probing = [name for name in drafting if choices[name].policy.probe and name not in self._probed]
        num_decoding = len(next(c for c in choices.values() if c is not None).depths)
        self._bucket = 1 << (num_decoding.bit_length() - 1)  # batch sizes 1, 2-3, 4-7, ...
        # a step of decoding requests only (drafts, once added, make rows of more tokens), not a probe: what
        # it delivers is its option's
        self._decode_step = num_decoding == len(plan.scheduled) and not probing
        if probing:
            option, why = probing[0], "probe: its policy re-measures its acceptance"
            self._probed.add(option)
        else:
            option, why = self._choose(drafting if self.config.mode == "on" else [NONE, *drafting])
        self._option = option
        if option != self._last_option and why:
            self.decisions.record("speculation", f"method {option}", why, subject="method")
        if option == NONE or option is None:
            return plan
        self.chosen, self.depth = option, max(choices[option].depths)
        plan = self.candidates[option].draft(plan, batcher, choices[option])
        self._draft_seconds = self.candidates[option].draft_seconds
        if option in self._probed:
            self.candidates[option].end_probe()
        return plan

    def _choose(self, options: list[str]) -> tuple[str | None, str]:
        """The option to run at this step's batch size, and why (words for the decision log)."""
        if not options:
            return None, ""
        if self._trial is not None and self._trial[0] in options and self._trial[1] > 0:
            return self._trial[0], ""
        now = self.num_decode_steps.get(self._bucket, 0)
        known = {o: self.delivered.get((self._bucket, o)) for o in options}
        stale = [o for o, d in known.items() if d is None or now - d.measured_at >= REMEASURE_STEPS]
        if stale:
            self._trial = (stale[0], MEASURE_STEPS)
            return stale[0], f"measuring what it delivers at batch size {self._bucket}"
        self._trial = None
        best = max(options, key=lambda o: known[o].tokens_per_s)
        rates = {o: round(d.tokens_per_s, 1) for o, d in known.items()}
        return best, f"delivered the most decode tokens/s at batch size {self._bucket}: {rates}"

    def observe(self, plan: StepPlan, run: RunOutput, out: SamplerOutput, stats: StepStats) -> None:
        if self.needs_hidden:
            for request_id, first, features in hidden_features(plan, run, out):
                for s in self.candidates.values():
                    if s.needs_hidden:
                        s.proposer.observe_hidden(request_id, first, features)
        self.record(plan, out, stats.seconds.total - self._draft_seconds, self._draft_seconds,
                    stats.num_waiting, stats.kv_usage)

    def record(self, plan: StepPlan, out: SamplerOutput, seconds: float, draft_seconds: float,
               num_waiting: int, kv_usage: float) -> None:
        """A step's figures into every candidate (its own drafts only into the option's) and the option's
        measure. seconds: the step but the proposer's passes."""
        for name, s in self.candidates.items():
            own = name == self._option
            stats = s.record(plan, out, seconds, draft_seconds if own else 0.0, num_waiting, kv_usage,
                             drafted=own)
            if own and sum(stats.num_drafts_per_position):
                self.num_drafts_by_method[name] += 1
        if self._option is None or not self._decode_step:
            return  # only a decode step's tokens are the option's
        now = self.num_decode_steps[self._bucket] = self.num_decode_steps.get(self._bucket, 0) + 1
        if self._trial is not None and self._trial[0] == self._option:
            self._trial = (self._option, self._trial[1] - 1)
        if self._option == self._last_option:  # the first step after a switch pays the switch
            rate = (sum(len(s.token_ids) for s in out.sampled if s is not None)
                    / max(seconds + draft_seconds, 1e-9))
            d = self.delivered.setdefault((self._bucket, self._option), Delivered(rate, now))
            d.tokens_per_s += MEASURE_ALPHA * (rate - d.tokens_per_s)
            d.measured_at = now
        self._last_option = self._option

    def free(self, request_id: str) -> None:
        for s in self.candidates.values():
            s.free(request_id)

    def telemetries(self) -> tuple[SpecTelemetry, ...]:
        """One record per candidate, in order: the scheduler answers with a policy for each."""
        return tuple(s.telemetry() for s in self.candidates.values())

    def push_policies(self, policies: tuple[SpeculationPolicy, ...]) -> None:
        if len(policies) != len(self.candidates):
            raise ValueError(f"{len(policies)} speculation policies for {len(self.candidates)} methods")
        for s, policy in zip(self.candidates.values(), policies):
            s.push(policy)

    def stats(self) -> dict:
        """The counters summed over the methods, the last chosen method's policy figures, and per method its
        own stats."""
        per_method = {name: s.stats() for name, s in self.candidates.items()}
        shown = per_method[self.chosen or next(iter(per_method))]
        summed = {key: sum(m[key] for m in per_method.values()) for key in SPEC_COUNTERS}
        for key in ("spec_accepted_per_position", "spec_verified_per_position"):
            summed[key] = np.sum([m[key] for m in per_method.values()], axis=0).tolist()
        delivered = {f"{o} at {b}": round(d.tokens_per_s, 2) for (b, o), d in sorted(self.delivered.items())}
        return shown | summed | {"spec_method": "auto", "spec_mode": self.config.mode,
                                 "spec_depth": self.depth,
                                 "spec_method_chosen": self.chosen, "spec_delivered_tokens_per_s": delivered,
                                 "spec_num_drafts_by_method": dict(self.num_drafts_by_method),
                                 "spec_methods": per_method}
