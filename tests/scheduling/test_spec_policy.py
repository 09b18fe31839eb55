"""Speculation policy with fixed inputs: depth follows acceptance and load; forced modes and caps hold; the
policy computed from a worker's telemetry (as the scheduler actor does) is the engine's own decision."""

import itertools
import pickle
from dataclasses import asdict, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numaserve as ns
from actors.scheduler import Scheduler
from cluster_configs.diagnostics import DecisionLog
from models.proposers.base import Proposer
from scheduling.outputs import SampledTokens, SamplerOutput
from scheduling.plan import ScheduledRequest, StepPlan
from scheduling.policy import BatchingPolicy, PolicyLimits, StepTelemetry
from scheduling.request import Request
from scheduling.speculation.controller import SpeculationController
from scheduling.speculation.depth_policy import (
    PROBE_INTERVAL,
    SpecTelemetry,
    SpeculationPolicy,
    choose_depths,
    speculation_policy,
)
from scheduling.speculation.estimators import (
    ACCEPT_ALPHA,
    PRIOR_ACCEPT,
    PRIOR_WEIGHT,
    AcceptanceEMA,
    SpecStepStats,
    count_positions,
)
from scheduling.speculation.method_chooser import MEASURE_STEPS, REMEASURE_STEPS, MethodChooser
from scheduling.speculation.speculator import POLICY_REFRESH_STEPS, DraftChoice, Speculator

K = 4
FIXED_S, PER_TOKEN_S = 0.010, 0.0005  # the simulated machine: a step costs 10 ms + 0.5 ms per token


def controller(**fields) -> SpeculationController:
    return SpeculationController(ns.SpeculationConfig(method="ngram", num_speculative_tokens=K, **fields))


def run_step(ctrl: SpeculationController, batch: int, accept: float, *, waiting: int = 0,
             kv_usage: float = 0.3, rng=None) -> tuple[list[int], SpeculationPolicy]:
    """Choose depths for a decode batch, verify drafts that each pass with probability `accept` (exactly
    round(accept * n) of the n verified at a position when rng is None), report the step."""
    policy = ctrl.policy()
    depths = choose_depths(policy, batch, [K] * batch)
    if rng is None:
        reached = [sum(d > 0 for d in depths)]
        verified, accepted = [], []
        for i in range(K):
            n = min(reached[-1], sum(d > i for d in depths))
            a = round(accept * n)
            verified.append(n)
            accepted.append(a)
            reached.append(a)
    else:
        results = []
        for d in depths:
            passed = rng.random(d) < accept
            results.append((d, int(np.argmin(passed)) if not passed.all() else d))
        verified, accepted = count_positions(results, K)
    num_tokens = batch + sum(depths)
    ctrl.observe(SpecStepStats(num_tokens, FIXED_S + PER_TOKEN_S * num_tokens, batch, waiting, kv_usage,
                               num_drafts_per_position=tuple(verified),
                               num_accepted_per_position=tuple(accepted)))
    return depths, policy


def trained(accept: float, steps: int = 300, batch: int | None = None) -> SpeculationController:
    """A controller after `steps` steps at this acceptance, at batch sizes 1..8 unless one is given."""
    ctrl = controller()
    rng = np.random.default_rng(0)
    for step in range(steps):
        run_step(ctrl, batch or 1 + step % 8, accept, rng=rng)
    return ctrl


def test_depth_falls_monotonically_under_sustained_low_acceptance():
    ctrl = trained(0.9)
    history = [max(run_step(ctrl, 2, 0.1)[0]) for _ in range(PROBE_INTERVAL)]
    assert history[0] == K and history[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(history)), history


def test_a_probe_remeasures_acceptance_after_drafting_stopped():
    ctrl = controller()
    for _ in range(100):
        run_step(ctrl, 8, 0.0)
    probes = []
    for _ in range(3 * PROBE_INTERVAL):
        depths, policy = run_step(ctrl, 8, 0.0)
        probes.append(policy.probe)
        assert max(depths) == (1 if policy.probe else 0)
    assert 1 <= sum(probes) <= 4  # a probe that finds acceptance still low is not repeated at once


