"""NumaWorker: one Engine pinned to one NUMA node's cores.

Threads: the actor's event loop serves generate/abort/stats/info; one loop thread owns the Engine and is
the only thread that touches it after construction (numba kernels must never run from two threads).
They talk through `_inbox` (requests, aborts, stats queries, pause and resume, in) and `call_soon_threadsafe`
(outputs, out). A paused worker takes no step (its requests stay as they are, as vLLM's pause in "keep" mode)
but goes on taking requests, aborts and stats queries, and ends requests whose deadline passes; tests pause
one to hold requests in flight. The loop thread also reports StepTelemetry to the scheduler (with the
speculator's SpecTelemetry) and applies the Policy it answers: batch limits and the speculation policy. Until
the first answer the engine's own controller decides speculation; while the scheduler is dead or restarting
the last answer stays in force. Callers stream straight from `generate` (the router only placed the request).

Adapters come from the AdapterCache by name through the object store, awaited on the event loop before the
request is queued (with a merged copy another worker shared, if there is one): a cold adapter costs its own
request only, the others on this worker keep their pace. The loop thread holds each adapter's weights while a
request of it is queued or running, so the engine, which keeps at most max_loras of them loaded, takes them
back from there when a step needs them: nothing in this process blocks on Ray.
"""

import asyncio
import os
import queue
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numba
import numpy as np
import psutil
import ray

from actors.adapter_cache import fetch_adapter_ref, fetch_merged_ref
from actors.delta_stream import DeltaStream, merge
from actors.messages import (
    Abort,
    Advance,
    EmbedRequest,
    GenerateRequest,
    InboxMessage,
    PolicyAnswer,
    Release,
    SetPaused,
    StatsQuery,
    Submit,
)
from actors.metrics import WorkerMetrics
from actors.resume import resume_request
from cluster_configs.cluster_config import WorkerPlacement
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest, Overloaded
from cluster_configs.sampling_params import SamplingParams
from kernels import resolve_num_threads
from memory import numa
from models.lora import LoraAdapter
from models.lora_merge import MergedWeights
from scheduling.embedding import pool
from scheduling.engine import Engine
from scheduling.outputs import RequestOutput
from scheduling.policy import StepTelemetry
from scheduling.request import Request

IDLE_WAIT_S = 0.02  # how long an idle loop thread blocks on its inbox
POLICY_TIMEOUT_S = 5.0  # a scheduler answer older than this is dropped (the scheduler may be restarting)
STATS_TIMEOUT_S = 30.0


