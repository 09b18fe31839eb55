"""The simulator (benchmarks/simulate): deterministic, conserving, and stepping the real batcher as a plain
loop over it would."""

import json

import pytest

from benchmarks.simulate.config import SimConfig
from benchmarks.simulate.sim_proposer import SimProposer
from benchmarks.simulate.sim_worker import SimWorker
from benchmarks.simulate.simulator import Simulation, simulate
from benchmarks.simulate.step_cost import FREE_DEPLOYMENT, DeploymentCost, StepCostModel
from cluster_configs.engine_config import EngineConfig
from cluster_configs.sampling_params import SamplingParams
from scheduling.request import Request

ONE_SECOND_STEPS = StepCostModel(fixed_s=1.0, decode_row_s=0.0, prefill_token_s=0.0, draft_row_s=0.0,
                                 context_token_s=0.0, draft_pass_s=0.0)


def small(**fields) -> SimConfig:
    return SimConfig(**{"workers": 4, "machines": 2, "rate": 6.0, "duration_s": 4.0} | fields)


def test_same_seed_same_json_and_another_seed_differs():
    cfg = small(trace="sessions", speculation="auto")
    first = json.dumps(simulate(cfg))
    assert json.dumps(simulate(cfg)) == first
    assert json.dumps(simulate(cfg.model_copy(update={"seed": 1}))) != first


@pytest.mark.parametrize("trace", ["poisson", "bursty", "sessions", "adapters"])
@pytest.mark.parametrize("routing", ["relay", "placement"])
def test_every_arrival_completes_or_is_rejected_and_tokens_are_conserved(trace, routing):
    # a tight admission bound at twice a worker's capacity: some requests are refused
    r = simulate(small(trace=trace, routing=routing, rate=12.0, max_queued_per_worker=0, speculation="auto",
                       engine=EngineConfig(max_model_len=2048, max_num_seqs=2)))
    assert r["arrived"] > 0 and r["completed"] + r["rejected"] == r["arrived"]
    assert r["generated_tokens"] == r["delivered_tokens"] == r["completed"] * 64
    if trace != "sessions":  # (a refused session's later turns never arrive)
        assert r["rejected"] > 0


def test_one_worker_steps_exactly_as_a_plain_loop_over_the_real_batcher():
    """1 worker, free calls, every step 1 s: the simulated steps (start time, each request's tokens) equal a
    loop that admits the arrivals before each step and plans it with Batcher.schedule."""
    engine = EngineConfig(max_model_len=2048, max_num_batched_tokens=64, max_num_seqs=8)
    cfg = SimConfig(workers=1, rate=0.4, duration_s=40.0, step_cost=ONE_SECOND_STEPS,
                    deployment_cost=FREE_DEPLOYMENT, engine=engine, target_step_s=10.0, admission=False)
    sim, steps = Simulation(cfg), []
    [worker] = sim.workers.values()
    plan_step = worker.plan_step

    def recording_plan_step():
        plan, seconds = plan_step()
        steps.append((sim.events.now, [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled]))
        return plan, seconds

    worker.plan_step = recording_plan_step
    result = sim.run()
    assert result["completed"] == len(sim.arrivals) > 3

    ref = SimWorker("ref", engine, ONE_SECOND_STEPS, SimProposer(0.0, 0, 0.0), 2048)
    arrivals, expected, now = list(enumerate(sim.arrivals)), [], 0.0
    while arrivals or ref.has_unfinished():
        if not ref.has_unfinished():
            now = max(now, arrivals[0][1].time)
        while arrivals and arrivals[0][1].time <= now:
            i, a = arrivals.pop(0)
            ref.sampler.register(a.request_id, a.output_ids, i)
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            ref.submit(Request(a.request_id, list(a.prompt_ids), params, max_model_len=2048))
        plan = ref.batcher.schedule()
        expected.append((now, [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled]))
        ref.finish_step(plan, 1.0)
        now += 1.0
    assert [(t, p) for t, p in steps if p] == expected
    assert any(n == 64 for _, p in expected for _, n in p)  # chunked prefills came into it


def test_sessions_hit_their_previous_turns_with_one_worker_and_miss_when_scattered():
    r = simulate(SimConfig(workers=1, rate=1.0, duration_s=20.0, trace="sessions"))
    assert r["session_hit_rate"] == 1.0
    scattered = simulate(SimConfig(workers=8, rate=8.0, duration_s=10.0, trace="sessions", stickiness=False,
                                   prefix_affinity=False))
    assert scattered["session_hit_rate"] < 0.5
    sticky = simulate(SimConfig(workers=8, rate=8.0, duration_s=10.0, trace="sessions"))
    assert sticky["session_hit_rate"] == 1.0 and sticky["routed"]["session"] > 0


@pytest.mark.parametrize("trace", ["poisson", "adapters"])
def test_imbalance_is_max_over_mean_worker_tokens(trace):
    sim = Simulation(small(trace=trace, workers=8))
    r = sim.run()
    tokens = [w.num_generated_tokens for w in sim.workers.values()]
    assert r["imbalance"] == pytest.approx(max(tokens) * len(tokens) / sum(tokens))
    assert r["imbalance"] >= 1.0


def test_relay_and_placement_agree_when_calls_are_free():
    figures = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "completed")
    relay, placement = (simulate(small(workers=1, machines=1, routing=routing,
                                       deployment_cost=FREE_DEPLOYMENT))
                        for routing in ("relay", "placement"))
    assert {k: relay[k] for k in figures} == {k: placement[k] for k in figures}
    assert relay["router_calls_per_request"] > 2.0 == placement["router_calls_per_request"]


def test_a_dear_chunk_saturates_the_relaying_router_first():
    dear = DeploymentCost(router_chunk_s=0.02)
    relay, placement = (simulate(small(workers=8, rate=12.0, duration_s=10.0, routing=routing,
                                       deployment_cost=dear))
                        for routing in ("relay", "placement"))
    assert relay["router_utilization"] > 0.9 > placement["router_utilization"]
    assert relay["throughput_tok_s"] < 0.8 * placement["throughput_tok_s"]
    assert relay["itl_p50_s"] > placement["itl_p50_s"]


def test_the_fit_recovers_a_step_cost_model_and_the_simulator_reads_it(tmp_path):
    from benchmarks.fit_step_cost import fit
    from benchmarks.simulate.step_cost import default_step_cost

    truth = StepCostModel(fixed_s=0.02, decode_row_s=0.003, prefill_token_s=0.004, draft_row_s=0.003,
                          context_token_s=5e-6)
    samples = [{"decode_rows": b, "prefill_tokens": p, "context_tokens": b * c,
                "seconds": truth.seconds(b, p, 0, b * c)}
               for b in (1, 4, 16) for c in (64, 512) for p in (0, 128)]
    model, residual = fit(samples)
    assert residual < 1e-12
    path = tmp_path / "step_cost.json"
    path.write_text(json.dumps({"model": model}))
    read = default_step_cost(path)
    assert read.seconds(8, 32, 2, 1000) == pytest.approx(truth.seconds(8, 32, 2, 1000))
    assert read.source == "step_cost.json"
    assert default_step_cost(tmp_path / "absent.json").source == "built-in guess"