def test_depth_falls_as_the_batch_grows():
    policy = trained(0.7).policy()
    batches = [1, 2, 4, 8, 16, 32, 64]
    depths = [np.mean(choose_depths(policy, b, [K] * b)) for b in batches]
    assert depths[0] == K and depths[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(depths)), depths


def test_depth_recovers_when_acceptance_returns_and_load_falls():
    ctrl = controller()
    for _ in range(200):
        run_step(ctrl, 32, 0.1)
    assert max(run_step(ctrl, 32, 0.1)[0]) == 0
    rng = np.random.default_rng(1)
    history = [max(run_step(ctrl, 2, 0.9, rng=rng)[0]) for _ in range(3 * PROBE_INTERVAL)]
    assert history[-1] == K


def test_same_acceptance_pays_at_batch_1_and_not_at_batch_32():
    policy = trained(0.5).policy()
    assert max(choose_depths(policy, 1, [K])) >= 2
    assert max(choose_depths(policy, 32, [K] * 32)) == 0


def test_requests_with_higher_acceptance_draft_deeper():
    policy = trained(0.5).policy()
    own = [[0.95] * K, [0.2] * K, None]
    depths = choose_depths(policy, 8, [K] * 3, accept_rates=own)
    assert depths[0] > depths[2] > depths[1]


def test_on_mode_keeps_the_configured_depth_whatever_acceptance_and_load():
    ctrl = controller(mode="on")
    for _ in range(100):
        depths, _ = run_step(ctrl, 32, 0.0, waiting=50, kv_usage=0.99)
    assert depths == [K] * 32
    assert choose_depths(ctrl.policy(), 3, [K, 2, 0]) == [K, 2, 0]  # per-request caps still apply


def test_method_off_never_drafts():
    ctrl = SpeculationController(ns.SpeculationConfig())
    assert ctrl.policy().max_depth == 0
    assert choose_depths(ctrl.policy(), 1, [4]) == [0]


@pytest.mark.parametrize("mode", ["on", "auto", "latency_first", "throughput_first"])
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.75])
def test_max_compute_fraction_caps_the_draft_share_of_every_step(mode, fraction):
    ctrl = controller(mode=mode, max_compute_fraction=fraction)
    rng = np.random.default_rng(2)
    for batch in (1, 2, 3, 8):
        for _ in range(20):
            depths, _ = run_step(ctrl, batch, 1.0, rng=rng)
            assert sum(depths) <= fraction * (batch + sum(depths)) + 1e-9


def test_token_budget_caps_drafts():
    policy = controller(mode="on").policy()
    assert sum(choose_depths(policy, 4, [K] * 4, token_budget=6)) == 6


def test_waiting_requests_weigh_by_mode():
    depth = {}
    for mode in ("latency_first", "auto", "throughput_first"):
        ctrl = controller(mode=mode)
        rng = np.random.default_rng(3)
        for _ in range(300):
            run_step(ctrl, 8, 0.7, waiting=8, rng=rng)
        depth[mode] = sum(choose_depths(ctrl.policy(), 8, [K] * 8))
    assert depth["latency_first"] > depth["auto"] > depth["throughput_first"], depth


def test_a_nearly_full_kv_pool_stops_drafting_except_when_forced():
    for mode, expected in (("auto", 0), ("latency_first", 0), ("on", K)):
        ctrl = controller(mode=mode)
        run_step(ctrl, 1, 1.0, kv_usage=0.97)
        assert max(choose_depths(ctrl.policy(), 1, [K])) == expected


def test_cost_fit_recovers_the_measured_step_cost():
    ctrl = trained(0.7, steps=100)
    fixed, per_token = ctrl.cost.fit()
    assert fixed == pytest.approx(FIXED_S) and per_token == pytest.approx(PER_TOKEN_S)


