"""StepLoop: the worker's thread that owns its Engine, the only thread that touches it after construction
(numba kernels must never run from two threads).

The actor's event loop talks to it through `inbox` (requests, aborts, stats queries, pause and resume, session
sequences' forks and frees, in) and `call_soon_threadsafe` (outputs and answers, out). A paused loop takes no
step (its requests stay as they are, as vLLM's pause in "keep" mode) but goes on taking requests, aborts and
stats queries, and ends requests whose deadline passes; tests pause a worker to hold requests in flight. It
also reports StepTelemetry to the scheduler (with the speculator's SpecTelemetry) and applies the Policy it
answers: batch limits and the speculation policy. Until the first answer the engine's own controller decides
speculation; while the scheduler is dead or restarting the last answer stays in force.
"""

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable

import numba
import psutil
import ray

from actors.messages import (
    Abort,
    Advance,
    ForkSequence,
    FreeSequences,
    InboxMessage,
    PolicyAnswer,
    Release,
    SequenceCall,
    SetPaused,
    StatsQuery,
    Submit,
)
from actors.metrics import WorkerMetrics
from actors.worker_adapters import HeldAdapters
from actors.worker_sequences import WorkerSequences
from cluster_configs.cluster_config import WorkerPlacement
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from kernels import resolve_num_threads
from scheduling.engine import Engine
from scheduling.outputs import RequestOutput
from scheduling.policy import StepTelemetry

IDLE_WAIT_S = 0.02  # how long an idle loop thread blocks on its inbox
POLICY_TIMEOUT_S = 5.0  # a scheduler answer older than this is dropped (the scheduler may be restarting)

Delivery = list[tuple[str, RequestOutput | Exception]]  # (request id, its output or failure)


