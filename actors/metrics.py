"""Prometheus metrics of a deployment: vLLM's names with a `numaserve:` prefix, labelled by model, worker and
NUMA node.

Each worker's loop thread keeps a WorkerMetrics: it times each request from its submission (queue time,
time to first token, inter-token latency, end-to-end latency) and counts prompt and generation tokens and
finished requests by reason, from the engine's outputs; prefix-cache queries and hits, preemptions and each
speculation method's drafts and accepted tokens from each step's StepStats; running / waiting requests, KV
usage and KV blocks in use are gauges of the engine's stats. It records
all of them with
ray.util.metrics, for Ray's per-node Prometheus export and dashboard (where Ray's rules make the names
`ray_numaserve_...`), and keeps exact copies that its stats carry: the router gathers those
(Router.metrics) and `render` turns them, with the HTTP actor's request counts (http_api/metrics.py), into
the Prometheus text the HTTP server answers at GET /metrics.
"""

import bisect
import math
import time
from dataclasses import dataclass

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest
from ray.util import metrics as ray_metrics

from scheduling.outputs import RequestOutput, StepOutput

LABELS = ("model_name", "worker", "numa_node")
REASON = "finished_reason"
FINISH_REASONS = ("stop", "length", "abort")
RAY_GAUGE_INTERVAL_S = 0.1  # Ray exports every few seconds: fresher gauges buy nothing

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class Metric:
    name: str  # without the prefix; a counter's is rendered with _total
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    buckets: tuple[float, ...] = ()


GAUGES = (
    Metric("num_requests_running", "gauge", "Requests in the worker's running batch"),
    Metric("num_requests_waiting", "gauge", "Requests queued on the worker, not yet running"),
    Metric("kv_cache_usage_perc", "gauge", "Fraction of the worker's KV blocks in use (1 = full)"),
    Metric("kv_cache_used_blocks", "gauge", "KV blocks in use on the worker (a request's, or a session's)"),
)
# counted from the engine's StepStats
ENGINE_COUNTERS = (
    Metric("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache"),
    Metric("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache"),
    Metric("num_preemptions", "counter", "Requests preempted (their KV freed, recomputed later)"),
)
COUNTERS = (
    Metric("prompt_tokens", "counter", "Prompt tokens of requests that reached their first token"),
    Metric("generation_tokens", "counter", "Tokens generated"),
)
REQUEST_SUCCESS = Metric("request_success", "counter", "Finished requests by finish reason (abort: cancelled "
                                                       "or its client went away)")
METHOD = "method"
# counted from the engine's StepStats.drafts, per speculation method (vLLM's names, labelled by method)
SPEC_DECODE = (
    Metric("spec_decode_num_drafts", "counter", "Requests' drafts verified (one per request per step)"),
    Metric("spec_decode_num_draft_tokens", "counter", "Draft tokens verified"),
    Metric("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted"),
)
# the HTTP actor's, by route template, method and status code: prometheus-fastapi-instrumentator's name and
# labels, as vLLM's API server exports it (unprefixed), with the exact status code rather than "2xx"
HTTP_REQUESTS = Metric("http_requests_total", "counter", "HTTP requests answered, by handler, method and "
                                                         "status code")
HTTP_LABELS = ("handler", "method", "status")
HISTOGRAMS = (
    Metric("time_to_first_token_seconds", "histogram", "From submission to the worker to the first token",
           _LATENCY_BUCKETS),
    Metric("inter_token_latency_seconds", "histogram",
           "Between a request's successive engine steps with tokens", _LATENCY_BUCKETS),
    Metric("e2e_request_latency_seconds", "histogram", "From submission to the worker to the finish",
           _REQUEST_BUCKETS),
    Metric("request_queue_time_seconds", "histogram",
           "From submission to the worker to its first scheduled step", _REQUEST_BUCKETS),
)
ALL = (*GAUGES, *ENGINE_COUNTERS, *COUNTERS, REQUEST_SUCCESS, *SPEC_DECODE, *HISTOGRAMS)


def full_name(metric: Metric) -> str:
    return f"numaserve:{metric.name}"


@dataclass
class _Timing:
    arrival: float
    scheduled: float | None = None
    last_token: float | None = None
    num_prompt_tokens: int = 0


