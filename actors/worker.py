"""NumaWorker: one Engine pinned to one NUMA node's cores (a tensor-parallel one: rank 0 here, its follower
processes on the group's other nodes); the actor's async surface.

The actor's event loop serves submit/caller_stream/embed/abort/stats/info; the Engine lives on its engine
loop's thread (scheduling/engine_loop.py, with the worker's hooks: actors/worker_hooks.py), reached through
its messages. Callers submit requests straight to the worker (the router only placed them) and read the
deltas of all theirs here from one stream, caller_stream (actors/caller_channel.py: one Ray item per step
per caller, however many streams), and renew a lease on the worker while they have requests here: a caller
that stops (killed) has its requests aborted (actors/caller_lease.py). A request's adapter is fetched on the
event loop before the request is queued and held by the loop thread while it runs
(actors/worker_adapters.py).
"""

import asyncio
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import numpy as np
import psutil
import ray

from actors.caller_channel import CallerChannel
from actors.caller_lease import CHECK_INTERVAL_S, CallerGone, CallerLeases
from actors.channel_wire import encode
from actors.messages import EmbedRequest, ForkSequence, FreeSequences, GenerateRequest
from actors.metrics import WorkerMetrics
from actors.resume import resume_request
from actors.worker_adapters import AdapterFetcher, CachedMerged, HeldAdapters
from actors.worker_hooks import WorkerHooks
from actors.worker_requests import RecentIds, Running, settle
from actors.worker_sequences import WorkerSequences
from cluster_configs.cluster_config import WorkerPlacement
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest, Overloaded
from cluster_configs.sampling_params import SamplingParams
from memory import numa
from scheduling.embedding import pool
from scheduling.engine import Engine
from scheduling.engine_loop import EngineLoop
from scheduling.loop_messages import Submit
from scheduling.outputs import RequestOutput
from scheduling.request import Request

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
        held = HeldAdapters(CachedMerged(adapter_cache) if adapter_cache is not None else None)
        self.engine = Engine(Path(model_path), engine_config, fetch_adapter=held.get,
                             shared_merged=held.shared_merged, rank_cpu_ids=placement.rank_cpu_ids)
        numa.first_touch(*self.engine.kv_cache.arrays)
        self._adapters = AdapterFetcher(adapter_cache, engine_config)
        self._num_pinned, self._memory_policy = num_pinned, memory_policy
        self._stream_interval_s = stream_interval_s
        self._running: dict[str, Running] = {}  # request id -> its record, from submit to its last item
        self._channels: dict[str, CallerChannel] = {}  # caller id -> its channel (actors/caller_channel.py)
        self._admission_ids: dict[str, str] = {}  # request id -> its router's admission id, while it streams
        self._leases = CallerLeases()
        self._expired = RecentIds()  # requests aborted as their caller's lease lapsed (caller_stream says so)
        self._early_aborts = RecentIds()  # ids aborted before their submit came (the caller cancelled them)
        self._lease_check: asyncio.Task | None = None
        self._num_requests = 0  # submitted (the warm-up is not one)
        self._num_caller_batches = 0  # Ray items yielded by caller_stream, every caller's
        self.metrics = WorkerMetrics(model_name or Path(model_path).name, placement.worker_id,
                                     placement.node_id)
        self._held = held  # the loop thread's
        self._sequences = WorkerSequences(self.engine.sessions)  # the loop thread's
        self._hooks = WorkerHooks(placement, self.metrics, scheduler, telemetry_interval_s, admission_bound)
        self._loop = EngineLoop(self.engine, self._hooks, name=f"step-loop-{placement.worker_id}")

    async def submit(self, request: GenerateRequest) -> None:
        """Queue one attempt at a request of request.caller_id; returns once it is queued (Overloaded past
        this worker's admission bound, InvalidRequest for an id already running here). Its deltas come on
        the caller's channel (caller_stream). With request.resume, the prompt ends in the output a lost
        worker had streamed, and this one goes on. With request.sequence_id, a session sequence's turn
        (actors/worker_sequences.py)."""
        resume = request.resume

        def make(adapter: str | None) -> Request:
            params = left = request.params
            if resume is not None:
                num_output = len(request.prompt_token_ids) - resume.num_prompt_tokens
                left = params.model_copy(update={"max_tokens": params.max_tokens - num_output})
            req = self.engine.make_request(request.request_id, request.prompt_token_ids, left,
                                           adapter=adapter, cache_salt=request.cache_salt,
                                           remote_adapter=True)
            if resume is not None:
                resume_request(req, params, resume)
            return req

        if request.caller_id is None:
            raise InvalidRequest("a submitted request names its caller (caller_id): its deltas go to that "
                                 "caller's stream (caller_stream)")
        if self._early_aborts.pop(request.request_id):
            return  # cancelled by its caller before it came: nobody waits for it
        if resume is None:
            self._refuse_past_bound(request.admission_id)
        self._check_new(request.request_id)
        caller_id = request.caller_id
        channel = self._channel(caller_id)
        channel.opened(request.request_id)
        self._leases.add(caller_id, request.request_id, time.monotonic())
        self._check_leases()
        running = Running(request.request_id, request.admission_id, caller_id, request.adapter,
                          partial(channel.put, request.request_id), self._ended)
        try:
            await self._start(running, make, request.sequence_id)
        except BaseException:
            channel.forget(request.request_id)
            raise

    @ray.method(num_returns="streaming")
    async def caller_stream(self, caller_id: str, request_ids: tuple[str, ...] = (),
                            submitted: tuple[str, ...] = ()):
        """Every delta of caller_id's requests here, one batch (actors/caller_channel.Batch, as
        actors/channel_wire.py's bytes) per yield: the first delta of a request and its end at once, the rest
        at most every stream_interval_s. request_ids: those the caller waits for here; submitted: those of
        them whose submit has returned. The first batch marks CallerGone those aborted as its lease lapsed
        (while the caller's event loop stalled, say), and the submitted ones this worker neither runs nor
        holds an item of (it restarted since, or its lease lapsed as one ended, which dropped its last
        item): a caller never waits for a request nobody runs. Ends when the caller's lease lapses, or after
        a while with no request of its caller here (its next request opens a new channel: the caller calls
        again)."""
        channel = self._channel(caller_id)
        try:
            gone = [r for r in request_ids if self._expired.pop(r)]
            gone += [r for r in submitted if r not in gone and not self._runs_for(caller_id, r, channel)]
            if gone:
                self._num_caller_batches += 1
                yield encode([(r, CallerGone(r)) for r in gone])
            while (batch := await channel.take()) is not None:
                self._num_caller_batches += 1
                yield encode(batch)
                channel.hold(self._stream_interval_s)
        finally:
            if self._channels.get(caller_id) is channel and (channel.closed or channel.num_running == 0):
                del self._channels[caller_id]

    def _runs_for(self, caller_id: str, request_id: str, channel: CallerChannel) -> bool:
        """Whether request_id, submitted by caller_id, runs here or has an item in its channel."""
        running = self._running.get(request_id)
        return (running is not None and running.caller_id == caller_id) or request_id in channel.pending

    def _channel(self, caller_id: str) -> CallerChannel:
        """caller_id's channel here, opened if it has none."""
        channel = self._channels.get(caller_id)
        if channel is None:
            channel = self._channels[caller_id] = CallerChannel(self._bind())
        return channel

    async def renew_lease(self, caller_id: str) -> None:
        """The caller is alive: its requests here go on (actors/caller_lease.py)."""
        self._leases.renew(caller_id, time.monotonic())

    def _check_leases(self) -> None:
        """Start the task that aborts the requests of callers whose lease lapsed, unless it runs."""
        if self._lease_check is None or self._lease_check.done():
            self._lease_check = asyncio.get_running_loop().create_task(self._expire_leases())

    async def _expire_leases(self) -> None:
        while self._leases.request_ids:
            for caller_id, request_ids in self._leases.expire(time.monotonic()).items():
                for request_id in request_ids:
                    self._expired.add(request_id, time.monotonic())
                    self._abort(request_id)
                channel = self._channels.pop(caller_id, None)
                if channel is not None:
                    channel.close()
            await asyncio.sleep(CHECK_INTERVAL_S)

    def _refuse_past_bound(self, admission_id: str | None) -> None:
        """Overloaded if a newly admitted request would take this worker past its admission bound (another
        router may have filled it): its caller tries the router's next candidate. No await separates this
        check from _start counting the request, so the bound holds exactly. A resumed request, which lost
        its worker, is never refused."""
        bound = self._hooks.admission_bound
        if admission_id is not None and bound is not None and len(self._admission_ids) >= bound:
            raise Overloaded(f"worker {self.placement.worker_id}'s queue is full ({bound} requests "
                             "admitted); retry later, or raise max_queued_per_worker or add workers")

    def _check_new(self, request_id: str) -> None:
        if request_id in self._running:
            raise InvalidRequest(f"request id {request_id!r} is already running on this worker; "
                                 "use a unique id")

    async def embed(self, request: EmbedRequest) -> np.ndarray:
        """float32 [hidden]: the prompt's final hidden states pooled and L2-normalized
        (scheduling/embedding.py), computed in the engine's steps beside the streams."""
        made: list[Request] = []

        def make(adapter: str | None) -> Request:
            made.append(self.engine.make_request(request.request_id, request.prompt_token_ids,
                                                 SamplingParams(max_tokens=1), adapter=adapter, pooling=True,
                                                 remote_adapter=True))
            return made[0]

        self._refuse_past_bound(request.admission_id)
        self._check_new(request.request_id)
        done = asyncio.get_running_loop().create_future()
        running = Running(request.request_id, request.admission_id, None, request.adapter,
                          partial(settle, done), self._ended)
        try:
            await self._start(running, make)
            await done
        except asyncio.CancelledError:
            self._abort(request.request_id)
            raise
        return pool([np.concatenate(made[0].collected_rows)], request.pooling, normalize=True)[0]

    async def _start(self, running: "Running", make: Callable[[str | None], Request],
                     sequence_id: str | None = None) -> None:
        """Submit make(adapter)'s request once its adapter is here; its items go to running.put until one
        ends it, which lets go of what it held (_ended)."""
        self._bind()
        self._running[running.request_id] = running
        if running.admission_id is not None:
            self._admission_ids[running.request_id] = running.admission_id
        try:
            weights = merged = None
            if running.adapter is not None:
                weights, merged = await self._adapters.use(running.adapter)
                running.using_adapter = True
            if running.aborted:  # while its adapter was fetched
                running.put(RequestOutput(running.request_id, [], "", "abort"))
                return
            req = make(running.adapter)
            prepare = self._preparation(req, weights, merged, sequence_id)
            self._loop.send(Submit((req,), (running,), True, prepare))
            running.submitted = True
            self._num_requests += 1
        except BaseException:
            if not running.submitted:
                self._ended(running)
            raise

    def _ended(self, running: "Running") -> None:
        """A request's last item was put (or it never reached the engine): let go of what it held."""
        if self._running.get(running.request_id) is not running:
            return
        del self._running[running.request_id]
        self._admission_ids.pop(running.request_id, None)
        if running.caller_id is not None:
            self._leases.remove(running.caller_id, running.request_id)
        if running.using_adapter:
            self._adapters.done(running.adapter)
            if running.submitted:  # after its end: the loop holds the weights until then
                self._loop.post(lambda engine: self._held.release(running.adapter))

    def _abort(self, request_id: str) -> None:
        """End a request here (finish_reason "abort"), queued or still waiting for its adapter, or not yet
        submitted: Ray may run an abort before the submit its caller made first (submit then drops it)."""
        running = self._running.get(request_id)
        if running is None:
            self._early_aborts.add(request_id, time.monotonic())
        elif not running.submitted:
            running.aborted = True
        self._loop.abort(request_id)

    def _preparation(self, req: Request, weights, merged, sequence_id: str | None):
        """What the loop thread does just before it queues req: hold its adapter's weights (the adapter is
        served from now on; its weights come with requests), attach its session sequence."""

        def prepare(engine: Engine) -> None:
            if weights is not None:
                self._held.hold(req.adapter_id, weights, merged)  # released when the request ends
                if req.adapter_id not in engine.adapters:
                    engine.adapters.add_remote(req.adapter_id)
            if sequence_id is not None:
                self._sequences.attach(req, sequence_id)

        return prepare

    async def retire_adapters(self, adapter_ids: list[str]) -> None:
        """The adapter cache retired these ids (unloaded, or replaced by a new version): each is forgotten
        here once no request uses it (Engine.retire_adapters)."""
        self._loop.post(lambda engine: engine.retire_adapters(adapter_ids))

    async def admission_ids(self) -> set[str]:
        """The router's ids of the requests streaming from here now (the router releases the others)."""
        return set(self._admission_ids.values())

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    async def fork_sequence(self, call: ForkSequence) -> None:
        await self._ask(self._loop.call_future(
            lambda engine: self._sequences.fork(call.sequence_id, call.fork_id)))

    async def free_sequences(self, call: FreeSequences) -> None:
        await self._ask(self._loop.call_future(lambda engine: self._sequences.free(call.sequence_ids)))

    async def stats(self) -> dict:
        return await self._ask(self._loop.call_future(self._engine_stats)) | {
            "num_streams": len(self._running), "num_requests": self._num_requests,
            "num_caller_batches": self._num_caller_batches,
            "num_callers_expired": self._leases.num_expired}

    async def live(self) -> dict:
        """What the web console shows of this worker (Router.live), about once a second: the engine's stats
        and the CPU seconds of its processes, nothing costlier."""
        return await self._ask(self._loop.call_future(self._live))

    def _live(self, engine: Engine) -> dict:
        """On the loop thread."""
        stats = engine.stats()
        return stats | {"cpu_seconds": self.metrics.read_cpu(stats["tensor_parallel"]["pids"])}

    def _engine_stats(self, engine: Engine) -> dict:
        """On the loop thread."""
        stats = engine.stats()
        metrics = self.metrics.snapshot(engine, stats)
        return stats | {
            "worker_id": self.placement.worker_id, "rss_bytes": psutil.Process().memory_info().rss,
            "cpu_seconds": self.metrics.cpu_seconds, "metrics": metrics,
            "decisions": engine.decisions.recent(),
            "paused": self._loop.paused, "num_session_sequences": len(self._sequences.by_id),
            "scheduler_error": self._hooks.scheduler_error}

    async def pause(self) -> None:
        """Take no step until resume(): requests in flight stay where they are (none finishes, none is lost).
        Returns once the step loop has stopped: no step starts after it."""
        await self._ask(self._loop.set_paused(True))

    async def resume(self) -> None:
        await self._ask(self._loop.set_paused(False))

    async def advance(self, num_steps: int = 1) -> None:
        """Paused: take num_steps steps (fewer if the requests run out), then stay paused; returns after them.
        Tests move a paused worker by exact steps (a request's first token, and no more)."""
        await self._ask(self._loop.advance(num_steps))

    async def _ask(self, answer: Future):
        """The loop thread's answer to one message."""
        self._bind()
        return await asyncio.wait_for(asyncio.wrap_future(answer), STATS_TIMEOUT_S)

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
                "thread_cpu_ids": list(numa.thread_cpu_ids()), "num_threads": self._loop.num_threads,
                "num_pinned_threads": self._num_pinned, "memory_policy": self._memory_policy,
                "hostname": socket.gethostname(), "pid": os.getpid(),
                "ray_node_id": ray.get_runtime_context().get_node_id(),
                "engine_config": self.engine.config.model_dump()}

    def _bind(self) -> asyncio.AbstractEventLoop:
        """The actor's event loop, where the engine loop sends outputs."""
        self._hooks.event_loop = asyncio.get_running_loop()
        return self._hooks.event_loop
