"""Router: validates and tokenizes, routes with RoutingPolicy (scheduling/routing.py), streams results back.

A request whose worker dies mid-stream is re-submitted to a live worker as prompt + the tokens generated
so far, with a Resume record (replayed from those tokens) that lets the new worker go on exactly where
the old one was: the client sees one uninterrupted stream, identical to an undisturbed one. A worker
marked down is probed until it answers again (Ray restarts it), then rejoins.

The stream this actor yields: first the prompt's token ids (once admitted), then RequestOutputs.
"""

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError

from actors.adapter_cache import lookup_adapter
from actors.resume import resume_state
from cluster_configs.cluster_config import ClusterConfig
from cluster_configs.errors import InvalidRequest, NumaserveError, Overloaded, Unavailable
from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import prefix_cache_key
from models.tokenizer import Tokenizer
from scheduling.outputs import RequestOutput
from scheduling.policy import admission_bound
from scheduling.routing import RoutingPolicy
from scheduling.validation import RequestLimits, validate_request

WORKER_LOST = (RayActorError, ObjectLostError, NodeDiedError)  # the worker, not the request, failed
REROUTE_WAIT_S = 120.0  # how long a request that lost its worker waits for any live worker
PROBE_INTERVAL_S = 0.5
STATS_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0


def _deadline_left(params: SamplingParams, arrival: float) -> SamplingParams | None:
    """params with deadline_s cut to what is left since arrival at the router (None in it: nothing is left);
    None when the request has no deadline."""
    if params.deadline_s is None:
        return None
    left = params.deadline_s - (asyncio.get_running_loop().time() - arrival)
    return params.model_copy(update={"deadline_s": left if left > 0 else None})


class WorkerStreamEnded(Exception):
    """A worker's stream stopped before its request finished: treated as the worker's loss."""


