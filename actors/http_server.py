"""HttpServer: the deployment's OpenAI-compatible HTTP API, a FastAPI app served by uvicorn inside a Ray
actor.

uvicorn runs as a task on the actor's own event loop (Ray Serve's proxy does the same). A request is
tokenized and validated in this actor's thread pool, placed by the router and streamed straight from its
worker's streaming generator with `await` (actors/request_stream.py), never a blocking ray.get. The actor
is detached with unlimited restarts like the others; a restarted one binds its port again. The endpoints'
logic is OpenAIServing (http_api/serving.py); this file wires it to HTTP and to the Ray actors. GET
/metrics renders the workers' metrics (actors/metrics.py), gathered by the router, and this actor's request
counts (http_api/metrics.py) in Prometheus text format.
The app runs inside Lifecycle (http_api/lifecycle.py): the access log, and drain() when serving stops.
"""

import asyncio
import contextlib
import hashlib
import importlib.metadata
import os
import socket
from collections import Counter
from pathlib import Path

import numpy as np
import ray
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from ray.exceptions import RayActorError, RayTaskError
from sse_starlette import EventSourceResponse

from actors.adapter_cache import lookup_adapter
from actors.fresh_value import FreshValue
from actors.metrics import render
from actors.ray_errors import unwrap
from actors.request_stream import Ingress, RequestStream
from cluster_configs.cluster_config import ClusterConfig, HttpConfig
from cluster_configs.errors import Unavailable
from http_api.chat_template import load_chat_template
from http_api.errors import APIError, InternalErrors, install_error_handlers
from http_api.json_bodies import JSONBodies, ParsedJSONRoute
from http_api.lifecycle import Lifecycle, log_access_to_stderr
from http_api.limits import Caller
from http_api.metrics import CountRequests
from http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
)
from http_api.request_ids import RequestIds
from http_api.serving import OpenAIServing

MAX_BODY_BYTES = 8 << 20  # a 32k-token prompt as token ids is ~200 kB; more is a mistake or an attack: 413
HEALTH_TIMEOUT_S = 5.0
HEALTH_REFRESH_S = 0.25  # /health answers a serving-worker count asked at most this long ago (while polled),
HEALTH_MAX_AGE_S = 2.0  # and never one older than this: it waits for a fresh one (actors/fresh_value.py)
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


# ---- the HTTP app ------------------------------------------------------------------------------------------

def build_app(serving: OpenAIServing) -> FastAPI:
    app = FastAPI(title="numaserve", summary="OpenAI-compatible API of a numaserve deployment")
    app.router.route_class = ParsedJSONRoute
    install_error_handlers(app)
    # the last added is the outermost: ids, CORS, the request counts, a bug's 500, then the body checks
    app.add_middleware(JSONBodies, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(InternalErrors)
    http_requests: Counter = Counter()  # (handler, method, status) -> n, for /metrics
    app.add_middleware(CountRequests, counts=http_requests)
    origins = serving.tenancy.config.allowed_origins
    if origins:  # a preflight is answered before the body checks (API keys go in a header)
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIds)

    def caller(request: Request) -> Caller:
        """The /v1 routes' API key check (401), as vLLM's --api-key does; /health and /metrics stay open."""
        key = serving.tenancy.authenticate(request.headers.get("authorization"))
        return Caller(key, request.client.host if request.client else None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.completions(body, caller(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.chat(body, caller(request)))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await _respond(request, serving.embeddings(body, caller(request)))

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        caller(request)
        return await serving.models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        caller(request)
        return PlainTextResponse(await serving.load_lora_adapter(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        caller(request)
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        caller(request)
        return await serving.detokenize(body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": importlib.metadata.version("numaserve")}

    @app.get("/health")
    async def health() -> Response:
        if await serving.health():
            return Response(status_code=200)
        raise APIError(503, "no worker can serve (all are down or restarting); retry in a few seconds",
                       type="server_error", code="no_worker_available", headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(await serving.deployment.metrics(), http_requests),
                        media_type=CONTENT_TYPE_LATEST)

    return app


async def _respond(request: Request, work) -> Response:
    """The endpoint's answer, or its cancellation when the client goes away first (the requests it opened
    are aborted). A stream is watched by sse-starlette from then on."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    # sse-starlette rather than a bare StreamingResponse: it watches for the client's disconnect while the
    # generator waits for the next token (Starlette's, under ASGI 2.4, notices only when a send fails), then
    # cancels it, and closes it on a failed send, so the requests are aborted at once either way. The events
    # come framed (openai_format.sse_event) and pass through as they are; sep frames its keep-alive pings
    return EventSourceResponse(result, sep="\n")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