def test_position_counts_follow_each_requests_accepted_run():
    # drafted 3 accepted 1: positions 0, 1 verified; drafted 2 accepted 2: both; drafted 0: none
    assert count_positions([(3, 1), (2, 2), (0, 0)], 4) == ((2, 2, 0, 0), (2, 1, 0, 0))
    ema = AcceptanceEMA.prior(3)
    ema.update((100, 0, 0), (100, 0, 0))
    assert ema.rates[0] > 0.98 and ema.rates[1] == ema.rates[2] == ema.rates[0]  # untried: as the one before
    ema.update((50, 50, 0), (0, 50, 0))
    assert ema.rates[0] < 0.5 and ema.rates[1] > 0.98 and ema.rates[2] == ema.rates[1]


def test_acceptance_is_learnt_in_a_few_drafts_then_smoothed():
    ema = AcceptanceEMA.prior(1)
    for _ in range(8):  # a proposer that never hits: its mean with the prior's two drafts
        ema.update((1,), (0,))
    assert ema.rates[0] == pytest.approx(PRIOR_ACCEPT * PRIOR_WEIGHT / (PRIOR_WEIGHT + 8))
    for _ in range(1000):
        ema.update((1,), (1,))
    rate = ema.rates[0]
    ema.update((1,), (0,))  # long after: one draft moves it by the EMA weight
    assert ema.rates[0] == pytest.approx(rate * (1 - ACCEPT_ALPHA))


def test_speculation_config_nests_in_engine_config_and_names_bad_fields():
    config = ns.EngineConfig(speculation={"method": "ngram", "num_speculative_tokens": 6,
                                          "mode": "latency_first"})
    assert config.speculation == ns.SpeculationConfig(method="ngram", num_speculative_tokens=6,
                                                      mode="latency_first")
    assert ns.EngineConfig().speculation.method == "off"
    bad = [({"num_speculative_tokens": 17}, "num_speculative_tokens"), ({"mode": "fast"}, "mode"),
           ({"max_compute_fraction": 0.0}, "max_compute_fraction"), ({"depth": 3}, "depth"),
           ({"prompt_lookup_min": 5}, "prompt_lookup_min"), ({"method": "draft"}, "draft_model"),
           ({"method": "ngram", "draft_model": "x"}, "draft_model")]
    for fields, name in bad:
        with pytest.raises(ValueError, match=name):
            ns.EngineConfig(speculation=fields)


def test_cost_fit_is_local_to_decode_sized_steps():
    # memory-bound until 8 tokens, then 2 ms per token: prefill chunks of 256 must not make drafts look costly
    def seconds(num_tokens: int) -> float:
        return 0.020 + 0.002 * max(0, num_tokens - 8)

    ctrl = controller()
    for step in range(100):
        num_tokens = 256 if step % 10 == 0 else 1 + step % 5
        ctrl.observe(SpecStepStats(num_tokens, seconds(num_tokens), 1, 0, 0.3))
    fixed, per_token = ctrl.cost.fit(max_tokens=10)
    assert fixed == pytest.approx(0.020) and per_token == pytest.approx(0.0)
    assert ctrl.cost.fit()[1] > 0.001  # one line through every step would charge 1.7 ms per draft token
    assert ctrl.policy().per_token_s == pytest.approx(0.0)


@settings(max_examples=200, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1.0), min_size=K, max_size=K),
       max_depths=st.lists(st.integers(0, 8), max_size=12),
       extra_tokens=st.integers(0, 64), per_token=st.floats(0.0, 0.01), fraction=st.floats(0.05, 1.0),
       mode=st.sampled_from(["on", "auto", "latency_first", "throughput_first"]),
       budget=st.none() | st.integers(0, 20))
def test_depths_respect_every_cap_and_never_lower_expected_goodput(rates, max_depths, extra_tokens, per_token,
                                                                    fraction, mode, budget):
    policy = SpeculationPolicy(mode, K, tuple(rates), 0.01, per_token, 0.0, 1.0, fraction)
    base = len(max_depths) + extra_tokens
    depths = choose_depths(policy, base, max_depths, token_budget=budget)
    assert all(0 <= d <= min(K, m) for d, m in zip(depths, max_depths))
    assert sum(depths) <= fraction * (base + sum(depths)) + 1e-9
    assert budget is None or sum(depths) <= budget
    if mode != "on" and max_depths:
        expected = sum(1 + sum(np.prod(rates[:i + 1]) for i in range(d)) for d in depths)
        cost = 0.01 + per_token * (base + sum(depths))
        assert expected / cost >= len(max_depths) / (0.01 + per_token * base) - 1e-9


