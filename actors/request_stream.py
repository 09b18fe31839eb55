"""A request from its caller's side (ns.Client, the HTTP actor): validated and tokenized in the caller, placed
by the router, streamed straight from its worker, resumed on another worker if that one is lost, and
reported to the router when it ends. The router sees two calls per request (admit, finish; a reroute more if
its worker is lost), never a token. The caller keeps a lease on the workers it streams from
(actors/caller_lease.py): if it dies, they abort its requests within a second.

Resuming: the caller holds what it has received; it re-submits prompt + those tokens to the worker the
router gives it, with a Resume record (actors/resume.py) that lets the new worker go on exactly where the old
one was, so the stream is identical to an undisturbed one. A router that dies loses no stream (none passes
through it); calls to it go to the deployment's next router meanwhile, or with only one, wait for its
restart (ROUTER_WAIT_S).

A worker refuses a newly admitted request past its own admission bound (other routers may have filled it):
the request goes to its admission's fallbacks in turn, and is Overloaded when none takes it.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import numpy as np
from ray.exceptions import RayActorError, RayTaskError

from actors.adapter_cache import resolve_adapter
from actors.caller_lease import CallerGone, LeaseKeeper
from actors.messages import Admission, EmbedRequest, GenerateRequest, Placement
from actors.ray_errors import WORKER_LOST, unwrap
from actors.resume import resume_state
from actors.worker_feed import WorkerFeed, WorkerFeeds, WorkerLost
from cluster_configs.errors import Overloaded, Unavailable
from cluster_configs.sampling_params import SamplingParams
from scheduling.outputs import RequestOutput
from scheduling.validation import RequestLimits, validate_request

ROUTER_WAIT_S = 60.0  # how long a call waits for a restarting router
REROUTE_WAIT_S = 120.0  # how long a request that lost its worker waits for any live worker
RETRY_INTERVAL_S = 0.2
MAX_ATTEMPTS = 64  # workers lost by one request before it gives up


class Ingress:
    """A caller's handle on the deployment's routers and adapter cache; the model's tokenizer and limits are
    fetched once. It calls routers[first % len(routers)] until that one is lost, then the next."""

    def __init__(self, routers: list, adapter_cache, first: int = 0):
        self.routers, self.adapter_cache = list(routers), adapter_cache
        self._current = first % len(self.routers)
        self._model: dict | None = None  # Router.model_info
        self.leases = LeaseKeeper()  # keeps this caller's requests alive on their workers
        self.feeds = WorkerFeeds(self.leases.caller_id)  # their deltas, one Ray stream per worker

    @property
    def router(self):
        """The router this caller admits through now."""
        return self.routers[self._current]

    async def model_info(self) -> dict:
        """The tokenizer (or None), vocab_size and max_model_len."""
        if self._model is None:
            _, self._model = await self.call_router(lambda router: router.model_info.remote())
        return self._model

    async def open(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
                   session: str | None = None, cache_salt: str | None = None, *, pinned: str | None = None,
                   sequence_id: str | None = None) -> "RequestStream":
        """Validate (tokenizing in a thread of this process: a huge prompt delays its own request only),
        admit, and return the request's stream; InvalidRequest, Overloaded, Unavailable as they come.
        pinned, sequence_id: a client session's worker and the sequence this turn continues
        (actors/client_session.py)."""
        arrival = asyncio.get_running_loop().time()
        router, admission = await self._admit(prompt, params, adapter, session, cache_salt, pinned=pinned)
        return RequestStream(self, router, admission, arrival, sequence_id)

    async def embed(self, prompt, pooling: str, adapter: str | None = None,
                    cache_salt: str | None = None) -> tuple[list[int], np.ndarray]:
        """(the prompt's token ids, its final hidden states pooled: float32 [hidden]), computed on the worker
        the router places it on (NumaWorker.embed); computed again on another if that one is lost."""
        router, a = await self._admit(prompt, SamplingParams(max_tokens=1), adapter, None, cache_salt,
                                      prompt_only=True)
        placement, fallbacks = a.placement, list(a.fallbacks)
        try:
            for attempt in range(MAX_ATTEMPTS):
                request = EmbedRequest(f"{a.request_id}-{attempt}", a.prompt_token_ids, pooling, a.adapter,
                                       a.request_id)
                try:
                    return a.prompt_token_ids, await placement.worker.embed.remote(request)
                except WORKER_LOST:
                    router, placement = await self.reroute(router, a.request_id, placement.worker_id,
                                                           len(a.prompt_token_ids))
                except RayTaskError as e:
                    error = unwrap(e, "worker")
                    if not (isinstance(error, Overloaded) and fallbacks):
                        raise error from None
                    placement = fallbacks.pop(0)  # refused at the worker's own bound: the next candidate
            raise RuntimeError(f"request {a.request_id} lost its worker too many times; giving up")
        finally:
            router.finish.remote(a.request_id)

    async def _admit(self, prompt, params: SamplingParams | None, adapter: str | None, session: str | None,
                     cache_salt: str | None, prompt_only: bool = False,
                     pinned: str | None = None) -> tuple[Any, Admission]:
        """(the router that admitted it, the Admission)."""
        model = await self.model_info()
        adapters = None  # the registered names, as far as validation needs them
        adapter_id = None  # the id the adapter's current version is served under (asked at each admission)
        if adapter is not None:
            if isinstance(adapter, str):
                adapter_id = await resolve_adapter(self.adapter_cache, adapter)
            adapters = {adapter} if adapter_id is not None else await self._adapter_names()
        limits = RequestLimits(model["vocab_size"], model["max_model_len"])
        prompt_ids, params = await asyncio.to_thread(
            validate_request, prompt, params, limits, tokenizer=model["tokenizer"], adapter=adapter,
            adapters=adapters, cache_salt=cache_salt, prompt_only=prompt_only)
        return await self.call_router(
            lambda router: router.admit.remote(prompt_ids, params, adapter_id, session, cache_salt, pinned))

    async def reroute(self, router, request_id: str, lost_worker_id: str,
                      num_tokens_left: int) -> tuple[Any, Placement]:
        """(the router that placed it, a live worker for a request whose worker was lost), asked of router
        (the one that admitted it) first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REROUTE_WAIT_S
        lost: str | None = lost_worker_id  # reported once: a retry that reported it again would mark the
        while True:  # worker down after its restart, and a deployment of one worker would never get it back
            router, placement = await self.call_router(
                lambda r, lost=lost: r.reroute.remote(request_id, lost, num_tokens_left), router)
            lost = None
            if placement is not None:
                return router, placement
            if loop.time() > deadline:
                raise Unavailable(f"request {request_id} lost its worker and none came back within "
                                  f"{REROUTE_WAIT_S:.0f} s; retry later")
            await asyncio.sleep(RETRY_INTERVAL_S)

    async def call_router(self, call: Callable[[Any], Awaitable], router=None) -> tuple[Any, Any]:
        """(the router that answered, await call(it)): router (default: this caller's) first; a router lost
        meanwhile is left for the next one of the deployment (with one router: its restart is waited for),
        for up to ROUTER_WAIT_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROUTER_WAIT_S
        router = router if router is not None else self.router
        while True:
            try:
                return router, await call(router)
            except RayActorError as e:
                if loop.time() > deadline:
                    raise unwrap(e, "router") from None
                if router is self.router:
                    self._current = (self._current + 1) % len(self.routers)
                router = self.router
                await asyncio.sleep(RETRY_INTERVAL_S)
            except RayTaskError as e:
                raise unwrap(e, "router") from None

    async def _adapter_names(self) -> set[str]:
        try:
            return set(await self.adapter_cache.adapters.remote())
        except (RayActorError, RayTaskError) as e:
            raise unwrap(e, "adapter cache") from None


class RequestStream:
    """One admitted request's deltas (`await next()`, the last with finish_reason set), straight from its
    worker. cancel() aborts it (safe at any time, repeated or after the end); a cancelled next() cancels."""

    def __init__(self, ingress: Ingress, router, admission: Admission, arrival: float,
                 sequence_id: str | None = None):
        self.ingress, self.admission, self.arrival = ingress, admission, arrival
        self.router = router  # the one that placed it: told when it ends
        self.sequence_id = sequence_id  # a client session sequence's turn
        self.placement = admission.placement
        self.fallbacks = list(admission.fallbacks)
        self.generated: list[int] = []
        self.emitted_text = ""
        self.resume = None
        self.num_attempts = 0
        self.attempt_id: str | None = None
        self.feed: WorkerFeed | None = None  # the caller's feed from the attempt's worker
        self.queue: asyncio.Queue | None = None  # the submitted attempt's items, from the feed
        self.done = False

    async def next(self) -> RequestOutput:
        try:
            while True:
                if self.queue is None:
                    expired = await self._start_attempt()
                    if expired is not None:
                        self._end(finished=True)
                        return expired
                    if self.queue is None:
                        continue  # refused at a worker's bound, or its worker lost: the next one
                out = await self.queue.get()
                if isinstance(out, (WorkerLost, CallerGone)):
                    await self._move()  # its worker was lost, or dropped it taking this caller for dead
                    continue
                if isinstance(out, BaseException):
                    self._end(finished=True)  # the request failed on its worker, which has let it go
                    raise out
                self.generated += out.token_ids
                self.emitted_text += out.text
                if out.finished:
                    self._end(finished=True)
                # a resumed attempt's prompt holds tokens already streamed: its prompt logprobs were sent
                return replace(out, request_id=self.admission.request_id,
                               prompt_logprobs=out.prompt_logprobs if self.resume is None else None)
        except BaseException:
            self.cancel()  # cancelled (the caller went away), or no worker to resume on
            raise

    def cancel(self) -> None:
        if not self.done:
            self._end(finished=False)

    async def _start_attempt(self) -> RequestOutput | None:
        """Submit the request (resumed, after a loss) to its worker, its queue on the caller's feed from that
        worker set first; an "abort" output if its deadline has passed meanwhile. The queue stays None if the
        worker refused it at its bound (the next fallback is placed) or was lost (it is moved)."""
        a = self.admission
        if self.num_attempts >= MAX_ATTEMPTS:
            raise RuntimeError(f"request {a.request_id} lost its worker too many times; giving up")
        left = _deadline_left(a.params, self.arrival)
        if left is not None and left.deadline_s is None:
            return RequestOutput(a.request_id, [], "", "abort", [] if a.params.logprobs is not None else None)
        self.attempt_id = f"{a.request_id}-{self.num_attempts}"
        self.num_attempts += 1
        leases = self.ingress.leases
        request = GenerateRequest(self.attempt_id, a.prompt_token_ids + self.generated, left or a.params,
                                  a.adapter, a.cache_salt, self.resume, a.request_id, self.sequence_id,
                                  leases.caller_id)
        feed = self.feed = self.ingress.feeds.feed(self.placement.worker_id, self.placement.worker)
        queue = feed.add(self.attempt_id)
        leases.opened(self)
        try:
            await self.placement.worker.submit.remote(request)
        except WORKER_LOST:
            await self._move()
            return None
        except RayTaskError as e:
            self._leave()
            error = unwrap(e, "worker")
            if isinstance(error, Overloaded) and self.fallbacks and not self.generated:
                self.placement = self.fallbacks.pop(0)  # refused at its bound: the router's next candidate
                return None
            self._end(finished=True)  # refused: nothing runs there
            raise error from None
        feed.submitted_to(request.request_id)  # (unless it was cancelled or moved meanwhile)
        self.queue = queue
        return None

    async def _move(self) -> None:
        """The worker was lost: go on on the one the router gives, from where the stream is."""
        a = self.admission
        self._leave()
        self.placement.worker.abort.remote(self.attempt_id)  # in case it lives on (it dropped this caller)
        num_tokens_left = len(a.prompt_token_ids) + a.params.max_tokens
        self.router, self.placement = await self.ingress.reroute(self.router, a.request_id,
                                                                 self.placement.worker_id, num_tokens_left)
        tokenizer = (await self.ingress.model_info())["tokenizer"]
        self.resume = resume_state(tokenizer, a.prompt_token_ids, self.generated, self.emitted_text)

    def _end(self, finished: bool) -> None:
        """Let the worker (unless the request finished there) and the router go of it; neither is waited
        for (a router restarting now has forgotten the request anyway)."""
        self.done = True
        self.ingress.leases.closed(self)
        if not finished and self.feed is not None:  # submitted, or its submission in flight
            self.placement.worker.abort.remote(self.attempt_id)
        self._leave()
        self.router.finish.remote(self.admission.request_id)

    def _leave(self) -> None:
        """Nothing more of the running attempt is read."""
        if self.feed is not None:
            self.feed.remove(self.attempt_id)
        self.queue = self.feed = None


def _deadline_left(params: SamplingParams, arrival: float) -> SamplingParams | None:
    """params with deadline_s cut to what is left since arrival (None in it: nothing is left); None when the
    request has no deadline."""
    if params.deadline_s is None:
        return None
    left = params.deadline_s - (asyncio.get_running_loop().time() - arrival)
    return params.model_copy(update={"deadline_s": left if left > 0 else None})