@ray.remote(num_cpus=0)
class Router:
    def __init__(self, config: ClusterConfig, workers: dict, scheduler, adapter_cache):
        # small arguments only: Ray restarts the actor from them, after the deploying driver may have exited
        # a worker's, fetched on first use (see NumaWorker.model_info)
        self.tokenizer: Tokenizer | None = None
        # what requests are validated against here, with the tokenizer
        self.limits: RequestLimits | None = None
        # None: the model's own, checked by the worker's engine
        self.max_model_len = config.engine.max_model_len
        self.workers = workers  # worker id -> NumaWorker handle
        self.scheduler, self.adapter_cache = scheduler, adapter_cache
        bound = admission_bound(config.engine.max_num_seqs, config.max_queued_per_worker)
        self.routing = RoutingPolicy(list(workers), config.engine.block_size, bound)
        self.poll_interval_s = config.telemetry_interval_s
        self.num_overloaded = 0
        self._probing: set[str] = set()
        self._background: asyncio.Task | None = None

    async def ping(self) -> bool:
        """Ready: the background tasks run and the tokenizer is here."""
        self._start_background()
        await self._fetch_model_info()
        return True

    async def _fetch_model_info(self) -> None:
        if self.limits is not None:
            return
        for worker_id, handle in self.workers.items():
            if self.routing.workers[worker_id].alive:
                try:
                    info = await handle.model_info.remote()
                except WORKER_LOST:
                    continue
                self.tokenizer = info["tokenizer"]
                self.max_model_len = self.max_model_len or info.get("max_model_len")
                self.limits = RequestLimits(info["vocab_size"], self.max_model_len)
                return
        raise Unavailable(f"no worker is available (all {len(self.workers)} are down or restarting); retry "
                          "in a few seconds")

    @ray.method(num_returns="streaming")
    async def generate(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
                       session: str | None = None, cache_salt: str | None = None):
        """cache_salt: requests share cached prefix blocks only with the same salt (the HTTP server gives each
        tenant its own). params.deadline_s counts from now: each worker gets what is left of it."""
        arrival = asyncio.get_running_loop().time()
        self._start_background()
        await self._fetch_model_info()
        if session is not None and not isinstance(session, str):
            raise InvalidRequest(f"session must be a str, got {type(session).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequest(f"cache_salt must be a str, got {type(cache_salt).__name__}",
                                 param="cache_salt")
        adapters = None  # the registered names, as far as validation needs them
        if adapter is not None:
            found = await lookup_adapter(self.adapter_cache, adapter) if isinstance(adapter, str) else None
            adapters = {adapter} if found is not None else await self.adapter_cache.adapters.remote()
        prompt_ids, params = validate_request(prompt, params, self.limits, tokenizer=self.tokenizer,
                                              adapter=adapter, adapters=adapters)
        request_id = uuid.uuid4().hex
        try:
            worker_id = self.routing.route(request_id, prompt_ids, params.max_tokens, session=session,
                                           extra=prefix_cache_key(adapter, cache_salt), adapter=adapter)
        except Overloaded:
            self.num_overloaded += 1
            raise
        outputs = self._stream(request_id, worker_id, prompt_ids, params, adapter, cache_salt, arrival)
        try:
            yield prompt_ids
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # now, not at garbage collection: it aborts the worker's request
            self.routing.finish(request_id)

    async def _stream(self, request_id: str, worker_id: str, prompt_ids: list[int], params: SamplingParams,
                      adapter: str | None, cache_salt: str | None, arrival: float):
        generated: list[int] = []
        emitted_text, resume = "", None
        attempt_id, finished = None, False
        try:
            for attempt in range(len(self.workers) * 8 + 1):
                attempt_id = f"{request_id}-{attempt}"
                left = _deadline_left(params, arrival)
                # spent in the router (e.g. waiting to reroute)
                if left is not None and left.deadline_s is None:
                    finished = True
                    yield RequestOutput(request_id, [], "", "abort",
                                        [] if params.logprobs is not None else None)
                    return
                stream = self.workers[worker_id].generate.remote(
                    attempt_id, prompt_ids + generated, left or params, adapter, cache_salt, resume)
                num_prefill = len(prompt_ids) + len(generated)
                try:
                    async for ref in stream:
                        out: RequestOutput = await ref
                        self.routing.progress(request_id, len(out.token_ids) + num_prefill)
                        num_prefill = 0
                        generated += out.token_ids
                        emitted_text += out.text
                        finished = out.finished
                        yield RequestOutput(request_id, out.token_ids, out.text, out.finish_reason,
                                            out.logprobs)
                        if finished:
                            return
                    raise WorkerStreamEnded(worker_id)
                except RayTaskError as e:
                    if isinstance(e.cause, NumaserveError):
                        raise e.cause from None  # the request's fault (e.g. InvalidRequest): no retry
                    raise
                except (*WORKER_LOST, WorkerStreamEnded):
                    self._worker_lost(worker_id)
                    worker_id = await self._reroute(request_id, len(prompt_ids) + params.max_tokens)
                    resume = resume_state(self.tokenizer, prompt_ids, generated, emitted_text)
            raise RuntimeError(f"request {request_id} lost its worker too many times; giving up")
        finally:
            if not finished and attempt_id is not None:
                self.workers[worker_id].abort.remote(attempt_id)  # the client went away: free the worker

    async def _reroute(self, request_id: str, num_tokens_left: int) -> str:
        deadline = asyncio.get_running_loop().time() + REROUTE_WAIT_S
        while (worker_id := self.routing.reroute(request_id, num_tokens_left)) is None:
            if asyncio.get_running_loop().time() > deadline:
                raise Unavailable(f"request {request_id} lost its worker and none came back within "
                                  f"{REROUTE_WAIT_S:.0f} s; retry later")
            await asyncio.sleep(PROBE_INTERVAL_S)
        return worker_id

    async def model_info(self) -> dict:
        """What a front end needs to tokenize and size requests: the tokenizer (or None), the vocabulary size
        and max_model_len."""
        await self._fetch_model_info()
        return {"tokenizer": self.tokenizer, "vocab_size": self.limits.vocab_size,
                "max_model_len": self.max_model_len}

    async def num_serving_workers(self, timeout_s: float = HEALTH_TIMEOUT_S) -> int:
        """How many workers answer within timeout_s (a restarting one does not)."""
        answers, _ = await self._ask_live_workers(lambda handle: handle.info.remote(), timeout_s)
        return len(answers)

    async def metrics(self) -> list[dict]:
        """Each live worker's metrics snapshot (actors/metrics.py); a worker that does not answer in time is
        left out."""
        answers, _ = await self._ask_live_workers(lambda handle: handle.stats.remote())
        return [stats["metrics"] for stats in answers.values()]

    async def pause(self, paused: bool, worker_ids: list[str] | None = None) -> list[str]:
        """Pause (or resume) the live workers among worker_ids (None: all); the ids that answered. A worker
        restarting now comes back unpaused."""
        ids = list(self.workers) if worker_ids is None else worker_ids
        unknown = set(ids) - set(self.workers)
        if unknown:
            raise InvalidRequest(f"no worker {sorted(unknown)} in this deployment; its workers: "
                                 f"{sorted(self.workers)}")

        answers, _ = await self._ask_live_workers(
            lambda handle: handle.pause.remote() if paused else handle.resume.remote(), worker_ids=ids)
        return list(answers)

    # ---- worker health and policy ------------------------------------------------------------------

    async def _ask_live_workers(self, call: Callable[[Any], Awaitable], timeout_s: float = STATS_TIMEOUT_S,
                                worker_ids: list[str] | None = None
                                ) -> tuple[dict[str, Any], dict[str, Exception]]:
        """call(handle) (an awaitable) on every live worker among worker_ids (None: all) at once, each given
        timeout_s -> (worker id -> answer, worker id -> the TimeoutError or RayError it failed with), in
        worker_ids' order. Workers marked down are in neither: a restarting one is not waited for."""
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
            self._background = asyncio.get_running_loop().create_task(self._poll_policies())

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
        "decisions": per worker, its engine's recent decisions and why (cluster_configs/diagnostics.py)."""
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
                "num_overloaded": self.num_overloaded, "router_pid": os.getpid(), "policies": policies,
                "decisions": decisions}
