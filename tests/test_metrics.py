"""WorkerMetrics over an in-process engine (no Ray cluster: ray.util.metrics records nowhere) and render's
Prometheus text: counts exact, the warm-up left out, an abort counted by its reason, histograms cumulative."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import numaserve as ns
from actors.metrics import ALL, HISTOGRAMS, WorkerMetrics, full_name, render
from scheduling.engine import Engine
from tests.conftest import random_prompt

GREEDY = ns.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def run(engine: Engine, metrics: WorkerMetrics) -> None:
    """The worker's loop: step until every request is done, the metrics seeing each step."""
    while engine.has_unfinished():
        step(engine, metrics)


def step(engine: Engine, metrics: WorkerMetrics) -> None:
    start = time.perf_counter()
    metrics.step(engine.step(), start)


def submit(engine: Engine, metrics: WorkerMetrics, request_id: str, prompt: list[int], params=GREEDY) -> None:
    req = engine.make_request(request_id, prompt, params)
    engine.submit(req)
    metrics.submitted(req)


def samples(snapshots: list[dict]) -> list:
    return [s for family in text_string_to_metric_families(render(snapshots).decode())
            for s in family.samples]


def value(all_samples: list, name: str, **labels) -> float:
    return sum(s.value for s in all_samples if s.name == name and labels.items() <= s.labels.items())


@pytest.fixture
def engine(llama_dir) -> Engine:
    engine = Engine(llama_dir, ns.EngineConfig(max_num_seqs=4))
    engine.add_request("warm-up", [1, 2, 3], GREEDY)  # as the worker warms up: before any metrics
    while engine.has_unfinished():
        engine.step()
    return engine


def test_counts_are_exact_and_the_warm_up_is_not_counted(engine):
    metrics = WorkerMetrics("llama", "local-numa1-0", 1)
    prompts = [random_prompt(n, seed=n) for n in (5, 9, 40, 40)]  # the last two are the same
    for i, prompt in enumerate(prompts[:3]):
        submit(engine, metrics, f"r{i}", prompt)
    run(engine, metrics)
    submit(engine, metrics, "r3", prompts[3])  # finds the full blocks of r2's prompt in the prefix cache
    run(engine, metrics)
    submit(engine, metrics, "gone", random_prompt(7, seed=1),
           ns.SamplingParams(max_tokens=50, ignore_eos=True))
    step(engine, metrics)
    metrics.outputs([engine.abort("gone")])
    snapshot = metrics.snapshot(engine)
    assert snapshot["labels"] == {"model_name": "llama", "worker": "local-numa1-0", "numa_node": "1"}
    v = snapshot["values"]
    num_prompt = sum(map(len, prompts)) + 7
    assert (v["prompt_tokens"], v["generation_tokens"]) == (num_prompt, 4 * 6 + 1)
    assert snapshot["request_success"] == {"stop": 0, "length": 4, "abort": 1}
    assert v["prefix_cache_queries"] == num_prompt
    assert 0 < v["prefix_cache_hits"] < 40
    assert (v["num_requests_running"], v["num_requests_waiting"], v["kv_cache_usage_perc"]) == (0, 0, 0)
    hist = snapshot["histograms"]
    assert sum(hist["time_to_first_token_seconds"]["counts"]) == 5
    assert sum(hist["e2e_request_latency_seconds"]["counts"]) == 5
    assert sum(hist["request_queue_time_seconds"]["counts"]) == 5
    assert sum(hist["inter_token_latency_seconds"]["counts"]) == 4 * 5  # the aborted one had one step


def test_render_names_every_metric_in_vllms_style_with_cumulative_buckets(engine):
    metrics = [WorkerMetrics("llama", f"w{i}", i) for i in range(2)]
    for i in range(3):
        submit(engine, metrics[0], f"a{i}", random_prompt(6, seed=i))
    run(engine, metrics[0])
    found = samples([m.snapshot(engine) for m in metrics])
    names = {s.name for s in found}
    for m in ALL:
        suffixes = {"gauge": [""], "counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"]}[m.kind]
        assert {full_name(m) + suffix for suffix in suffixes} <= names, m.name
    assert value(found, "numaserve:generation_tokens_total", worker="w0") == 18
    assert value(found, "numaserve:generation_tokens_total", worker="w1") == 0
    assert value(found, "numaserve:request_success_total", worker="w0", finished_reason="length") == 3
    for m in HISTOGRAMS:
        buckets = sorted((float(s.labels["le"]), s.value) for s in found
                         if s.name == f"{full_name(m)}_bucket" and s.labels["worker"] == "w0")
        assert [le for le, _ in buckets] == [*m.buckets, float("inf")]
        counts = [c for _, c in buckets]
        assert counts == sorted(counts) and counts[-1] == value(found, f"{full_name(m)}_count", worker="w0")
