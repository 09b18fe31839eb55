"""WorkerMetrics over an in-process engine (no Ray cluster: ray.util.metrics records nowhere) and render's
Prometheus text: counts exact, the warm-up left out, an abort counted by its reason, histograms cumulative."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

import numaserve as ns
from actors.metrics import WorkerMetrics
from http_api.prometheus import ALL, HISTOGRAMS, SPEC_DECODE, full_name, render
from scheduling.engine import Engine
from scheduling.step_stats import STAGES
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
    assert v["kv_cache_used_blocks"] == 0
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
    for m in (m for m in ALL if m not in SPEC_DECODE):  # (no drafts here: test_speculation_counts_...)
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


def test_stage_histograms_count_each_step_that_ran_a_batch_and_sum_its_recorded_stage_seconds(engine):
    metrics = WorkerMetrics("llama", "w0", 0)
    for i in range(2):
        submit(engine, metrics, f"s{i}", random_prompt(9, seed=i))
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        out = engine.step()
        metrics.step(out, start)
        steps.append(out.stats)
    ran = [s for s in steps if s.scheduled_ids]
    snapshot = metrics.snapshot(engine)
    found = samples([snapshot])
    for stage in STAGES:
        h = snapshot["stage_histograms"][stage]
        expected = sum(getattr(s.seconds, stage) for s in ran)
        assert sum(h["counts"]) == len(ran) and h["sum"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert value(found, "numaserve:step_stage_seconds_count", stage=stage) == len(ran)
        assert value(found, "numaserve:step_stage_seconds_sum", stage=stage) == pytest.approx(expected)


def test_worker_cpu_seconds_are_this_processs_and_never_fall(engine):
    metrics = WorkerMetrics("llama", "w0", 0)
    first = metrics.snapshot(engine)["values"]["worker_cpu_seconds"]
    submit(engine, metrics, "busy", random_prompt(30, seed=5), ns.SamplingParams(max_tokens=40,
                                                                                  ignore_eos=True))
    run(engine, metrics)
    second = metrics.snapshot(engine)["values"]["worker_cpu_seconds"]
    assert 0 < first <= second
    assert value(samples([metrics.snapshot(engine)]), "numaserve:worker_cpu_seconds_total") >= second


def test_kv_blocks_in_use_are_the_pools_while_requests_hold_them(engine):
    metrics = WorkerMetrics("llama", "w0", 0)
    submit(engine, metrics, "long", random_prompt(40, seed=3),
           ns.SamplingParams(max_tokens=50, ignore_eos=True))
    step(engine, metrics)
    used = metrics.snapshot(engine)["values"]["kv_cache_used_blocks"]
    assert used == engine.scheduler.kv.pool.num_used_blocks >= 40 // engine.config.block_size
    assert value(samples([metrics.snapshot(engine)]), "numaserve:kv_cache_used_blocks") == used
    metrics.outputs([engine.abort("long")])
    assert metrics.snapshot(engine)["values"]["kv_cache_used_blocks"] == 0


def test_speculation_counts_per_method_equal_the_engines_totals(llama_dir):
    engine = Engine(llama_dir, ns.EngineConfig(max_num_seqs=4, speculation={"method": "ngram", "mode": "on"}))
    metrics = WorkerMetrics("llama", "w0", 0)
    for i in range(3):  # repetitive prompts: the n-gram proposer finds drafts in them
        submit(engine, metrics, f"r{i}", random_prompt(6, seed=i) * 4, ns.SamplingParams(max_tokens=24,
                                                                                        temperature=0))
    run(engine, metrics)
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    counts = metrics.snapshot(engine)["spec_decode"]
    assert counts == {"ngram": {"spec_decode_num_drafts": stats["spec_num_drafts"],
                                "spec_decode_num_draft_tokens": stats["spec_num_draft_tokens"],
                                "spec_decode_num_accepted_tokens": stats["spec_num_accepted_tokens"]}}
    found = samples([metrics.snapshot(engine)])
    for m in SPEC_DECODE:
        assert value(found, f"{full_name(m)}_total", method="ngram") == counts["ngram"][m.name]


def test_http_request_counts_render_as_vllms_http_requests_total():
    found = [s for family in text_string_to_metric_families(
        render([], {("/v1/completions", "POST", "200"): 3, ("/v1/completions", "POST", "400"): 1}).decode())
        for s in family.samples]
    assert {(s.name, s.labels["status"], s.value) for s in found} == {
        ("http_requests_total", "200", 3), ("http_requests_total", "400", 1)}
    assert all(s.labels["handler"] == "/v1/completions" and s.labels["method"] == "POST" for s in found)


def test_the_disk_tier_series_are_the_engines_counts(llama_dir, tmp_path):
    """A prompt computed by one engine and read back from the disk tier by a second: the second worker's
    prefix_cache_disk series equal its engine's stats; a worker without a disk tier reports 0."""
    prompt = random_prompt(100, seed=3)  # 6 full blocks of 16 before its last token
    first = Engine(llama_dir, ns.EngineConfig(prefix_cache_dir=str(tmp_path)))
    first.add_request("a", prompt, GREEDY)
    while first.has_unfinished():
        first.step()
    first.close()  # its writes flushed
    second = Engine(llama_dir, ns.EngineConfig(prefix_cache_dir=str(tmp_path)))
    metrics = WorkerMetrics("llama", "w1", 1)
    submit(second, metrics, "b", prompt)
    run(second, metrics)
    stats = second.stats()
    snapshots = [metrics.snapshot(second), WorkerMetrics("llama", "w0", 0).snapshot(Engine(llama_dir))]
    got = samples(snapshots)
    assert stats["disk_hit_blocks"] == 6 and stats["disk_lookups"] == stats["disk_hits"] == 1
    for name, expected in [("prefix_cache_disk_read_blocks_total", 6), ("prefix_cache_disk_hits_total", 1),
                           ("prefix_cache_disk_queries_total", 1),
                           ("prefix_cache_disk_read_bytes_total", stats["disk_read_bytes"]),
                           ("prefix_cache_disk_usage_bytes", stats["disk_used_bytes"])]:
        assert value(got, "numaserve:" + name, worker="w1") == expected > 0
        assert value(got, "numaserve:" + name, worker="w0") == 0
    second.close()