def test_a_catching_up_proposer_probes_one_request_and_backs_off_while_drafting_does_not_pay():
    ctrl = SpeculationController(ns.SpeculationConfig(method="ngram", num_speculative_tokens=K),
                                 catches_up=True)
    for _ in range(100):
        run_step(ctrl, 8, 0.0)
    probe_steps = []
    for step in range(8 * PROBE_INTERVAL):
        depths, policy = run_step(ctrl, 8, 0.0)
        if policy.probe:
            assert depths == [1] + [0] * 7  # one request catches up, not the batch
            probe_steps.append(step)
    gaps = np.diff(probe_steps)
    assert len(probe_steps) >= 2 and all(b >= 2 * a - 1 for a, b in itertools.pairwise(gaps)), probe_steps
    rng = np.random.default_rng(4)
    for _ in range(16 * PROBE_INTERVAL):  # acceptance returns: a probe finds it and drafting resumes
        depths, policy = run_step(ctrl, 2, 0.95, rng=rng)
        if max(depths) > 1:
            break
    assert max(depths) > 1 and ctrl.num_idle_probes == 0  # deeper than a probe: drafting paid by itself


def test_a_first_step_and_a_proposers_first_passes_are_not_cost_samples():
    ctrl = controller()
    ctrl.observe(SpecStepStats(16, 5.0, 16, 0, 0.3, draft_passes=((16, 3.0),)))  # first calls: kernels loaded
    assert not ctrl.cost.samples and not ctrl.draft_cost.samples
    ctrl.observe(SpecStepStats(16, 0.02, 16, 0, 0.3))
    ctrl.observe(SpecStepStats(20, 0.03, 16, 0, 0.3, draft_passes=((16, 0.001), (8, 0.0008))))
    assert list(ctrl.cost.samples) == [(16, 0.02), (20, 0.03)]
    assert list(ctrl.draft_cost.samples) == [(16, 0.001), (8, 0.0008)]


def test_an_untimed_proposer_is_priced_by_its_prior_then_by_its_measured_passes():
    config = ns.SpeculationConfig(method="ngram", num_speculative_tokens=K)
    free, costly = SpeculationController(config), SpeculationController(config, cost_prior=(1.0, 1.0))
    for ctrl in (free, costly):
        for step in range(20):
            ctrl.observe(SpecStepStats(16 + step % 3, FIXED_S + PER_TOKEN_S * (16 + step % 3), 16, 0, 0.3))
    for ctrl in (free, costly):
        ctrl.acceptance.rates[:] = 0.6
    assert max(choose_depths(free.policy(), 16, [K] * 16)) > 0
    # a pass as dear as a target step: drafting 16 requests cannot pay at 60% acceptance
    assert costly.policy().draft_s_per_position == pytest.approx(FIXED_S)
    assert max(choose_depths(costly.policy(), 16, [K] * 16)) == 0
    for step in range(20):  # measured: passes are nearly free
        n = 1 + step % 4
        costly.observe(SpecStepStats(16, FIXED_S + PER_TOKEN_S * 16, 16, 0, 0.3,
                                     draft_passes=((n, 1e-5 + 1e-6 * n),)))
    policy = costly.policy()
    assert (policy.draft_s_per_position == pytest.approx(1e-5)
            and policy.draft_s_per_token == pytest.approx(1e-6))


# ---- the policy from telemetry: what the scheduler actor runs for a worker ---------------------------

LINE = tuple((n, FIXED_S + PER_TOKEN_S * n) for n in (4, 8, 12, 16) * 4)  # steps on the simulated machine


def spec_telemetry(**fields) -> SpecTelemetry:
    base = {"config": ns.SpeculationConfig(method="ngram", num_speculative_tokens=K),
            "accept_rates": (0.9, 0.8, 0.7, 0.6), "step_costs": LINE, "num_requests": 4}
    return SpecTelemetry(**(base | fields))


