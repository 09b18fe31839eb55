"""Speculator: the engine's speculative decoding around one step: depths, drafts, figures.

Before the target forward, `propose` asks the policy for a depth per decoding request (choose_depths:
goodput under the step's token budget, max_compute_fraction and KV pressure), has the proposer draft
for every request with a depth > 0 in one call, and schedules the drafts into the plan where budget and
free blocks allow. After the step, `observe` turns what was verified into a SpecStepStats record that
feeds the controller (acceptance EMA per position, step cost fit) and the counters of `stats()`.
A step where every depth is 0 calls no proposer and verifies nothing: it is a plain decode step.

The policy in force is the controller's, re-decided every POLICY_REFRESH_STEPS steps, until one is
`push`ed (a worker pushes the scheduler actor's, computed from `telemetry()`); a pushed policy stays
until the next push, but its probe, like a local one, lasts POLICY_REFRESH_STEPS steps. Reading `policy`
changes nothing: the policy in force moves on only in `refresh_policy`, which each step's `choose` calls.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.speculation_config import SpeculationConfig
from models.proposers.base import Proposer
from models.proposers.token_tree import TokenTree
from scheduling.batcher import Batcher
from scheduling.model_runner import RunOutput
from scheduling.outputs import SamplerOutput
from scheduling.plan import StepPlan
from scheduling.speculation.controller import SpeculationController
from scheduling.speculation.depth_policy import (
    SpecTelemetry,
    SpeculationPolicy,
    choose_depths,
    speculation_policy,
)
from scheduling.speculation.estimators import SpecStepStats, count_positions
from scheduling.speculation.tree_policy import choose_tree_width
from scheduling.step_stats import StepStats

SPEC_COUNTERS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")
# the controller's policy (a least-squares cost fit, ~0.2 ms) is recomputed this often
POLICY_REFRESH_STEPS = 8


@dataclass(frozen=True)
class DraftChoice:
    """A step's drafting decision: the depth per decoding request, under `policy`."""
    decoding: list[int]  # indices into plan.scheduled
    requests: list  # their Requests
    depths: list[int]
    policy: SpeculationPolicy


