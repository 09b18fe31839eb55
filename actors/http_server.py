"""HttpServer: the deployment's OpenAI-compatible HTTP API (the app: http_api/app.py) served by uvicorn inside
a Ray actor, over the deployment's routers and workers (RayDeployment).

uvicorn runs as a task on the actor's own event loop (Ray Serve's proxy does the same). A request is
tokenized and validated in this actor's thread pool, placed by the router and streamed straight from its
worker's streaming generator with `await` (actors/request_stream.py), never a blocking ray.get. The actor
is detached with unlimited restarts like the others; a restarted one binds its port again. GET /metrics
renders the workers' metrics (actors/metrics.py), gathered by the router, and this actor's request counts.
The app runs inside Lifecycle (http_api/lifecycle.py): the access log, and drain() when serving stops.
"""

import asyncio
import contextlib
import hashlib
import os
import socket
from pathlib import Path

import numpy as np
import ray
import uvicorn
from ray.exceptions import RayActorError, RayTaskError

from actors.adapter_cache import lookup_adapter
from actors.fresh_value import FreshValue
from actors.ray_errors import unwrap
from actors.request_stream import Ingress, RequestStream
from cluster_configs.cluster_config import ClusterConfig, HttpConfig
from cluster_configs.errors import Unavailable
from http_api.app import build_app
from http_api.chat_template import load_chat_template
from http_api.lifecycle import Lifecycle, log_access_to_stderr
from http_api.serving import OpenAIServing

HEALTH_TIMEOUT_S = 5.0
HEALTH_REFRESH_S = 0.25  # /health answers a serving-worker count asked at most this long ago (while polled),
HEALTH_MAX_AGE_S = 2.0  # and never one older than this: it waits for a fresh one (actors/fresh_value.py)
STATS_REFRESH_S = 0.5  # /v1/numaserve/stats: one router ask per this, however many consoles poll it
STATS_MAX_AGE_S = 1.0
STATS_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 30.0


def served_model_name(config: ClusterConfig) -> str:
    """What requests call the base model: http.served_model_name, else the model folder's (or file's) name."""
    if config.http is not None and config.http.served_model_name is not None:
        return config.http.served_model_name
    path = Path(config.model)
    return path.stem if path.suffix == ".gguf" else path.name


def fingerprint(config: ClusterConfig) -> str:
    """system_fingerprint: changes when the model or the engine config does."""
    return "fp_" + hashlib.sha256(
        f"{config.model}|{config.engine.model_dump_json()}".encode()).hexdigest()[:12]


# ---- the deployment as OpenAIServing sees it ------------------------------------------------------------

async def _call(ref, actor: str):
    try:
        return await ref
    except (RayTaskError, RayActorError) as e:
        raise unwrap(e, actor) from None


class RayRequestStream:
    """One request as OpenAIServing reads it: the prompt's ids once admitted, then RequestOutputs."""

    def __init__(self, opening):
        self.opening = opening  # Ingress.open(...): the first next() awaits it
        self.admitting: asyncio.Task | None = None
        self.stream: RequestStream | None = None
        self.done = False

    async def next(self):
        if self.stream is None:
            self.admitting = asyncio.ensure_future(self.opening)
            try:
                self.stream = await asyncio.shield(self.admitting)  # an admission under way is not dropped
            except BaseException:
                self.cancel()
                raise
            return self.stream.admission.prompt_token_ids
        item = await self.stream.next()
        self.done = self.stream.done
        return item

    def cancel(self) -> None:
        """Aborts the request on its worker, which frees its KV blocks (one being admitted: once it is)."""
        if self.done:
            return
        self.done = True
        if self.stream is not None:
            self.stream.cancel()
        elif self.admitting is None:
            self.opening.close()  # never started: nothing to undo
        else:
            self.admitting.add_done_callback(_cancel_admitted)


def _cancel_admitted(admitting: asyncio.Task) -> None:
    if not admitting.cancelled() and admitting.exception() is None:
        admitting.result().cancel()