def exact(policy: SpeculationPolicy) -> SpeculationPolicy:
    """The policy with its fitted costs rounded off the least-squares noise, for exact comparison."""
    return replace(policy, **{f: round(getattr(policy, f), 12) for f in
                              ("fixed_s", "per_token_s", "draft_s_per_position", "draft_s_per_token",
                               "draft_cost_factor", "wide_per_token_s")})


def test_policy_from_fixed_telemetry():
    # 2 waiting for 4 running (auto: queue weight 0.5), KV half way from soft to high (x1.5); untimed proposer
    t = spec_telemetry(num_waiting=2, kv_usage=0.875, cost_prior=(0.5, 0.25))
    assert exact(speculation_policy(t)) == SpeculationPolicy(
        "auto", K, (0.9, 0.8, 0.7, 0.6), FIXED_S, PER_TOKEN_S, 0.5 * FIXED_S, 1.875, 1.0, False,
        0.25 * PER_TOKEN_S, None, PER_TOKEN_S)
    passes = tuple((n, 0.002 + 0.0001 * n) for n in (1, 2, 3, 4) * 3)  # timed passes replace the prior
    p = exact(speculation_policy(replace(t, draft_pass_costs=passes)))
    assert (p.draft_s_per_position, p.draft_s_per_token) == (0.002, 0.0001)


def test_policy_from_telemetry_follows_mode_kv_and_method():
    on = spec_telemetry(config=ns.SpeculationConfig(method="ngram", num_speculative_tokens=K, mode="on",
                                                    max_compute_fraction=0.5), num_waiting=50, kv_usage=0.99)
    p = speculation_policy(on)
    assert (p.mode, p.max_depth, p.draft_cost_factor, p.max_compute_fraction, p.probe) == (
        "on", K, 1.0, 0.5, False)
    for mode in ("auto", "latency_first", "throughput_first"):
        config = ns.SpeculationConfig(method="ngram", num_speculative_tokens=K, mode=mode)
        assert speculation_policy(spec_telemetry(config=config, kv_usage=0.95)).max_depth == 0
    throughput = ns.SpeculationConfig(method="ngram", num_speculative_tokens=K, mode="throughput_first")
    assert speculation_policy(spec_telemetry(config=throughput, num_waiting=4)).draft_cost_factor == 2.5
    latency = ns.SpeculationConfig(method="ngram", num_speculative_tokens=K, mode="latency_first")
    assert speculation_policy(spec_telemetry(config=latency, num_waiting=4)).draft_cost_factor == 1.0
    assert speculation_policy(spec_telemetry(config=ns.SpeculationConfig())) == SpeculationPolicy.off()


def test_no_probe_for_a_proposer_that_cannot_pay_even_when_every_draft_is_accepted():
    idle = spec_telemetry(accept_rates=(0.0,) * K, num_requests=1, num_steps_without_drafts=PROBE_INTERVAL)
    assert speculation_policy(idle).probe
    # measured passes as dear as the target's own step: even all-accepted drafts lose
    dear = tuple((n, 2 * (FIXED_S + PER_TOKEN_S * n)) for n in (1, 2) * 8)
    p = speculation_policy(replace(idle, draft_pass_costs=dear))
    assert not p.probe and max(choose_depths(replace(p, accept_rates=(1.0,) * K), 1, [K])) == 0


def test_policy_from_telemetry_probes_after_the_interval_and_backs_off_for_a_catching_up_proposer():
    assert not speculation_policy(spec_telemetry(num_steps_without_drafts=PROBE_INTERVAL - 1)).probe
    p = speculation_policy(spec_telemetry(num_steps_without_drafts=PROBE_INTERVAL))
    assert p.probe and p.probe_width is None
    late = spec_telemetry(catches_up=True, num_idle_probes=2, num_steps_without_drafts=4 * PROBE_INTERVAL - 1)
    assert not speculation_policy(late).probe
    p = speculation_policy(replace(late, num_steps_without_drafts=4 * PROBE_INTERVAL))
    assert p.probe and p.probe_width == 1