class StepLoop:
    def __init__(self, engine: Engine, placement: WorkerPlacement, metrics: WorkerMetrics,
                 adapters: HeldAdapters, scheduler, telemetry_interval_s: float,
                 dispatch: Callable[[Delivery], None]):
        self.engine, self.placement, self.metrics, self.adapters = engine, placement, metrics, adapters
        self.scheduler, self.telemetry_interval_s = scheduler, telemetry_interval_s
        self.dispatch = dispatch  # runs on the event loop: hands outputs to their streams
        self.inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self.sequences = WorkerSequences(engine.sessions)
        self.event_loop: asyncio.AbstractEventLoop | None = None  # the actor's, known from its first call
        self.num_threads = 0
        # admitted requests streaming here past which a new one is refused (Overloaded), whichever router
        # admitted it; from the scheduler's policy once it answers (the actor reads it). None: no bound
        self.admission_bound: int | None = None
        self._failure: BaseException | None = None
        self._report_sent: float | None = None  # when the unanswered telemetry report went out
        self._paused = False
        self._advancing: tuple[int, asyncio.Future] | None = None  # paused: steps still to take, who waits

    def start(self) -> None:
        """Start the thread (it inherits this one's affinity and memory policy); returns once the kernels
        are compiled, raising what failed on the way."""
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), name=f"step-loop-{self.placement.worker_id}",
                         daemon=True).start()
        ready.wait()
        if self._failure is not None:
            raise self._failure

    def _run(self, ready: threading.Event) -> None:
        try:
            # thread-local: this loop thread runs the kernels
            numba.set_num_threads(resolve_num_threads(self.engine.config.num_threads, self.placement.cpu_ids))
            self.num_threads = numba.get_num_threads()
            self._warm_up()
        except BaseException as e:  # noqa: BLE001  (re-raised by start)
            self._failure = e
            return
        finally:
            ready.set()
        meter = _StepMeter()
        next_report = time.monotonic()
        while True:
            self._drain_inbox(block=not self._steps())
            if self._steps():
                self._step(meter)
                self._advanced()
            # a pause holds no one past a deadline
            elif self._paused and (expired := self.engine.abort_expired()):
                self.metrics.outputs(expired)
                self._deliver([(out.request_id, out) for out in expired])
            if self.scheduler is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + self.telemetry_interval_s
                self._report(meter)

    def _steps(self) -> bool:
        return self.engine.has_unfinished() and (not self._paused or self._advancing is not None)

    def _advanced(self, num_steps: int = 1) -> None:
        """Count steps taken while advancing a paused worker; answer once they are all taken (or none is
        left)."""
        if self._advancing is None:
            return
        left, answer = self._advancing[0] - num_steps, self._advancing[1]
        self._advancing = (left, answer)
        if left <= 0 or not self.engine.has_unfinished():
            self._advancing = None
            self._answer(answer, None)

    def _warm_up(self) -> None:
        """Compile (or load from numba's cache) every kernel before the first request."""
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        self.engine.add_request(f"warm-up-{os.getpid()}", [self.engine.spec.bos_token_id or 0] * 3, params)
        while self.engine.has_unfinished():
            self.engine.step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
            while True:
                self._handle(message)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, message: InboxMessage) -> None:
        match message:
            case Submit(req, weights, merged, sequence_id):
                if weights is not None:
                    self.adapters.hold(req.adapter_id, weights, merged)
                if sequence_id is not None:
                    self.sequences.attach(req, sequence_id)
                self.engine.submit(req)
                self.metrics.submitted(req)
            case Release(name):
                self.adapters.release(name)
            case Abort(request_id):
                out = self.engine.abort(request_id)
                if out is not None:
                    self.metrics.outputs([out])
                    self._deliver([(request_id, out)])
            case SetPaused(paused, answer):
                self._paused = paused
                self._answer(answer, None)
            case Advance(num_steps, answer):
                if not self._paused:
                    self._answer(answer, InvalidRequest("advance() moves a paused worker; pause it first"))
                else:
                    self._advancing = (num_steps, answer)
                    self._advanced(0)
            case StatsQuery(answer):
                self._answer(answer, self.engine.stats() | {
                    "worker_id": self.placement.worker_id, "rss_bytes": psutil.Process().memory_info().rss,
                    "metrics": self.metrics.snapshot(self.engine),
                    "decisions": self.engine.decisions.recent(), "paused": self._paused,
                    "num_session_sequences": len(self.sequences.by_id)})
            case SequenceCall(ForkSequence(sequence_id, fork_id), answer):
                self.sequences.fork(sequence_id, fork_id)
                self._answer(answer, None)
            case SequenceCall(FreeSequences(sequence_ids), answer):
                self.sequences.free(sequence_ids)
                self._answer(answer, None)
            case PolicyAnswer(answer):
                self._report_sent = None
                try:
                    policy = answer.result()
                    self.engine.apply(policy)
                    self.admission_bound = policy.admission_bound
                except ray.exceptions.RayError:
                    pass  # the scheduler died or is restarting: keep the policy in force

    def _step(self, meter: "_StepMeter") -> None:
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except Exception as e:  # noqa: BLE001  (a bug must fail its requests, not hang them)
            self._fail_all(e)
            return
        meter.add(step.stats.num_computed_tokens, step.stats.seconds.total)
        self.metrics.step(step, start)
        if step.outputs:
            self._deliver([(out.request_id, out) for out in step.outputs])

    def _deliver(self, items: Delivery) -> None:
        if self.event_loop is not None:
            self.event_loop.call_soon_threadsafe(self.dispatch, items)

    def _answer(self, answer: asyncio.Future, value) -> None:
        """Resolve an inbox message's future on the event loop (an Exception value: raised there)."""
        self.event_loop.call_soon_threadsafe(_resolve, answer, value)

    def _fail_all(self, error: Exception) -> None:
        request_ids = list(self.engine.scheduler.requests)
        for request_id in request_ids:
            self.engine.abort(request_id)
        failure = RuntimeError(f"worker {self.placement.worker_id}: engine step failed: {error!r}")
        self._deliver([(request_id, failure) for request_id in request_ids])

    def _report(self, meter: "_StepMeter") -> None:
        """Send this interval's telemetry; the scheduler's answer comes back through the inbox."""
        if self._report_sent is not None and time.monotonic() - self._report_sent < POLICY_TIMEOUT_S:
            return  # one report in flight at a time
        stats = self.engine.stats()
        telemetry = StepTelemetry(self.placement.worker_id, stats["num_running"], stats["num_waiting"],
                                  meter.num_steps, meter.num_tokens, meter.mean_step_s, stats["kv_usage"],
                                  stats["num_preemptions"], self.engine.speculation.telemetries())
        meter.reset()
        self._report_sent = time.monotonic()
        answer = self.scheduler.report.remote(telemetry).future()
        answer.add_done_callback(lambda f: self.inbox.put(PolicyAnswer(f)))


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


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        if isinstance(value, Exception):
            future.set_exception(value)
        else:
            future.set_result(value)