class Speculator:
    def __init__(self, config: SpeculationConfig, proposer: Proposer, decisions: DecisionLog | None = None,
                 window: int = 0):
        # window: the model's shortest attention window (0: none); a tree node sees all its ancestors, so a
        # tree is cut short of it
        self.max_tree_depth = window - 1 if window > 0 else config.num_speculative_tokens
        self.config = config
        self.proposer = proposer
        self.controller = SpeculationController(config, proposer.cost_prior, proposer.catches_up)
        self.pushed_policy: SpeculationPolicy | None = None  # a scheduler actor's; None: the controller's
        # the controller's policy, in force when none is pushed; decided (and adopted) at the first refresh
        self._policy = speculation_policy(self.controller.telemetry())
        self._num_steps_since_policy = 0  # since the policy in force was decided or pushed
        self._decide_anew = True  # the controller decides at the next refresh (a probe has drafted its step)
        self.refresh_steps = POLICY_REFRESH_STEPS  # method "auto" refreshes each of its methods' less often
        self.decisions = decisions or DecisionLog()
        self.draft_passes: list[tuple[int, float]] = []  # this step's proposer passes: (tokens, seconds)
        self.draft_seconds = 0.0  # this step's proposer seconds
        self.clock = time.perf_counter  # times the proposer (benchmarks/simulate: modelled time instead)
        self.depth = 0  # the deepest draft of the last step with decoding requests
        self.num_drafts = 0  # verifications: request-steps with at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        k = config.num_speculative_tokens
        self.num_verified_per_position = np.zeros(k, np.int64)
        self.num_accepted_per_position = np.zeros(k, np.int64)

    @property
    def policy(self) -> SpeculationPolicy:
        """The policy in force."""
        return self._policy if self.pushed_policy is None else self.pushed_policy

    def refresh_policy(self) -> None:
        """Move the policy in force on: a pushed probe that has had its steps ends; the controller's own
        policy is decided anew every refresh_steps steps (or after its probe drafted)."""
        if self.pushed_policy is not None:
            if self.pushed_policy.probe and self._num_steps_since_policy >= self.refresh_steps:
                self.pushed_policy = replace(self.pushed_policy, probe=False)  # the probe has had its steps
                self.controller.adopt(self.pushed_policy)
        elif self._decide_anew or self._num_steps_since_policy >= self.refresh_steps:
            self._policy, self._num_steps_since_policy, self._decide_anew = self.controller.policy(), 0, False

    def end_probe(self) -> None:
        """The probe in force has drafted its step (method "auto" probes one step): decide anew next time."""
        if self.pushed_policy is None:
            self._decide_anew = True
        elif self.pushed_policy.probe:
            self.pushed_policy = replace(self.pushed_policy, probe=False)
            self.controller.adopt(self.pushed_policy)

    def push(self, policy: SpeculationPolicy) -> None:
        """Put a policy decided elsewhere in force, until the next push."""
        self.pushed_policy, self._num_steps_since_policy = policy, 0
        self.controller.adopt(policy)

    def telemetry(self) -> SpecTelemetry:
        """What the policy is decided from (speculation_policy), for a scheduler in another process."""
        return self.controller.telemetry()

    @property
    def needs_hidden(self) -> bool:
        return self.proposer.needs_hidden

    def propose(self, plan: StepPlan, batcher: Batcher) -> StepPlan:
        """The plan with drafts for its decoding requests."""
        for req in plan.preempted:
            self.free(req.request_id)
        return self.draft(plan, batcher, self.choose(plan))

    def observe(self, plan: StepPlan, run: RunOutput, out: SamplerOutput, stats: StepStats) -> None:
        if self.proposer.needs_hidden:
            for request_id, first, features in hidden_features(plan, run, out):
                self.proposer.observe_hidden(request_id, first, features)
        # the whole step but the proposer's passes: drafts also cost scheduling and rollback
        self.record(plan, out, stats.seconds.total - self.draft_seconds, self.draft_seconds,
                    stats.num_waiting, stats.kv_usage)

    def choose(self, plan: StepPlan) -> DraftChoice | None:
        """This step's depth per decoding request under the policy in force (None: no decoding request)."""
        self.draft_passes, self.draft_seconds = [], 0.0
        decoding = plan.decoding()
        if not decoding:
            return None
        reqs = [plan.scheduled[i].request for i in decoding]
        # a run may append all its drafts and one more token; drafts past max_tokens would be cut unread
        max_depths = [r.max_num_tokens - r.num_tokens for r in reqs]
        self.refresh_policy()
        policy = self.policy
        depths = choose_depths(policy, plan.num_tokens, max_depths, token_budget=plan.token_budget_left)
        return DraftChoice(decoding, reqs, depths, policy)

    def draft(self, plan: StepPlan, batcher: Batcher, choice: DraftChoice | None) -> StepPlan:
        """The plan with the proposer's drafts of the choice's depths (its seconds: draft_seconds)."""
        if choice is None:
            return plan
        decoding, reqs, depths = choice.decoding, choice.requests, choice.depths
        self._record_depth(max(depths), len(reqs), plan.num_tokens)
        active = [j for j, d in enumerate(depths) if d > 0]
        if not active:
            return plan
        self._choose_width(plan.num_tokens, depths)
        start = self.clock()
        drafts = self.proposer.propose([reqs[j] for j in active], [depths[j] for j in active])
        seconds = self.clock() - start
        # a proposer without passes of its own (a lookup) counts as one pass over the requests it drafted for;
        # its passes are charged all of its time (the Python between them too: on a 1 ms step that decides
        # whether drafting pays), in proportion to their own
        passes = self.proposer.last_passes or [(len(active), seconds)]
        timed = sum(s for _, s in passes)
        self.draft_passes = [(n, s * seconds / timed) for n, s in passes] if 0 < timed < seconds else passes
        self.draft_seconds = seconds
        trees = {}
        for j, draft in zip(active, drafts):
            if isinstance(draft, TokenTree):
                tree = draft.truncated(depths[j] if draft.is_chain else min(depths[j], self.max_tree_depth))
            else:
                tree = TokenTree.chain(draft[:depths[j]])
            if reqs[j].matcher is not None:  # structured outputs: only drafts its grammar admits
                tree = reqs[j].matcher.admitted(tree)
            if tree.tokens:
                trees[decoding[j]] = tree
        return batcher.with_drafts(plan, trees, self.config.method)

    def record(self, plan: StepPlan, out: SamplerOutput, seconds: float, draft_seconds: float,
               num_waiting: int, kv_usage: float, drafted: bool = True) -> SpecStepStats:
        """A step's figures into the controller and the counters. seconds: the step but the proposer's
        passes; drafted: whether this speculator's proposer drafted the step's drafts (False: another
        method's, which this one sees as a step without drafts: its step cost, not its acceptance)."""
        k = self.config.num_speculative_tokens
        runs = [(s.num_draft_tokens, s.num_accepted_tokens) for s in out.sampled
                if s is not None and s.num_draft_tokens > 0] if drafted else []
        verified, accepted = count_positions(runs, k)
        stats = SpecStepStats(plan.num_tokens, seconds, len(plan.scheduled), num_waiting, kv_usage,
                              draft_seconds, max((d for d, _ in runs), default=0), verified, accepted,
                              tuple(self.draft_passes) if drafted else ())
        self.controller.observe(stats)
        self._num_steps_since_policy += 1
        self.num_drafts += len(runs)
        self.num_draft_tokens += sum(d for d, _ in runs)
        self.num_accepted_tokens += sum(a for _, a in runs)
        self.num_verified_per_position += verified
        self.num_accepted_per_position += accepted
        return stats

    def free(self, request_id: str) -> None:
        self.proposer.free(request_id)

    def telemetries(self) -> tuple[SpecTelemetry, ...]:
        """What the scheduler decides this engine's policy from, one record per method (here one)."""
        return (self.telemetry(),)

    def push_policies(self, policies: tuple[SpeculationPolicy, ...]) -> None:
        """The scheduler's answer to telemetries()."""
        [policy] = policies
        self.push(policy)

    def stats(self) -> dict:
        policy = self.policy
        return {"spec_method": self.config.method, "spec_mode": self.config.mode,
                "spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": self.num_accepted_per_position.tolist(),
                "spec_verified_per_position": self.num_verified_per_position.tolist(),
                "spec_depth": self.depth,
                "spec_policy_source": "engine" if self.pushed_policy is None else "scheduler",
                # the goodput inputs: acceptance EMA per position, step cost = fixed + per_token * tokens
                "spec_accept_rate_ema": list(policy.accept_rates), "spec_step_fixed_s": policy.fixed_s,
                "spec_step_per_token_s": policy.per_token_s,
                "spec_draft_s_per_position": policy.draft_s_per_position,
                "spec_draft_s_per_token": policy.draft_s_per_token,
                "spec_draft_cost_factor": policy.draft_cost_factor, "spec_max_depth": policy.max_depth}

    def _choose_width(self, num_base_tokens: int, depths: list[int]) -> None:
        """A proposer that drafts trees (it measures accepted_counts) gets this step's width."""
        proposer = self.proposer
        if proposer.accepted_counts is None:
            return
        width = proposer.fixed_width or choose_tree_width(self.policy, proposer.accepted_counts,
                                                           proposer.tree_sizes, depths, num_base_tokens)
        if width != proposer.width:
            measured = proposer.accepted_counts.sum(axis=1)[0]
            mean = proposer.accepted_counts @ np.arange(proposer.accepted_counts.shape[1]) / max(measured, 1)
            self.decisions.record("speculation", f"tree width {width}",
                                  f"{'fixed' if proposer.fixed_width else 'goodput'}: mean drafts a tree of "
                                  f"width 1, 2, ... would keep {np.round(mean, 2).tolist()} over "
                                  f"{measured} proposals",
                                  subject="tree width")
        proposer.width = width

    def _record_depth(self, depth: int, num_decoding: int, num_tokens: int) -> None:
        """A "speculation" decision per step; the log counts the steps a depth holds (a change is a new
        entry)."""
        p, source = self.policy, "engine" if self.pushed_policy is None else "scheduler"
        self.decisions.record("speculation", f"depth {depth}",
                              lambda: f"mode {self.config.mode}, policy from the {source}: {num_decoding} "
                                      f"decoding of {num_tokens} tokens in the step, acceptance EMA "
                                      f"{np.round(p.accept_rates, 2).tolist()}, step cost "
                                      f"{p.fixed_s * 1e3:.2f} ms + {p.per_token_s * 1e3:.3f} ms/token, "
                                      f"draft cost x{p.draft_cost_factor:.2f}",
                              subject="depth")
        self.depth = depth


def hidden_features(plan: StepPlan, run: RunOutput,
                    out: SamplerOutput) -> Iterator[tuple[str, int, np.ndarray]]:
    """For a proposer that drafts from the target's features: each running request's (id, first position,
    features [n, H]) of the positions this step verified (its prompt or verified rows, then a verification's
    kept path, whose last row produced its last token)."""
    for s, (scheduled, sampled) in enumerate(zip(plan.scheduled, out.sampled)):
        req = scheduled.request
        if req.finished or req.prompt_only:
            continue
        first = run.first_rows[s]
        rows = list(range(first, first + scheduled.num_base_tokens))  # positions first_positions[s] ...
        if sampled is not None:  # the kept path's rows after the root (the request's last base row)
            rows += [rows[-1] + r for r in sampled.rows[1:]]
        yield req.request_id, run.first_positions[s], run.hidden[rows]


def spec_stats_off() -> dict:
    """stats() keys of an engine without speculation."""
    return {"spec_method": "off", **dict.fromkeys(SPEC_COUNTERS, 0), "spec_accepted_per_position": [],
            "spec_depth": 0}