def test_the_engines_own_decision_and_the_one_from_its_telemetry_are_the_same():
    local, remote = trained(0.9), trained(0.9)
    policies = []
    for step in range(4 * PROBE_INTERVAL):  # acceptance collapses: depth falls to 0, then probes
        wire = pickle.loads(pickle.dumps(remote.telemetry()))  # as it crosses to the scheduler actor
        policies.append(speculation_policy(wire))
        remote.adopt(policies[-1])
        assert local.policy() == policies[-1], step
        depths = choose_depths(policies[-1], 4, [K] * 4)
        verified, accepted = count_positions([(d, 0) for d in depths], K)
        stats = SpecStepStats(4 + sum(depths), FIXED_S + PER_TOKEN_S * (4 + sum(depths)), 4, 0, 0.3,
                              num_drafts_per_position=verified, num_accepted_per_position=accepted)
        local.observe(stats)
        remote.observe(stats)
    assert policies[0].max_depth == K and any(p.probe for p in policies)
    assert [max(choose_depths(p, 4, [K] * 4)) for p in policies[:2]] == [K, K]
    assert max(choose_depths(policies[-1], 4, [K] * 4)) <= 1


def test_the_scheduler_answers_a_speculating_worker_with_its_policy_and_keeps_no_state_for_it():
    """One policy per draft method the worker weighs, in its order (two here: a method "auto" worker)."""
    limits = PolicyLimits(max_token_budget=512, max_num_seqs=64, max_queued=16, target_step_s=0.1)
    t = spec_telemetry(num_waiting=2, kv_usage=0.875)
    other = spec_telemetry(config=ns.SpeculationConfig(method="eagle", num_speculative_tokens=K),
                           accept_rates=(0.95,) * K)
    report = StepTelemetry("w0", 4, 2, 10, 40, 0.02, 0.875, 0, speculation=(t, other))
    policy = BatchingPolicy(limits).update(report)
    assert (policy.speculation == (speculation_policy(t), speculation_policy(other))
            and policy.token_budget == 512)
    assert policy.speculation[0] != policy.speculation[1]
    assert BatchingPolicy(limits).update(report).speculation == policy.speculation  # a restarted scheduler
    assert BatchingPolicy(limits).update(replace(report, speculation=None)).speculation is None
    scheduler = Scheduler.__ray_actor_class__(limits)  # the actor's code, in this process
    assert scheduler.report(report) == policy
    stats = scheduler.stats()["w0"]
    assert (stats["speculation"] == [asdict(p) for p in policy.speculation]
            and stats["policy"]["token_budget"] == 512)
    assert stats["telemetry"]["speculation"][0]["num_step_costs"] == len(LINE)
    assert stats["telemetry"]["speculation"][0]["accept_rates"] == t.accept_rates
    assert stats["telemetry"]["speculation"][1]["method"] == "eagle"


class NoDrafts(Proposer):
    def propose(self, requests, depths):
        return [[] for _ in requests]


def test_an_engine_keeps_a_pushed_policy_until_the_next_but_its_probe_lasts_one_refresh():
    spec = Speculator(ns.SpeculationConfig(method="ngram", num_speculative_tokens=K), NoDrafts())
    assert spec.stats()["spec_policy_source"] == "engine"
    pushed = replace(speculation_policy(spec_telemetry()), mode="on", max_depth=2, probe=True)
    spec.push(pushed)
    assert spec.policy == pushed and spec.stats()["spec_policy_source"] == "scheduler"
    assert spec.controller.num_idle_probes == 1
    for step in range(3 * POLICY_REFRESH_STEPS):
        spec.refresh_policy()  # as each step's choose does: reading the policy moves nothing on
        assert spec.policy == (pushed if step < POLICY_REFRESH_STEPS else replace(pushed, probe=False)), step
        spec.record(StepPlan(), SamplerOutput((), (), ()), 0.01, 0.0, 0, 0.3)
    assert spec.telemetry().num_requests == 0 and spec.telemetry().kv_usage == 0.3


