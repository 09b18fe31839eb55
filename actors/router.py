"""Router: places requests, never relays them. A caller (ns.Client, an HTTP actor) tokenizes and validates in
its own process, asks `admit` for an Admission (which worker, by RoutingPolicy: scheduling/routing.py),
streams straight from that worker, and calls `finish` when the request ends; if the worker is lost it asks
`reroute` for another and resumes there (actors/request_stream.py). So the router handles two calls per
request (three if its worker was lost), whatever its length, and its death loses no stream in flight: Ray
restarts it, and callers retry their admissions meanwhile. A worker reported lost is probed until it
answers again (Ray restarts it), then rejoins.
"""

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from actors.messages import Admission, Placement
from actors.ray_errors import WORKER_LOST
from cluster_configs.cluster_config import ClusterConfig
from cluster_configs.errors import InvalidRequest, Overloaded, Unavailable
from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import prefix_cache_key
from scheduling.policy import admission_bound
from scheduling.routing import RoutingPolicy

PROBE_INTERVAL_S = 0.5
SWEEP_INTERVAL_S = 5.0
STATS_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0
# a worker pauses (or resumes) when its step in flight ends, and answers within its own bound for that
# (actors/worker.py's STATS_TIMEOUT_S): waited for past it, so pause means every live worker
PAUSE_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
class Router:
    def __init__(self, config: ClusterConfig, workers: dict, scheduler, adapter_cache):
        # small arguments only: Ray restarts the actor from them, after the deploying driver may have exited
        # tokenizer, vocab_size, max_model_len: a worker's, fetched on first use
        self.model: dict | None = None
        # None: the model's own, checked by the worker's engine
        self.max_model_len = config.engine.max_model_len
        self.workers = workers  # worker id -> NumaWorker handle
        self.scheduler, self.adapter_cache = scheduler, adapter_cache
        bound = admission_bound(config.engine.max_num_seqs, config.max_queued_per_worker)
        self.routing = RoutingPolicy(list(workers), config.engine.block_size, bound)
        self.poll_interval_s = config.telemetry_interval_s
        self.sweep_grace_s = config.router.sweep_grace_s
        self.num_overloaded = 0
        # worker id -> where it runs, for the live view (the workers' info() says more, at a Ray call each);
        # none known from a config whose topology is unresolved (a router built alone, as in tests)
        self.placements = {} if config.has_auto_topology else {
            p.worker_id: {"machine": p.machine, "numa_node": p.node_id, "cpu_ids": list(p.cpu_ids)}
            for p in config.placements()}
        self._probing: set[str] = set()
        self._background: asyncio.Task | None = None

    async def ping(self) -> bool:
        """Ready: the background tasks run and the model's tokenizer is here for callers."""
        self._start_background()
        await self.model_info()
        return True

    async def admit(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                    session: str | None = None, cache_salt: str | None = None,
                    pinned: str | None = None) -> Admission:
        """Place a request the caller validated (scheduling/validation.py) on a worker; Overloaded if none
        admits it. cache_salt: requests share cached prefix blocks only with the same salt (the HTTP server
        gives each tenant its own). pinned: a client session's worker, taken while it is alive."""
        self._start_background()
        if session is not None and not isinstance(session, str):
            raise InvalidRequest(f"session must be a str, got {type(session).__name__}")
        request_id = uuid.uuid4().hex
        try:
            worker_id = self.routing.route(request_id, prompt_token_ids, params.max_tokens, session=session,
                                           extra=prefix_cache_key(adapter, cache_salt), adapter=adapter,
                                           pinned=pinned)
        except Overloaded:
            self.num_overloaded += 1
            raise
        fallbacks = tuple(Placement(w, self.workers[w]) for w in self.routing.fallbacks(worker_id, session))
        return Admission(request_id, Placement(worker_id, self.workers[worker_id]), prompt_token_ids, params,
                         adapter, cache_salt, fallbacks)

    async def reroute(self, request_id: str, lost_worker_id: str | None,
                      num_tokens_left: int) -> Placement | None:
        """The request's worker was lost (lost_worker_id: reported now; None: asked again): a live worker for
        it (bound or not, the restarted one too), None while none is up."""
        self._start_background()
        if lost_worker_id is not None:
            self._worker_lost(lost_worker_id)
        worker_id = self.routing.reroute(request_id, num_tokens_left)
        return None if worker_id is None else Placement(worker_id, self.workers[worker_id])

    async def finish(self, request_id: str) -> None:
        """The request ended (finished, aborted or failed) on its caller's side."""
        self.routing.finish(request_id)

    async def model_info(self) -> dict:
        """What a caller needs to tokenize and validate requests: the tokenizer (or None), the vocabulary size
        and max_model_len (a live worker's, asked once)."""
        if self.model is None:
            for worker_id, handle in self.workers.items():
                if self.routing.workers[worker_id].alive:
                    try:
                        info = await handle.model_info.remote()
                    except WORKER_LOST:
                        continue
                    self.max_model_len = self.max_model_len or info.get("max_model_len")
                    self.model = {"tokenizer": info["tokenizer"], "vocab_size": info["vocab_size"],
                                  "max_model_len": self.max_model_len}
                    break
            else:
                raise Unavailable(f"no worker is available (all {len(self.workers)} are down or restarting); "
                                  "retry in a few seconds")
        return self.model

    async def num_serving_workers(self, timeout_s: float = HEALTH_TIMEOUT_S) -> int:
        """How many workers answer within timeout_s (a restarting one does not)."""
        answers, _ = await self._ask_live_workers(lambda handle: handle.info.remote(), timeout_s)
        return len(answers)

    async def metrics(self) -> list[dict]:
        """Each live worker's metrics snapshot (actors/metrics.py); a worker that does not answer in time is
        left out."""
        answers, _ = await self._ask_live_workers(lambda handle: handle.stats.remote())
        return [stats["metrics"] for stats in answers.values()]

    async def live(self) -> dict:
        """The web console's view, asked about once a second: per worker its placement and its engine's
        figures now (NumaWorker.live); the lean part of stats(), without the workers' info, the policies,
        the metrics or the decisions."""
        self._start_background()
        gathered = time.time()
        answers, errors = await self._ask_live_workers(lambda handle: handle.live.remote())
        workers = {}
        for worker_id, load in self.routing.workers.items():
            answer = answers.get(worker_id, {})
            if worker_id in errors:
                answer = {"error": f"no answer ({type(errors[worker_id]).__name__})"}
            workers[worker_id] = {"alive": load.alive, "info": self.placements.get(worker_id, {})} | answer
        return {"time": gathered, "workers": workers, "routed": dict(self.routing.num_routed)}

    async def pause(self, paused: bool, worker_ids: list[str] | None = None) -> list[str]:
        """Pause (or resume) the live workers among worker_ids (None: all), each waited for until its step in
        flight has ended (at most PAUSE_TIMEOUT_S); the ids that answered. A worker marked down is not waited
        for: it comes back from its restart unpaused."""
        ids = list(self.workers) if worker_ids is None else worker_ids
        unknown = set(ids) - set(self.workers)
        if unknown:
            raise InvalidRequest(f"no worker {sorted(unknown)} in this deployment; its workers: "
                                 f"{sorted(self.workers)}")

        answers, _ = await self._ask_live_workers(
            lambda handle: handle.pause.remote() if paused else handle.resume.remote(), PAUSE_TIMEOUT_S, ids)
        return list(answers)

    # ---- worker health and policy ------------------------------------------------------------------

    async def _ask_live_workers(self, call: Callable[[Any], Awaitable], timeout_s: float = STATS_TIMEOUT_S,
                                worker_ids: list[str] | None = None
                                ) -> tuple[dict[str, Any], dict[str, Exception]]:
        """call(handle) (an awaitable) on every live worker among worker_ids (None: all) at once, each given
        timeout_s -> (worker id -> answer, worker id -> the TimeoutError or RayError it failed with), in
        worker_ids' order. Workers marked down are in neither: a restarting one is not waited for. A worker
        whose actor is dead or restarting (RayActorError) is marked down here, as a caller's reroute would:
        a worker no stream reported lost (its machine gone while it streamed nothing) is not left "alive"."""
        live = [w for w in (self.workers if worker_ids is None else worker_ids)
                if self.routing.workers[w].alive]

        async def ask(worker_id: str):
            try:
                return True, await asyncio.wait_for(call(self.workers[worker_id]), timeout_s)
            except (TimeoutError, ray.exceptions.RayError) as e:
                return False, e

        answers, errors = {}, {}
        for worker_id, (ok, value) in zip(live, await asyncio.gather(*map(ask, live))):
            (answers if ok else errors)[worker_id] = value
            if isinstance(value, ray.exceptions.RayActorError):
                self._worker_lost(worker_id)
        return answers, errors

    def _worker_lost(self, worker_id: str) -> None:
        self.routing.mark_down(worker_id)
        if worker_id not in self._probing:
            self._probing.add(worker_id)
            asyncio.get_running_loop().create_task(self._probe_until_up(worker_id))

    async def _probe_until_up(self, worker_id: str) -> None:
        """A call to a restarting actor waits for its restart (or fails); when one answers, the worker
        rejoins."""
        try:
            while True:
                try:
                    await self.workers[worker_id].info.remote()
                    self.routing.mark_up(worker_id)
                    return
                except WORKER_LOST:
                    await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            self._probing.discard(worker_id)

    def _start_background(self) -> None:
        if self._background is None:
            loop = asyncio.get_running_loop()
            self._background = asyncio.gather(loop.create_task(self._poll_policies()),
                                              loop.create_task(self._sweep()))

    async def _sweep(self) -> None:
        """Release what callers that went away without finish left placed (RouterConfig.sweep_grace_s)."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            answers, _ = await self._ask_live_workers(lambda handle: handle.admission_ids.remote())
            for worker_id, admission_ids in answers.items():
                self.routing.sweep(worker_id, admission_ids, self.sweep_grace_s)

    async def _poll_policies(self) -> None:
        while True:
            try:
                for worker_id, policy in (await self.scheduler.policies.remote()).items():
                    self.routing.set_admission_bound(worker_id, policy.admission_bound)
            except ray.exceptions.RayError:
                pass  # the scheduler is restarting: keep the bounds in force
            await asyncio.sleep(self.poll_interval_s)

    async def stats(self) -> dict:
        """Per worker: the router's view (alive, outstanding), the engine's stats, and its placement info;
        "calls": the admit / finish / reroute calls this router handled; "decisions": per worker, its
        engine's recent decisions and why (cluster_configs/diagnostics.py)."""
        self._start_background()

        answers, errors = await self._ask_live_workers(
            lambda handle: asyncio.gather(handle.stats.remote(), handle.info.remote()))
        workers = {}
        for worker_id, load in self.routing.workers.items():
            if worker_id in answers:
                stats, info = answers[worker_id]
                answer = stats | {"info": info}
            elif worker_id in errors:
                answer = {"error": repr(errors[worker_id])}
            else:
                answer = {}  # restarting, or its machine is gone: the probe will tell when it is back
            workers[worker_id] = {"alive": load.alive, "num_outstanding_requests": load.num_requests,
                                  "num_outstanding_tokens": load.num_tokens,
                                  "admission_bound": load.admission_bound} | answer
        try:
            policies = await asyncio.wait_for(self.scheduler.stats.remote(), STATS_TIMEOUT_S)
        except (TimeoutError, ray.exceptions.RayError) as e:
            policies = {"error": repr(e)}  # the scheduler is dead or restarting; the workers serve on
        # each worker's decision log (scheduling/engine.py), kept out of its figures: it is the long part
        decisions = {worker_id: w.pop("decisions", []) for worker_id, w in workers.items()}
        return {"workers": workers, "routed": dict(self.routing.num_routed),
                "calls": dict(self.routing.num_calls), "num_swept": self.routing.num_swept,
                "num_overloaded": self.num_overloaded,
                "router_pid": os.getpid(), "policies": policies, "decisions": decisions}
