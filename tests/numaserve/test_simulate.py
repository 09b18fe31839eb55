"""The simulator (numaserve/simulate): deterministic, conserving, and stepping the real batcher as a plain
loop over it would."""

import json

import pytest

from cluster_configs.engine_config import EngineConfig
from cluster_configs.sampling_params import SamplingParams
from numaserve.simulate.config import SimConfig
from numaserve.simulate.sim_proposer import SimProposer
from numaserve.simulate.sim_worker import SimWorker
from numaserve.simulate.simulator import Simulation, simulate
from numaserve.simulate.step_cost import (
    BUILT_IN,
    FREE_DEPLOYMENT,
    DeploymentCost,
    StepCostModel,
    StepShape,
    prefill_pairs,
    two_socket_32c,
)
from numaserve.simulate.tensor_parallel import (
    BUILT_IN_ALL_REDUCE,
    AllReduceCost,
    ModelDims,
    TensorParallelStepCost,
    fit_all_reduce,
)
from scheduling.request import Request

ONE_SECOND_STEPS = StepCostModel(fixed_s=1.0, weights_s=0.0, row_s=0.0, sharpness=1.0, context_token_s=0.0,
                                 prefill_pair_s=0.0, draft_pass_s=0.0)


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


TRUTH = StepCostModel(fixed_s=0.015, weights_s=0.03, row_s=0.004, sharpness=3.0, context_token_s=8e-6,
                      prefill_pair_s=5e-6)


def test_the_step_is_the_smooth_max_of_the_weights_stream_and_the_rows_compute():
    one = StepShape(1, 0, 0, 0, 0)
    many = StepShape(4096, 0, 0, 0, 0)
    assert TRUTH.seconds(one) == pytest.approx(TRUTH.fixed_s + TRUTH.weights_s, rel=1e-3)  # memory-bound
    assert TRUTH.seconds(many) == pytest.approx(TRUTH.fixed_s + 4096 * TRUTH.row_s, rel=1e-6)  # compute-bound
    # a prefill token, a draft row and a decode row are rows alike
    assert (TRUTH.seconds(StepShape(3, 5, 2, 0, 0)) == TRUTH.seconds(StepShape(10, 0, 0, 0, 0))
            == TRUTH.seconds(StepShape(0, 10, 0, 0, 0)))
    assert prefill_pairs(4, 0) == 10 and prefill_pairs(4, 6) == 34 and prefill_pairs(1, 6) == 7


@pytest.mark.parametrize("field", range(5))
def test_a_step_costs_more_with_more_of_anything(field):
    base = [4, 64, 2, 600, prefill_pairs(64, 0)]
    for model in (TRUTH, BUILT_IN):
        costs = []
        for more in (0, 1, 10, 1000):
            fields = list(base)
            fields[field] += more
            costs.append(model.seconds(StepShape(*fields)))
        assert costs == sorted(costs) and costs[0] < costs[-1]


def test_scaled_divides_the_weights_stream_by_bandwidth_and_the_rest_but_the_fixed_cost_by_compute():
    fast = TRUTH.scaled(compute=16.0, bandwidth=5.0, source="x")
    assert (fast.fixed_s, fast.weights_s, fast.sharpness) == (TRUTH.fixed_s, TRUTH.weights_s / 5, 3.0)
    for name in ("row_s", "context_token_s", "prefill_pair_s"):
        assert getattr(fast, name) == getattr(TRUTH, name) / 16
    assert fast.source == "x"
    # batch 1 decode is memory-bound: x5 bandwidth, about 1/5 the kernels' time; a long prefill x16 compute
    decode = StepShape(1, 0, 0, 0, 0)
    assert fast.seconds(decode) - fast.fixed_s == pytest.approx((TRUTH.seconds(decode) - TRUTH.fixed_s) / 5,
                                                                rel=1e-2)
    prefill = StepShape(0, 4096, 0, 0, prefill_pairs(4096, 0))
    assert fast.seconds(prefill) - fast.fixed_s == pytest.approx(
        (TRUTH.seconds(prefill) - TRUTH.fixed_s) / 16, rel=1e-3)
    assert two_socket_32c(TRUTH).seconds(prefill) == fast.seconds(prefill)


def test_the_validation_counts_what_callers_receive_as_the_simulator_counts_it():
    """benchmarks/validate_simulator.figures over the simulated callers' deliveries (recorded per stream)
    gives the simulator's own throughput, TTFT p50 and ITL p50."""
    from benchmarks.validate_simulator import Played, figures

    sim = Simulation(small(workers=2, machines=1, rate=3.0, duration_s=8.0))
    played: dict[str, Played] = {}
    deliver = sim._deliver

    def recording_deliver(s, n, finished):
        p = played.setdefault(s.arrival.request_id, Played(s.arrived_at))
        p.deliveries.append((sim.events.now, n))
        deliver(s, n, finished)

    sim._deliver = recording_deliver
    result = sim.run()
    counted = figures(list(played.values()), sim.cfg.duration_s, sim.cfg.warmup_s)
    for name in ("throughput_tok_s", "ttft_p50_s", "itl_p50_s", "completed"):
        assert counted[name] == pytest.approx(result[name], rel=1e-12), name
    assert result["completed"] > 10


