"""MethodChooser: speculation method "auto": every draft method the model has, one chosen per step.

It holds one Speculator per candidate method (n-gram lookup always; Medusa or EAGLE when their heads sit
beside the model; a draft model when one is configured), each with its own proposer and controller. Each
step every candidate decides its depths under its own policy (its measured acceptance per position, the
step's measured cost, its own passes' cost: scheduling/spec_policy.py) and the expected goodput of that
decision, its drafts discounted by the share of asked-for drafts its proposer has been making (n-gram
lookup on text without repeats makes none, and its untested acceptance prior must not keep it chosen)
and its estimate scaled by how much of what it promised its decode steps delivered (the calibration);
the method with the highest goodput drafts (the last one stays unless another expects SWITCH_MARGIN
more), or none when no draft beats a plain step (calibrated the same way). A candidate
whose policy probes (no draft of its own verified for a while, scheduling/spec_policy.py) drafts one
step instead, so that every method's acceptance stays measured while another one is chosen. Every candidate observes every step: the step's cost as it is, its drafts
and acceptance only when they were its own. A change of method is a recorded decision.

Because each decision weighs the step as it is (batch size, tokens, budget), the choice follows the
batch size: a cheap proposer (n-gram) or none where verification competes with other requests' tokens, a
trained head where a step is memory-bound and its guesses are kept.
"""

from pathlib import Path

import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.speculation_config import SpeculationConfig
from models.llama import LlamaModel
from models.proposers import auto_candidates, make_proposer
from models.spec import ModelSpec
from scheduling.batcher import Batcher, StepPlan
from scheduling.outputs import StepResult
from scheduling.sampler import sample_batch
from scheduling.spec_policy import SpecTelemetry, SpeculationPolicy, expected_goodput
from scheduling.speculator import POLICY_REFRESH_STEPS, SPEC_COUNTERS, Speculator

SWITCH_MARGIN = 0.05  # another method drafts instead of the last one only when it expects this much more
CALIBRATION_ALPHA = 0.05  # EMA weight of one decode step in a method's delivered / expected ratio