@ray.remote(num_cpus=0)
class NumaWorker:
    def __init__(self, placement: WorkerPlacement, model_path: str, engine_config: EngineConfig,
                 scheduler=None, adapter_cache=None, telemetry_interval_s: float = 0.1,
                 stream_interval_s: float = 0.0, model_name: str | None = None,
                 admission_bound: int | None = None):
        self.placement = placement
        num_pinned = numa.pin_process(placement.cpu_ids)  # before the engine exists: numba has no pool yet
        memory_policy = numa.bind_memory(numa.physical_node_ids(placement.cpu_ids, numa.read_topology()))
        self._scheduler, self._adapter_cache = scheduler, adapter_cache
        self._shared_merged = CachedMerged(adapter_cache) if adapter_cache is not None else None
        self.engine = Engine(Path(model_path), engine_config, fetch_adapter=self._held_adapter,
                             shared_merged=self._shared_merged)
        numa.first_touch(*self.engine.kv_cache.arrays)
        self._num_pinned, self._memory_policy = num_pinned, memory_policy
        self._telemetry_interval_s, self._stream_interval_s = telemetry_interval_s, stream_interval_s
        self._inbox: queue.SimpleQueue[InboxMessage] = queue.SimpleQueue()
        self._streams: dict[str, DeltaStream] = {}
        self._admission_ids: dict[str, str] = {}  # request id -> its router's admission id, while it streams
        # admitted requests streaming here past which a new one is refused (Overloaded), whichever router
        # admitted it; from the scheduler's policy once it answers. None: no bound of its own
        self._admission_bound = admission_bound
        # event loop: the adapters its requests in flight use, fetched once -> (weights, number of requests)
        self._adapters_in_use: dict[str, tuple[LoraAdapter, int]] = {}
        # loop thread: the adapters of the engine's requests -> (weights, number of requests)
        self._held: dict[str, tuple[LoraAdapter, int]] = {}
        # the actor's event loop, known from the first call
        self._loop: asyncio.AbstractEventLoop | None = None
        self._report_sent: float | None = None  # when the unanswered telemetry report went out
        self._num_threads = 0
        self._num_requests = 0  # served through generate (the warm-up is not one)
        self.metrics = WorkerMetrics(model_name or Path(model_path).name, placement.worker_id,
                                     placement.node_id)
        self._failure: BaseException | None = None
        self._paused = False  # read and written by the loop thread only
        # paused: steps still to take, who waits for them
        self._advancing: tuple[int, asyncio.Future] | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,),
                                        name=f"step-loop-{placement.worker_id}", daemon=True)
        self._thread.start()  # inherits this thread's affinity and memory policy
        ready.wait()
        if self._failure is not None:
            raise self._failure

    # ---- the actor's methods (event loop thread) -----------------------------------------------------

    @ray.method(num_returns="streaming")
    async def generate(self, request: GenerateRequest):
        """Deltas of one request: one RequestOutput per yield, holding every token ready since the last. The
        first comes as soon as it is ready, the next ones at most every stream_interval_s (and the last at
        once). With request.resume, the prompt ends in the output a lost worker had streamed, and this one
        goes on."""
        resume = request.resume

        def make(adapter: str | None) -> Request:
            params = left = request.params
            if resume is not None:
                num_output = len(request.prompt_token_ids) - resume.num_prompt_tokens
                left = params.model_copy(update={"max_tokens": params.max_tokens - num_output})
            req = self.engine.make_request(request.request_id, request.prompt_token_ids, left,
                                           adapter=adapter, cache_salt=request.cache_salt)
            if resume is not None:
                resume_request(req, params, resume)
            return req

        if resume is None:
            self._refuse_past_bound(request.admission_id)
        async for chunk, _ in self._serve(request.request_id, request.admission_id, request.adapter, make):
            yield chunk

    def _refuse_past_bound(self, admission_id: str | None) -> None:
        """Overloaded if a newly admitted request would take this worker past its admission bound (another
        router may have filled it): its caller tries the router's next candidate. No await separates this
        check from _serve counting the request, so the bound holds exactly. A resumed request, which lost its
        worker, is never refused."""
        bound = self._admission_bound
        if admission_id is not None and bound is not None and len(self._admission_ids) >= bound:
            raise Overloaded(f"worker {self.placement.worker_id}'s queue is full ({bound} requests "
                             "admitted); retry later, or raise max_queued_per_worker or add workers")

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        """float32 [hidden]: the prompt's final hidden states pooled and L2-normalized
        (scheduling/embedding.py), computed in the engine's steps beside the streams."""

        def make(adapter: str | None) -> Request:
            return self.engine.make_request(request.request_id, request.prompt_token_ids,
                                            SamplingParams(max_tokens=1), adapter=adapter, pooling=True)

        self._refuse_past_bound(request.admission_id)
        async for _, req in self._serve(request.request_id, request.admission_id, request.adapter, make):
            pass
        return pool([np.concatenate(req.collected_rows)], request.pooling, normalize=True)[0]

    async def _serve(self, request_id: str, admission_id: str | None, adapter: str | None,
                   make: Callable[[str | None], Request]) -> AsyncIterator[tuple[RequestOutput, Request]]:
        """Submit make(adapter)'s request once its adapter is here, and yield its merged deltas (with it)
        until it finishes; a caller that goes away (or is cancelled) aborts it."""
        self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already running on this worker; "
                                 "use a unique id")
        stream = DeltaStream(self._loop)
        self._streams[request_id] = stream
        if admission_id is not None:
            self._admission_ids[request_id] = admission_id
        finished, submitted, using_adapter = False, False, False
        try:
            weights = merged = None
            if adapter is not None:
                weights, merged = await self._use_adapter(adapter)
                using_adapter = True
                if adapter not in self.engine.adapters:
                    self.engine.adapters.add_remote(adapter)  # served from now on; weights come with requests
            req = make(adapter)
            self._inbox.put(Submit(req, weights, merged))
            submitted = True
            self._num_requests += 1
            while not finished:
                items = await stream.take()
                failure = next((i for i in items if isinstance(i, Exception)), None)
                if failure is not None:
                    raise failure
                chunk = merge(request_id, items)
                finished = chunk.finished
                yield chunk, req
                stream.hold(self._stream_interval_s)
        finally:
            del self._streams[request_id]
            self._admission_ids.pop(request_id, None)
            if submitted and not finished:  # the caller went away or was cancelled
                self._inbox.put(Abort(request_id))
            if using_adapter:
                self._done_with_adapter(adapter, submitted)

    async def _use_adapter(self, name: str) -> tuple[LoraAdapter, MergedWeights | None]:
        """The adapter's weights (and a merged copy another worker shared) for one more request, fetched
        from the AdapterCache unless a request in flight here already uses them."""
        in_use = self._adapters_in_use.get(name)
        if in_use is not None:
            self._adapters_in_use[name] = (in_use[0], in_use[1] + 1)
            return in_use[0], None
        ref = await fetch_adapter_ref(self._adapter_cache, name) if self._adapter_cache is not None else None
        if ref is None:
            raise InvalidRequest(f"unknown adapter {name!r}: register it first with "
                                 "client.register_adapter(name, path)")
        weights = await ref
        merged = None
        if self.engine.config.lora_merge != "never" and self.engine.config.lora_merged_bytes > 0:
            merged_ref = await fetch_merged_ref(self._adapter_cache, name)
            merged = None if merged_ref is None else await merged_ref
        in_use = self._adapters_in_use.get(name)  # another request may have fetched it meanwhile
        self._adapters_in_use[name] = (weights, 1 + (in_use[1] if in_use else 0))
        return weights, merged

    def _done_with_adapter(self, name: str, submitted: bool) -> None:
        weights, num_requests = self._adapters_in_use.pop(name, (None, 0))
        if num_requests > 1:
            self._adapters_in_use[name] = (weights, num_requests - 1)
        if submitted:
            self._inbox.put(Release(name))  # after its Abort, if any: the loop thread holds it until then

    def _held_adapter(self, name: str) -> LoraAdapter:
        """The engine's adapter source (loop thread): the weights a queued or running request brought."""
        held = self._held.get(name)
        if held is None:
            raise InvalidRequest(f"adapter {name!r} is used by no request on this worker")
        return held[0]

    async def admission_ids(self) -> set[str]:
        """The router's ids of the requests streaming from here now (the router releases the others)."""
        return set(self._admission_ids.values())

    async def abort(self, request_id: str) -> None:
        self._inbox.put(Abort(request_id))

    async def stats(self) -> dict:
        return await self._ask(StatsQuery)

    async def pause(self) -> None:
        """Take no step until resume(): requests in flight stay where they are (none finishes, none is lost).
        Returns once the step loop has stopped: no step starts after it."""
        await self._ask(SetPaused, True)

    async def resume(self) -> None:
        await self._ask(SetPaused, False)

    async def advance(self, num_steps: int = 1) -> None:
        """Paused: take num_steps steps (fewer if the requests run out), then stay paused; returns after them.
        Tests move a paused worker by exact steps (a request's first token, and no more)."""
        await self._ask(Advance, num_steps)

    async def _ask(self, message: type, *values):
        """The loop thread's answer to one inbox message, message(*values, answer)."""
        self._loop = asyncio.get_running_loop()
        answer = self._loop.create_future()
        self._inbox.put(message(*values, answer))
        return await asyncio.wait_for(answer, STATS_TIMEOUT_S)

    async def model_info(self) -> dict:
        """What callers need to validate and tokenize: the tokenizer (or None), the vocabulary size and
        max_model_len."""
        return {"tokenizer": self.engine.tokenizer, "vocab_size": self.engine.spec.vocab_size,
                "block_size": self.engine.config.block_size, "max_model_len": self.engine.max_model_len}

    async def info(self) -> dict:
        """Where this worker runs and what it did to get there: cores, threads, memory policy."""
        p = self.placement
        return {"worker_id": p.worker_id, "machine": p.machine, "numa_node": p.node_id,
                "cpu_ids": list(p.cpu_ids),
                "thread_cpu_ids": list(numa.thread_cpu_ids()), "num_threads": self._num_threads,
                "num_pinned_threads": self._num_pinned, "memory_policy": self._memory_policy,
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "ray_node_id": ray.get_runtime_context().get_node_id(),
                "engine_config": self.engine.config.model_dump()}

    def _dispatch(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:  # None: the caller has gone
                stream.put(item)

    # ---- the loop thread -------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            # thread-local: this loop thread runs the kernels
            numba.set_num_threads(resolve_num_threads(self.engine.config.num_threads, self.placement.cpu_ids))
            self._num_threads = numba.get_num_threads()
            self._warm_up()
        except BaseException as e:  # noqa: BLE001  (re-raised by __init__)
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
            if self._scheduler is not None and time.monotonic() >= next_report:
                next_report = time.monotonic() + self._telemetry_interval_s
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
            self._loop.call_soon_threadsafe(_set_result, answer, None)

    def _warm_up(self) -> None:
        """Compile (or load from numba's cache) every kernel before the first request."""
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        self.engine.add_request(f"warm-up-{os.getpid()}", [self.engine.spec.bos_token_id or 0] * 3, params)
        while self.engine.has_unfinished():
            self.engine.step()

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
            while True:
                self._handle(message)
                message = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, message: InboxMessage) -> None:
        match message:
            case Submit(req, weights, merged):
                if weights is not None:
                    held = self._held.get(req.adapter_id)
                    self._held[req.adapter_id] = (weights, 1 + (held[1] if held else 0))
                    if merged is not None and self._shared_merged is not None:
                        self._shared_merged.offer(merged)
                self.engine.submit(req)
                self.metrics.submitted(req)
            case Release(name):
                weights, num_requests = self._held.pop(name)
                if num_requests > 1:
                    self._held[name] = (weights, num_requests - 1)
                elif self._shared_merged is not None:
                    self._shared_merged.offered.pop(name, None)  # not taken: the engine did not merge it
            case Abort(request_id):
                out = self.engine.abort(request_id)
                if out is not None:
                    self.metrics.outputs([out])
                    self._deliver([(request_id, out)])
            case SetPaused(paused, answer):
                self._paused = paused
                self._loop.call_soon_threadsafe(_set_result, answer, None)
            case Advance(num_steps, answer):
                if not self._paused:
                    error = InvalidRequest("advance() moves a paused worker; pause it first")
                    self._loop.call_soon_threadsafe(_set_exception, answer, error)
                else:
                    self._advancing = (num_steps, answer)
                    self._advanced(0)
            case StatsQuery(answer):
                stats = self.engine.stats() | {"worker_id": self.placement.worker_id,
                                               "num_streams": len(self._streams),
                                               "num_requests": self._num_requests,
                                               "rss_bytes": psutil.Process().memory_info().rss,
                                               "metrics": self.metrics.snapshot(self.engine),
                                               "decisions": self.engine.decisions.recent(),
                                               "paused": self._paused}
                self._loop.call_soon_threadsafe(_set_result, answer, stats)
            case PolicyAnswer(answer):
                self._report_sent = None
                try:
                    policy = answer.result()
                    self.engine.apply(policy)
                    self._admission_bound = policy.admission_bound
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

    def _deliver(self, items: list[tuple[str, RequestOutput | Exception]]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, items)

    def _fail_all(self, error: Exception) -> None:
        request_ids = list(self.engine.requests)
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
        answer = self._scheduler.report.remote(telemetry).future()
        answer.add_done_callback(lambda f: self._inbox.put(PolicyAnswer(f)))


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


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


class CachedMerged:
    """The engine's SharedMerged (scheduling/lora_planner.py) in a deployment: a merged copy another worker
    shared comes with the request that needs it (fetched on the event loop, offered here by the loop thread);
    a copy built here goes to the AdapterCache for the others. Nothing waits on Ray."""

    def __init__(self, adapter_cache):
        self.adapter_cache = adapter_cache
        self.offered: dict[str, MergedWeights] = {}  # adapter -> a shared copy not yet taken

    def offer(self, merged: MergedWeights) -> None:
        self.offered[merged.name] = merged

    def get(self, name: str) -> MergedWeights | None:
        merged = self.offered.pop(name, None)
        return None if merged is None else merged.local_copy()

    def put(self, merged: MergedWeights) -> None:
        self.adapter_cache.put_merged.remote(merged.name, [ray.put(merged)], merged.nbytes)  # not waited for