# ---- method "auto": the chooser picks the method with the best expected goodput ----------------------

class Candidate:
    """A stand-in for one method's Speculator: it always drafts (or never: depth 0), or probes."""

    def __init__(self, depth: int = 2, probe: bool = False):
        self.depth, self.num_drafted = depth, 0
        self.policy = replace(SpeculationPolicy.off(), probe=probe)
        self.draft_seconds = 0.0

    def choose(self, plan):
        n = len(plan.scheduled)
        return DraftChoice(list(range(n)), [None] * n, [self.depth] * n, self.policy)

    def draft(self, plan, batcher, choice):
        self.num_drafted += 1
        return plan

    def record(self, plan, out, seconds, draft_seconds, num_waiting, kv_usage, drafted=True):
        return SpecStepStats(plan.num_tokens, seconds, len(plan.scheduled), 0, 0.0,
                             num_drafts_per_position=(int(drafted),))

    def end_probe(self):
        self.policy = replace(self.policy, probe=False)


def decode_steps(chooser: MethodChooser, num_steps: int, batch: int, tokens_per_s: dict) -> list:
    """Run num_steps decode steps of `batch` requests; the option chosen delivers its tokens_per_s.
    -> the option of each step."""
    reqs = [Request(f"r{i}", [1, 2], ns.SamplingParams(), max_model_len=64) for i in range(batch)]
    for req in reqs:
        req.num_computed_tokens = 1  # decoding: its last token to compute
    plan = StepPlan(tuple(ScheduledRequest(req, 1) for req in reqs))
    out = SamplerOutput((SampledTokens([1], None, 0, 0, [0]),) * batch, (None,) * batch, (None,) * batch)
    ran = []
    for _ in range(num_steps):
        chooser.propose(plan, None)
        option = chooser._option
        seconds = batch / tokens_per_s[option]
        chooser.record(plan, out, seconds, 0.0, 0, 0.0)
        ran.append(option)
    return ran


def test_the_method_chooser_runs_what_delivered_most_at_each_batch_size_after_measuring_each_option():
    # medusa's policy: no drafts
    fakes = {"ngram": Candidate(), "medusa": Candidate(depth=0), "eagle": Candidate()}
    log = DecisionLog()
    chooser = MethodChooser(ns.SpeculationConfig(method="auto"), fakes, log)
    at_1 = {"none": 100.0, "ngram": 150.0, "eagle": 250.0}
    ran = decode_steps(chooser, 60, 1, at_1)
    measuring = 3 * MEASURE_STEPS  # each option once (medusa is no option: its policy does not draft)
    assert sorted(set(ran[:measuring])) == ["eagle", "ngram", "none"] and set(ran[measuring:]) == {"eagle"}
    assert fakes["medusa"].num_drafted == 0
    # another batch size is measured on its own, and there a plain step delivers most
    at_16 = {"none": 1000.0, "ngram": 900.0, "eagle": 800.0}
    assert set(decode_steps(chooser, 40, 16, at_16)[measuring:]) == {"none"}
    assert set(decode_steps(chooser, 10, 1, at_1)) == {"eagle"}  # batch size 1 keeps what it measured
    # options are measured again after REMEASURE_STEPS decode steps of their batch size
    ran = decode_steps(chooser, REMEASURE_STEPS, 1, at_1 | {"none": 400.0})
    assert ran[-1] == "none"
    reasons = [d["reason"] for d in log.recent("speculation") if d["subject"] == "method"]
    assert any("delivered the most decode tokens/s at batch size 16" in r for r in reasons)


def test_a_probing_method_drafts_one_step_then_the_chooser_goes_on():
    fakes = {"ngram": Candidate(), "eagle": Candidate(probe=True)}
    chooser = MethodChooser(ns.SpeculationConfig(method="auto"), fakes)
    ran = decode_steps(chooser, 4, 1, {"none": 100.0, "ngram": 150.0, "eagle": 120.0})
    # the probe's one step, then the options are measured in turn, a plain step first
    assert ran == ["eagle", "none", "none", "none"] and not fakes["eagle"].policy.probe