class WorkerMetrics:
    """One worker's metrics; every method runs on the worker's loop thread, the one that owns the engine."""

    def __init__(self, model_name: str, worker_id: str, numa_node: int):
        self.labels = {"model_name": model_name, "worker": worker_id, "numa_node": str(numa_node)}
        self.counters = dict.fromkeys((m.name for m in (*ENGINE_COUNTERS, *COUNTERS)), 0)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.spec_decode: dict[str, dict[str, int]] = {}  # method -> SPEC_DECODE name -> count
        self.histograms = {m.name: _Histogram(m.buckets) for m in HISTOGRAMS}
        self.timings: dict[str, _Timing] = {}  # the requests submitted through the worker and not finished
        self.unscheduled: set[str] = set()  # of those, the ones no step has run yet
        self._ray = _ray_metrics()
        self._ray_gauges_at = -math.inf

    def submitted(self, req) -> None:
        """req was just handed to the engine."""
        self.timings[req.request_id] = _Timing(time.perf_counter(), num_prompt_tokens=req.num_prompt_tokens)
        self.unscheduled.add(req.request_id)

    def step(self, step: StepOutput, step_start: float) -> None:
        """After an engine step that began at step_start (perf_counter)."""
        stats = step.stats
        for req_id in self.unscheduled.intersection(stats.scheduled_ids):
            self._observe("request_queue_time_seconds", step_start - self.timings[req_id].arrival)
            self.unscheduled.discard(req_id)
        self._count("prefix_cache_queries", stats.num_prefix_lookup_tokens)
        self._count("prefix_cache_hits", stats.num_prefix_hit_tokens)
        self._count("num_preemptions", len(stats.preempted_ids))
        for d in stats.drafts:
            counts = self.spec_decode.setdefault(d.method, dict.fromkeys((m.name for m in SPEC_DECODE), 0))
            for m, n in zip(SPEC_DECODE, (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens)):
                counts[m.name] += n
                if n:  # (Ray's counters refuse 0)
                    self._ray[m.name].inc(n, self.labels | {METHOD: d.method})
        self.outputs(step.outputs)
        now = time.perf_counter()
        if now - self._ray_gauges_at >= RAY_GAUGE_INTERVAL_S:
            self._ray_gauges_at = now
            self._record_gauges({"num_requests_running": stats.num_running,
                                 "num_requests_waiting": stats.num_waiting,
                                 "kv_cache_usage_perc": stats.kv_usage,
                                 "kv_cache_used_blocks": stats.num_used_blocks})

    def outputs(self, outputs: list[RequestOutput]) -> None:
        """The RequestOutputs of a step, an abort or passed deadlines."""
        now = time.perf_counter()
        num_generated, num_prompt = 0, 0
        for out in outputs:
            t = self.timings.get(out.request_id)
            if t is None:
                continue  # the warm-up request
            if out.token_ids:
                if t.last_token is None:
                    self._observe("time_to_first_token_seconds", now - t.arrival)
                    num_prompt += t.num_prompt_tokens
                else:
                    self._observe("inter_token_latency_seconds", now - t.last_token)
                t.last_token = now
                num_generated += len(out.token_ids)
            if out.finish_reason is not None:
                del self.timings[out.request_id]
                self.unscheduled.discard(out.request_id)
                self._observe("e2e_request_latency_seconds", now - t.arrival)
                self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1
                self._ray[REQUEST_SUCCESS.name].inc(1, self.labels | {REASON: out.finish_reason})
        self._count("prompt_tokens", num_prompt)
        self._count("generation_tokens", num_generated)

    def snapshot(self, engine) -> dict:
        """Exact values now, as plain data (it crosses to the router): the labels, then each metric's value;
        a histogram's is {"buckets": upper bounds, "counts": per bucket and +Inf, "sum": ...}."""
        for req_id in [r for r in self.timings if r not in engine.scheduler.requests]:
            del self.timings[req_id]  # failed with the engine's step: they have no output
            self.unscheduled.discard(req_id)
        gauges = _gauges(engine.stats())
        self._record_gauges(gauges)
        values = gauges | self.counters
        return {"labels": dict(self.labels), "values": values, REQUEST_SUCCESS.name: dict(self.finished),
                "spec_decode": {method: dict(c) for method, c in self.spec_decode.items()},
                "histograms": {name: h.as_dict() for name, h in self.histograms.items()}}

    def _observe(self, name: str, seconds: float) -> None:
        self.histograms[name].observe(seconds)
        self._ray[name].observe(seconds, self.labels)

    def _count(self, name: str, n: int) -> None:
        if n:
            self.counters[name] += n
            self._ray[name].inc(n, self.labels)

    def _record_gauges(self, gauges: dict[str, float]) -> None:
        for name, value in gauges.items():
            self._ray[name].set(value, self.labels)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # the first bucket whose bound >= value
        self.sum += value

    def as_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