class MethodChooser:
    def __init__(self, config: SpeculationConfig, candidates: dict[str, Speculator],
                 decisions: DecisionLog | None = None):
        self.config = config
        self.candidates = candidates
        for s in candidates.values():  # one refresh per POLICY_REFRESH_STEPS steps among them all (~0.1 ms each)
            s.refresh_steps = POLICY_REFRESH_STEPS * len(candidates)
        self.decisions = decisions or DecisionLog()
        self.chosen: str | None = None  # the method that drafted the last step with drafts
        self._drafting: str | None = None  # the method drafting this step (None: no drafts)
        self.depth = 0  # the deepest draft of the last step with decoding requests
        self.num_drafts_by_method = dict.fromkeys(candidates, 0)
        # per method (None: no drafts), an EMA of delivered / expected tokens per second over the decode steps
        # it decided: each estimate is scaled by it, so a method whose model promises more than it delivers
        # (time its passes do not see, a KV catch-up) is judged by what it delivers
        self.calibration: dict[str | None, float] = dict.fromkeys([None, *candidates], 1.0)
        self._predicted: float | None = None  # this step's decision's expected tokens/s, before calibration
        self._probed: set[str] = set()  # methods whose probe in force has drafted its step

    @property
    def needs_hidden(self) -> bool:
        return any(s.needs_hidden for s in self.candidates.values())

    def propose(self, plan: StepPlan, batcher: Batcher) -> float:
        """Choose this step's method and have it draft; -> its proposer's seconds."""
        choices = {name: s.choose(plan) for name, s in self.candidates.items()}
        self._drafting = self._predicted = None
        if all(c is None for c in choices.values()):
            return 0.0
        self.depth = 0
        first = next(iter(choices.values()))
        plain = self.calibration[None] * expected_goodput(first.policy, plan.num_tokens, [0] * len(first.depths))
        goodput = {name: self.calibration[name] * expected_goodput(c.policy, plan.num_tokens, c.depths,
                                                                   self.candidates[name].proposal_rate)
                   for name, c in choices.items() if any(c.depths)}
        # a probe policy stays in force for a few steps; here each probe drafts once (with every method
        # probing in turn, a few steps each would add up to a third of all steps)
        self._probed &= {name for name, c in choices.items() if c.policy.probe}
        probing = [name for name in goodput if choices[name].policy.probe and name not in self._probed]
        # a method drafts if it expects more than a plain step (mode "on": always)
        drafting = [name for name, g in goodput.items() if self.config.mode == "on" or g > plain]
        if probing:
            name, why = probing[0], "probe: its acceptance is re-measured"
            self._probed.add(name)
        elif drafting:
            name, why = max(drafting, key=goodput.__getitem__), "the highest expected goodput"
            if self.chosen in drafting and goodput[name] < (1 + SWITCH_MARGIN) * goodput[self.chosen]:
                name = self.chosen  # switching costs what the estimates leave out (a head's catch-up pass)
        else:
            self._predicted = plain / self.calibration[None]
            return 0.0
        self._drafting, self._predicted = name, goodput[name] / self.calibration[name]
        if name != self.chosen:
            estimates = {"none": round(plain, 1)} | {n: round(g, 1) for n, g in goodput.items()}
            self.decisions.record("speculation", f"method {name}",
                                  f"{why}; expected tokens/s {estimates} at {len(choices[name].depths)} decoding of "
                                  f"{plan.num_tokens} tokens in the step (estimates scaled by what each delivered)",
                                  subject="method")
            self.chosen = name
        self.depth = max(choices[name].depths)
        seconds = self.candidates[name].draft(plan, batcher, choices[name])
        if name in self._probed:
            self.candidates[name].end_probe()
        return seconds

    def observe(self, plan: StepPlan, result: StepResult, seconds: float, draft_seconds: float,
                num_waiting: int, kv_usage: float) -> None:
        for name, s in self.candidates.items():
            own = name == self._drafting
            stats = s.observe(plan, result, seconds, draft_seconds if own else 0.0, num_waiting, kv_usage, drafted=own)
            if own and sum(stats.num_drafts_per_position):
                self.num_drafts_by_method[name] += 1
        decoding = plan.decoding()
        if self._predicted and len(decoding) == len(plan.scheduled):  # a decode step: its tokens are the decision's
            delivered = sum(len(ids) for ids in result.sampled_token_ids) / max(seconds + draft_seconds, 1e-9)
            ratio = self.calibration[self._drafting]
            self.calibration[self._drafting] = ratio + CALIBRATION_ALPHA * (delivered / self._predicted - ratio)

    def free(self, request_id: str) -> None:
        for s in self.candidates.values():
            s.free(request_id)

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        for s in self.candidates.values():
            s.observe_hidden(request_id, first, features)

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
        return shown | summed | {"spec_method": "auto", "spec_mode": self.config.mode, "spec_depth": self.depth,
                                 "spec_method_chosen": self.chosen,
                                 "spec_calibration": {str(k): v for k, v in self.calibration.items()},
                                 "spec_num_drafts_by_method": dict(self.num_drafts_by_method),
                                 "spec_methods": per_method}


def make_speculator(config: EngineConfig, spec: ModelSpec, tokenizer, model_dir: Path, model: LlamaModel, *,
                    kv_cache_tokens: int, decisions: DecisionLog) -> "Speculator | MethodChooser | None":
    """An engine's speculation: a Speculator for one method, a MethodChooser over every candidate for method
    "auto", None when off. Proposers get the engine's dtypes and KV geometry and the target's weights."""
    spec_config = config.speculation
    if not spec_config.enabled:
        return None
    window = min((w for w in spec.layer_windows if w > 0), default=0)

    def speculator(method_config: SpeculationConfig) -> Speculator:
        proposer = make_proposer(method_config, spec, tokenizer, kv_cache_tokens=kv_cache_tokens,
                                 block_size=config.block_size, weight_dtype=config.weight_dtype,
                                 kv_dtype=config.resolved_kv_dtype, activation_dtype=config.activation_dtype,
                                 decisions=decisions, sampler=sample_batch, model_dir=model_dir,
                                 target_weights=model.weights, target_weight_dtype=model.weight_dtype)
        return Speculator(method_config, proposer, decisions, window)

    if spec_config.method != "auto":
        return speculator(spec_config)
    return MethodChooser(spec_config, {m: speculator(spec_config.for_method(m))
                                       for m in auto_candidates(spec_config, model_dir)}, decisions)
