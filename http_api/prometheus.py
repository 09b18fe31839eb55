"""The deployment's Prometheus metrics as GET /metrics answers them: vLLM's names with a `numaserve:` prefix,
labelled by model, worker and NUMA node (the workers record them: actors/metrics.py), and the HTTP server's
request counts (http_api/metrics.py), rendered from plain snapshots without Ray."""

from dataclasses import dataclass

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import generate_latest

from scheduling.step_stats import STAGES

LABELS = ("model_name", "worker", "numa_node")
REASON = "finished_reason"
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0)
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
STAGE = "stage"  # the label of STEP_STAGE_SECONDS: one of STAGES
STEP_STAGE_SECONDS = Metric("step_stage_seconds", "histogram",
                            "Seconds of each stage (schedule, propose, run, sample, process) of the worker's "
                            "engine steps that ran a batch", _STAGE_BUCKETS)
WORKER_CPU = Metric("worker_cpu_seconds", "counter",
                    "CPU seconds (user + system) of the worker's process and its tensor-parallel ranks")
# the prefix cache's disk tier (scheduling/disk_tier.py): the engine's totals and its files now (0: off)
DISK_TIER = (
    Metric("prefix_cache_disk_queries", "counter",
           "Prompts whose prefix missed the KV pool at a full block and was looked up in the disk tier"),
    Metric("prefix_cache_disk_hits", "counter", "Disk-tier lookups that found at least one block"),
    Metric("prefix_cache_disk_read_blocks", "counter", "KV blocks read back from the disk tier (checked)"),
    Metric("prefix_cache_disk_read_bytes", "counter", "Bytes of block files read back"),
    Metric("prefix_cache_disk_rejected_blocks", "counter",
           "Block files that failed a check (truncated, corrupted, foreign, stale): removed, never served"),
    Metric("prefix_cache_disk_written_bytes", "counter", "Bytes of block files written"),
    Metric("prefix_cache_disk_usage_bytes", "gauge", "Bytes of block files under the disk tier's folder"),
    Metric("prefix_cache_disk_reads_per_second", "gauge", "KV blocks read back per second (the last 5 s)"),
)
# each DISK_TIER metric's field of the engine's stats (DiskStats.as_dict)
DISK_STATS = dict(zip((m.name for m in DISK_TIER), (
    "disk_lookups", "disk_hits", "disk_hit_blocks", "disk_read_bytes", "disk_rejected_blocks",
    "disk_written_bytes", "disk_used_bytes", "disk_reads_per_s")))

ALL = (*GAUGES, *ENGINE_COUNTERS, *COUNTERS, REQUEST_SUCCESS, *SPEC_DECODE, *HISTOGRAMS, STEP_STAGE_SECONDS,
       WORKER_CPU, *DISK_TIER)


def full_name(metric: Metric) -> str:
    return f"numaserve:{metric.name}"


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
            elif m is STEP_STAGE_SECONDS:
                family = HistogramMetricFamily(name, m.help, labels=(*LABELS, STAGE))
                for s in self.snapshots:
                    for stage in STAGES:
                        _add_histogram(family, [*_label_values(s), stage], s["stage_histograms"][stage])
            elif m.kind == "histogram":
                family = HistogramMetricFamily(name, m.help, labels=LABELS)
                for s in self.snapshots:
                    _add_histogram(family, _label_values(s), s["histograms"][m.name])
            else:
                kind = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                family = kind(name, m.help, labels=LABELS)
                for s in self.snapshots:
                    family.add_metric(_label_values(s), s["values"][m.name])
            yield family


def _add_histogram(family: HistogramMetricFamily, labels: list[str], h: dict) -> None:
    cumulative = [sum(h["counts"][:i + 1]) for i in range(len(h["counts"]))]
    bounds = [*(repr(float(b)) for b in h["buckets"]), "+Inf"]
    family.add_metric(labels, list(zip(bounds, cumulative)), h["sum"])


def _label_values(snapshot: dict) -> list[str]:
    return [snapshot["labels"][k] for k in LABELS]