def _gauges(stats: dict) -> dict[str, float]:
    return {"num_requests_running": stats["num_running"], "num_requests_waiting": stats["num_waiting"],
            "kv_cache_usage_perc": stats["kv_usage"], "kv_cache_used_blocks": stats["num_used_blocks"]}


_ray_cache: dict | None = None


def _ray_metrics() -> dict:
    """This process's ray.util.metrics objects, one per metric (Ray's names cannot hold ':')."""
    global _ray_cache
    if _ray_cache is None:
        _ray_cache = {}
        for m in ALL:
            name = full_name(m).replace(":", "_")
            if m.kind == "gauge":
                _ray_cache[m.name] = ray_metrics.Gauge(name, m.help, tag_keys=LABELS)
            elif m.kind == "counter":
                keys = (*LABELS, REASON) if m is REQUEST_SUCCESS else (*LABELS, METHOD) if m in SPEC_DECODE \
                    else LABELS
                _ray_cache[m.name] = ray_metrics.Counter(name, m.help, tag_keys=keys)
            else:
                _ray_cache[m.name] = ray_metrics.Histogram(name, m.help, boundaries=list(m.buckets),
                                                           tag_keys=LABELS)
    return _ray_cache


# ---- the deployment's /metrics ----------------------------------------------------------------------------

def render(snapshots: list[dict], http_requests: dict[tuple[str, str, str], int] | None = None) -> bytes:
    """Prometheus text format of the workers' snapshots (WorkerMetrics.snapshot), one series per worker, and
    of the HTTP actor's request counts ((handler, method, status) -> n: http_api/metrics.py)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshots, http_requests or {}))
    return generate_latest(registry)


class _Collector:
    def __init__(self, snapshots: list[dict], http_requests: dict[tuple[str, str, str], int]):
        self.snapshots, self.http_requests = snapshots, http_requests

    def collect(self):
        http = CounterMetricFamily(HTTP_REQUESTS.name.removesuffix("_total"), HTTP_REQUESTS.help,
                                   labels=HTTP_LABELS)
        for labels, n in sorted(self.http_requests.items()):
            http.add_metric(list(labels), n)
        yield http
        for m in ALL:
            name = full_name(m)
            if m is REQUEST_SUCCESS:
                family = CounterMetricFamily(name, m.help, labels=(*LABELS, REASON))
                for s in self.snapshots:
                    for reason, n in s[m.name].items():
                        family.add_metric([*_label_values(s), reason], n)
            elif m in SPEC_DECODE:
                family = CounterMetricFamily(name, m.help, labels=(*LABELS, METHOD))
                for s in self.snapshots:
                    for method, counts in s["spec_decode"].items():
                        family.add_metric([*_label_values(s), method], counts[m.name])
            elif m.kind == "histogram":
                family = HistogramMetricFamily(name, m.help, labels=LABELS)
                for s in self.snapshots:
                    h = s["histograms"][m.name]
                    cumulative = [sum(h["counts"][:i + 1]) for i in range(len(h["counts"]))]
                    bounds = [*(repr(float(b)) for b in h["buckets"]), "+Inf"]
                    family.add_metric(_label_values(s), list(zip(bounds, cumulative)), h["sum"])
            else:
                kind = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                family = kind(name, m.help, labels=LABELS)
                for s in self.snapshots:
                    family.add_metric(_label_values(s), s["values"][m.name])
            yield family


def _label_values(snapshot: dict) -> list[str]:
    return [snapshot["labels"][k] for k in LABELS]