def test_numaserve_simulate_prints_the_run_of_the_same_flags_and_names_a_bad_step_cost_file(tmp_path, capsys):
    """`numaserve simulate` and `python -m benchmarks.simulate` take the same flags and give the same JSON
    (the run is deterministic); a step-cost file that is not a fitted model is an error naming the fix."""
    from benchmarks.simulate.__main__ import main as checkout_main
    from numaserve.cli import main

    flags = ["--workers", "2", "--rate", "4", "--duration-s", "6", "--max-tokens", "16", "--seed", "4"]
    assert main(["simulate", *flags, "--json", str(tmp_path / "cli.json")]) == 0
    checkout_main([*flags, "--json", str(tmp_path / "checkout.json")])
    cli, checkout = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cli", "checkout"))
    assert cli == checkout and cli["completed"] > 0
    bad = tmp_path / "step_cost.json"
    bad.write_text('{"model": {"fixed_s": 1.0}}')
    capsys.readouterr()
    assert main(["simulate", "--step-cost", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "step_cost.json is not a fitted step-cost model" in err and "benchmarks.fit_step_cost" in err


def test_a_tensor_parallel_group_divides_a_nodes_step_but_its_fixed_cost_and_adds_its_collectives():
    # each rank streams 1 / N of the weights from its own node and does 1 / N of the rows and attention;
    # what it adds: 2 all-reduces a layer and the embedding's of rows x hidden float32, and the logits' gather
    ar = AllReduceCost(latency_s=1e-5, per_byte_s=1e-9)
    dims = ModelDims(num_layers=4, hidden=8, vocab=100)
    group = TensorParallelStepCost(TRUTH, 2, ar, dims)
    shape = StepShape(3, 5, 2, 600, prefill_pairs(5, 0))
    rows, sampled = 10, 5
    collectives = 9 * ar.seconds(rows * 8 * 4) + ar.seconds(sampled * 50 * 4)
    assert group.collectives_s(shape) == pytest.approx(collectives)
    half = StepCostModel(fixed_s=TRUTH.fixed_s, weights_s=TRUTH.weights_s / 2, row_s=TRUTH.row_s / 2,
                         sharpness=TRUTH.sharpness, context_token_s=TRUTH.context_token_s / 2,
                         prefill_pair_s=TRUTH.prefill_pair_s / 2)
    assert group.seconds(shape) == pytest.approx(half.seconds(shape) + collectives)
    assert TensorParallelStepCost(TRUTH, 1, ar, dims).seconds(shape) == TRUTH.seconds(shape)  # no collectives
    # batch 1 is memory-bound: about half the kernels' time, plus the collectives' latencies
    one = StepShape(1, 0, 0, 0, 0)
    assert group.seconds(one) - TRUTH.fixed_s == pytest.approx(
        (TRUTH.seconds(one) - TRUTH.fixed_s) / 2 + group.collectives_s(one), rel=1e-2)


def test_a_tensor_parallel_workers_pool_holds_its_heads_so_as_many_more_tokens():
    # bfloat16 KV: a token's bytes halve exactly with the heads (int8's would too, the pool's floor not)
    engine = EngineConfig(max_model_len=2048, kv_cache_bytes=64 << 20, max_num_seqs=4096, kv_dtype="bfloat16")
    blocks = [SimWorker("w", engine, TRUTH, SimProposer(0.5, 0, 0.0), 2048, n).scheduler.kv.pool.num_blocks
              for n in (1, 2, 4)]
    assert blocks[1] == 2 * blocks[0] and blocks[2] == 4 * blocks[0]


def test_the_all_reduce_line_fits_the_benchmarks_medians(tmp_path):
    rows = {f"{r}x{h}": {"bytes": r * h * 4, "median_us": 5.0 + r * h * 4 * 2e-3} for r in (1, 8, 32)
            for h in (2048, 4096)}
    path = tmp_path / "all_reduce.json"
    path.write_text(json.dumps({"date": "d", "rows": rows}))
    fitted = fit_all_reduce(path)
    assert fitted.latency_s == pytest.approx(5e-6) and fitted.per_byte_s == pytest.approx(2e-9)
    assert fit_all_reduce(tmp_path / "absent.json") == BUILT_IN_ALL_REDUCE
    run = simulate(small(workers=2, machines=1, tensor_parallel=2, all_reduce=fitted))
    assert run["completed"] + run["rejected"] == run["arrived"] and run["config"]["tensor_parallel"] == 2
