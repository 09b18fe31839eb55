"""Prometheus metrics of a deployment: vLLM's names with a `numaserve:` prefix, labelled by model, worker and
NUMA node.

Each worker's loop thread keeps a WorkerMetrics: it times each request from its submission (queue time, time
to first token, inter-token latency, end-to-end latency) and counts prompt and generation tokens and finished
requests by reason, from the engine's outputs; prefix-cache queries and hits, preemptions and each speculation
method's drafts and accepted tokens from each step's StepStats; running / waiting requests, KV usage and KV
blocks in use are gauges of the engine's stats. It records all of them with ray.util.metrics, for Ray's
per-node Prometheus export and dashboard (where Ray's rules make the names `ray_numaserve_...`), and keeps
exact copies that its stats carry: the router gathers those (Router.metrics) and http_api/prometheus.py's
`render` turns them, with the HTTP actor's request counts, into the Prometheus text the HTTP server answers at
GET /metrics.
"""

import bisect
import math
import time
from dataclasses import dataclass

import psutil
from ray.util import metrics as ray_metrics

from http_api.prometheus import (
    ALL,
    COUNTERS,
    DISK_STATS,
    DISK_TIER,
    ENGINE_COUNTERS,
    FINISH_REASONS,
    HISTOGRAMS,
    LABELS,
    METHOD,
    REASON,
    REQUEST_SUCCESS,
    SPEC_DECODE,
    STAGE,
    STEP_STAGE_SECONDS,
    WORKER_CPU,
    full_name,
)
from scheduling.outputs import RequestOutput, StepOutput
from scheduling.step_stats import STAGES

RAY_GAUGE_INTERVAL_S = 0.1  # Ray exports every few seconds: fresher gauges buy nothing


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
        self.stage_histograms = {stage: _Histogram(STEP_STAGE_SECONDS.buckets) for stage in STAGES}
        self.cpu_seconds = 0.0  # of the worker's processes, summed over reads (WORKER_CPU)
        self._cpu_read: dict[int, float] = {}  # pid -> its CPU seconds at the last read
        self._disk_seen: dict[str, float] = {}  # the disk tier's values at the last snapshot
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
        if stats.scheduled_ids:
            for stage in STAGES:
                seconds = getattr(stats.seconds, stage)
                self.stage_histograms[stage].observe(seconds)
                self._ray[STEP_STAGE_SECONDS.name].observe(seconds, self.labels | {STAGE: stage})
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

    def snapshot(self, engine, stats: dict | None = None) -> dict:
        """Exact values now, as plain data (it crosses to the router): the labels, then each metric's value;
        a histogram's is {"buckets": upper bounds, "counts": per bucket and +Inf, "sum": ...}. stats: the
        engine's stats() just taken by the caller (None: taken here)."""
        for req_id in [r for r in self.timings if r not in engine.scheduler.requests]:
            del self.timings[req_id]  # failed with the engine's step: they have no output
            self.unscheduled.discard(req_id)
        stats = engine.stats() if stats is None else stats
        gauges = _gauges(stats)
        self._record_gauges(gauges)
        self.read_cpu(stats["tensor_parallel"]["pids"])
        values = gauges | self.counters | {WORKER_CPU.name: self.cpu_seconds} | self._disk_tier(stats)
        return {"labels": dict(self.labels), "values": values, REQUEST_SUCCESS.name: dict(self.finished),
                "spec_decode": {method: dict(c) for method, c in self.spec_decode.items()},
                "histograms": {name: h.as_dict() for name, h in self.histograms.items()},
                "stage_histograms": {stage: h.as_dict() for stage, h in self.stage_histograms.items()}}

    def read_cpu(self, pids: list[int]) -> float:
        """Adds the CPU seconds the worker's processes (pids: its own, then its tensor-parallel ranks') spent
        since the last read -> the total (a rank that ended keeps what was counted of it)."""
        added = 0.0
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue  # ended
            seconds = times.user + times.system
            added += max(seconds - self._cpu_read.get(pid, 0.0), 0.0)
            self._cpu_read[pid] = seconds
        if added > 0:
            self.cpu_seconds += added
            self._ray[WORKER_CPU.name].inc(added, self.labels)
        return self.cpu_seconds

    def _disk_tier(self, stats: dict) -> dict[str, float]:
        """The disk tier's metrics from the engine's stats (0 where it is off), recorded with Ray too (its
        counters by what they grew since the last snapshot)."""
        values = {name: stats.get(field, 0) for name, field in DISK_STATS.items()}
        for m in DISK_TIER:
            if m.kind == "gauge":
                self._ray[m.name].set(values[m.name], self.labels)
            elif (grown := values[m.name] - self._disk_seen.get(m.name, 0)) > 0:
                self._ray[m.name].inc(grown, self.labels)
        self._disk_seen = values
        return values

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
                keys = (*LABELS, STAGE) if m is STEP_STAGE_SECONDS else LABELS
                _ray_cache[m.name] = ray_metrics.Histogram(name, m.help, boundaries=list(m.buckets),
                                                           tag_keys=keys)
    return _ray_cache
