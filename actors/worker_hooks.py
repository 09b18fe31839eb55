"""WorkerHooks: what a worker actor adds to its engine loop (scheduling/engine_loop.py), on the loop thread.

It compiles the kernels before the first request (a warm-up request), keeps the worker's metrics, hands each
step's outputs to the actor's event loop in one call, and reports StepTelemetry to the scheduler about every
telemetry_interval_s (with the speculator's SpecTelemetry), applying the Policy it answers: batch limits, the
speculation policy and the admission bound. Until the first answer the engine's own controller decides
speculation; while the scheduler is dead or restarting the last answer stays in force. A step that loses a
tensor-parallel rank ends the worker's process (Ray restarts it, callers resume its streams).
"""

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray

from actors.metrics import WorkerMetrics
from cluster_configs.cluster_config import WorkerPlacement
from cluster_configs.sampling_params import SamplingParams
from scheduling.loop_hooks import LoopHooks
from scheduling.loop_messages import RequestFailed
from scheduling.outputs import RequestOutput, StepOutput
from scheduling.policy import StepTelemetry

RANK_LOST_EXIT_CODE = 3
log = logging.getLogger("numaserve")
POLICY_TIMEOUT_S = 5.0  # a scheduler answer older than this is dropped (the scheduler may be restarting)


class WorkerHooks(LoopHooks):
    def __init__(self, placement: WorkerPlacement, metrics: WorkerMetrics, scheduler,
                 telemetry_interval_s: float, admission_bound: int | None):
        self.placement, self.metrics = placement, metrics
        self.scheduler, self.telemetry_interval_s = scheduler, telemetry_interval_s
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the actor's, known from its first call
        # admitted requests streaming here past which a new one is refused (Overloaded), whichever router
        # admitted it; from the scheduler's policy once it answers (the actor reads it). None: no bound
        self.admission_bound = admission_bound
        self._meter = _StepMeter()
        self._next_report = time.monotonic()
        self._report_sent: float | None = None  # when the unanswered telemetry report went out
        # why the last report went unanswered (the scheduler died or is restarting), None once one is
        # answered; set on the loop thread after every earlier answer was applied
        self.scheduler_error: str | None = None

    def started(self, engine) -> None:
        """Compile (or load from numba's cache) every kernel before the first request."""
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        engine.add_request(f"warm-up-{os.getpid()}", [engine.spec.bos_token_id or 0] * 3, params)
        while engine.has_unfinished():
            engine.step()

    def submitted(self, requests) -> None:
        for req in requests:
            self.metrics.submitted(req)

    def stepped(self, step: StepOutput, started_at: float) -> None:
        self._meter.add(step.stats.num_computed_tokens, step.stats.seconds.total)
        self.metrics.step(step, started_at)

    def ended(self, outputs: list[RequestOutput]) -> None:
        self.metrics.outputs(outputs)

    def failure(self, error: Exception) -> Exception:
        return RuntimeError(f"worker {self.placement.worker_id}: engine step failed: {error!r}")

    def fatal(self, error: Exception) -> None:
        """A tensor-parallel rank is gone, so this group cannot step again: the process ends, Ray restarts the
        worker with a new group (all its ranks: the followers left see rank 0 gone and stop), and callers
        resume its streams as for any lost worker (actors/request_stream.py): nothing is failed."""
        log.error("numaserve: worker %s lost a tensor-parallel rank (%s); restarting it",
                  self.placement.worker_id, error)
        os._exit(RANK_LOST_EXIT_CODE)

    def deliver(self, items: list[tuple]) -> None:
        if self.event_loop is not None:
            self.event_loop.call_soon_threadsafe(_put_all, items)

    def tick(self, engine, post: Callable[[Callable], None]) -> float | None:
        if self.scheduler is None:
            return None
        now = time.monotonic()
        if now >= self._next_report:
            self._next_report = now + self.telemetry_interval_s
            self._report(engine, post)
        return max(0.0, self._next_report - now)

    def _report(self, engine, post: Callable[[Callable], None]) -> None:
        """Send this interval's telemetry; the scheduler's answer is applied on the loop thread (post)."""
        if self._report_sent is not None and time.monotonic() - self._report_sent < POLICY_TIMEOUT_S:
            return  # one report in flight at a time
        stats = engine.stats()
        meter = self._meter
        telemetry = StepTelemetry(self.placement.worker_id, stats["num_running"], stats["num_waiting"],
                                  meter.num_steps, meter.num_tokens, meter.mean_step_s, stats["kv_usage"],
                                  stats["num_preemptions"], engine.speculation.telemetries())
        meter.reset()
        self._report_sent = time.monotonic()
        answer = self.scheduler.report.remote(telemetry).future()
        answer.add_done_callback(lambda f: post(lambda engine: self._apply(engine, f)))

    def _apply(self, engine, answer: Future) -> None:
        self._report_sent = None
        try:
            policy = answer.result()
        except ray.exceptions.RayError as error:
            self.scheduler_error = type(error).__name__
            return  # the scheduler died or is restarting: keep the policy in force
        self.scheduler_error = None
        engine.apply(policy)
        self.admission_bound = policy.admission_bound


class _StepMeter:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.num_steps, self.num_tokens, self.seconds = 0, 0, 0.0

    def add(self, num_tokens: int, seconds: float) -> None:
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.seconds += seconds

    @property
    def mean_step_s(self) -> float:
        return self.seconds / self.num_steps if self.num_steps else 0.0


def _put_all(items: list[tuple]) -> None:
    """On the actor's event loop: each (stream, output or failure) into its stream (a gone caller's stream
    takes it unread)."""
    for stream, item in items:
        stream.put(item.error if isinstance(item, RequestFailed) else item)