class RayDeployment:
    def __init__(self, routers: list, adapter_cache, first_router: int = 0):
        self.adapter_cache = adapter_cache
        self.ingress = Ingress(routers, adapter_cache, first_router)
        self.num_requests = 0  # generate calls: each HTTP actor's own count
        self.serving_workers = FreshValue(self._ask_serving_workers, HEALTH_REFRESH_S, HEALTH_MAX_AGE_S)
        self.router_live = FreshValue(self._ask_live, STATS_REFRESH_S, STATS_MAX_AGE_S)

    def generate(self, prompt, params, adapter, cache_salt=None):
        self.num_requests += 1
        return RayRequestStream(self.ingress.open(prompt, params, adapter, None, cache_salt))

    async def model_info(self) -> dict:
        return await self.ingress.model_info()

    async def embed(self, prompts: list, pooling: str, adapter: str | None,
                    cache_salt: str | None = None) -> tuple[list[list[int]], np.ndarray]:
        """Each prompt placed and embedded on its own (they spread over the workers like requests)."""
        done = await asyncio.gather(*(self.ingress.embed(p, pooling, adapter, cache_salt) for p in prompts))
        return [ids for ids, _ in done], np.stack([vector for _, vector in done])

    async def adapter_path(self, name: str) -> str | None:
        return await lookup_adapter(self.adapter_cache, name)

    async def adapters(self) -> dict[str, str]:
        return await _call(self.adapter_cache.adapters.remote(), "adapter cache")

    async def register_adapter(self, name: str, path: str) -> str:
        return await _call(self.adapter_cache.register.remote(name, path), "adapter cache")

    async def unload_adapter(self, name: str) -> None:
        await _call(self.adapter_cache.unload.remote(name), "adapter cache")

    async def num_serving_workers(self) -> int:
        """As of at most HEALTH_MAX_AGE_S ago, without a Ray call of its own while one is under way."""
        return await self.serving_workers.get()

    async def _ask_serving_workers(self) -> int:
        """Through this actor's router, or the next one while it is lost."""
        try:
            asking = self.ingress.call_router(lambda router: router.num_serving_workers.remote())
            _, num = await asyncio.wait_for(asking, HEALTH_TIMEOUT_S)
            return num
        except (TimeoutError, Unavailable, ray.exceptions.RayError):
            return 0  # no router answers: down or restarting

    async def metrics(self) -> list[dict]:
        _, snapshots = await self.ingress.call_router(lambda router: router.metrics.remote())
        return snapshots

    async def live(self) -> dict:
        return await self.router_live.get()

    async def _ask_live(self) -> dict:
        try:
            _, live = await asyncio.wait_for(
                self.ingress.call_router(lambda router: router.live.remote()), STATS_TIMEOUT_S)
            return live
        except (TimeoutError, Unavailable, ray.exceptions.RayError):
            return {"error": "no router answered (down or restarting); retry in a few seconds"}


# ---- the actor ---------------------------------------------------------------------------------------------

class _Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()  # Ray owns this process's signals


def _actor_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this async actor, which runs its methods (Ray runs __init__ on it too; older Ray ran
    it in that loop's thread before the loop started)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.get_event_loop_policy().get_event_loop()


@ray.remote(num_cpus=0)
class HttpServer:
    def __init__(self, config: HttpConfig, model_name: str, model_path: str, system_fingerprint: str,
                 routers: list, adapter_cache, replica: int = 0, share_port: bool = False):
        """replica: this actor's index (it admits through routers[replica % len(routers)] first);
        share_port: bind with SO_REUSEPORT, beside the deployment's other HTTP actors (the kernel spreads
        the connections over them)."""
        # small arguments only: Ray restarts the actor from them
        self.deployment = RayDeployment(routers, adapter_cache, replica)
        serving = OpenAIServing(self.deployment, model_name, model_path, load_chat_template(model_path),
                                config.enable_lora_loading, system_fingerprint, config)
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        # OSError: the actor fails to start
        sock = socket.create_server((config.host, config.port), family=family, reuse_port=share_port)
        self.url = f"http://{f'[{config.host}]' if ':' in config.host else config.host}:{config.port}"
        self.lifecycle = Lifecycle(build_app(serving))
        log_access_to_stderr()
        self.server = _Server(uvicorn.Config(self.lifecycle, lifespan="off", log_config=None,
                                             log_level="warning", access_log=False,
                                             timeout_graceful_shutdown=1))
        self.serving = _actor_loop().create_task(self.server.serve(sockets=[sock]))

    async def ready(self) -> str:
        """The server's URL once it accepts connections."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if self.serving.done():
                self.serving.result()  # its exception
                raise RuntimeError("the HTTP server stopped during startup")
            if loop.time() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {STARTUP_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)
        return self.url

    async def drain(self, timeout_s: float) -> int:
        """Answers new requests 503 from now on; -> how many in flight were cancelled after timeout_s."""
        return await self.lifecycle.drain(timeout_s)

    async def stats(self) -> dict:
        """This actor's own figures: completions and chat choices it opened, its process id."""
        return {"num_requests": self.deployment.num_requests, "pid": os.getpid()}
