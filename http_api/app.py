"""The OpenAI-compatible HTTP app: FastAPI routes over OpenAIServing (http_api/serving.py), whatever the
deployment behind it (the Ray one: actors/http_server.py; one engine in this process:
tests/support/local_deployment.py). Importing it imports no Ray."""

import asyncio
import importlib.metadata
from collections import Counter
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse

from http_api.console_stats import ConsoleStats
from http_api.errors import APIError, InternalErrors, install_error_handlers
from http_api.json_bodies import JSONBodies, ParsedJSONRoute
from http_api.limits import Caller
from http_api.metrics import CountRequests
from http_api.prometheus import render
from http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from http_api.request_ids import RequestIds
from http_api.serving import OpenAIServing

CONSOLE = Path(__file__).parent / "console"  # the web console's static files (no build step)
MAX_BODY_BYTES = 8 << 20  # a 32k-token prompt as token ids is ~200 kB; more is a mistake or an attack: 413


def build_app(serving: OpenAIServing) -> FastAPI:
    app = FastAPI(title="numaserve", summary="OpenAI-compatible API of a numaserve deployment")
    app.router.route_class = ParsedJSONRoute
    install_error_handlers(app)
    # the last added is the outermost: ids, CORS, the request counts, a bug's 500, then the body checks
    app.add_middleware(JSONBodies, max_bytes=MAX_BODY_BYTES, max_model_len=serving.max_model_len)
    app.add_middleware(InternalErrors)
    http_requests: Counter = Counter()  # (handler, method, status) -> n, for /metrics
    app.add_middleware(CountRequests, counts=http_requests)
    origins = serving.tenancy.config.allowed_origins
    if origins:  # a preflight is answered before the body checks (API keys go in a header)
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIds)
    _add_api_routes(app, serving)
    _add_operations_routes(app, serving, http_requests)
    if serving.tenancy.config.ui:
        _add_console(app, serving)
    return app


def _add_api_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The OpenAI routes and vLLM's extras, behind the API key check."""

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

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> PlainTextResponse:
        caller(request)
        return PlainTextResponse(await serving.unload_lora_adapter(body))

    @app.get("/v1/numaserve/stats")
    async def numaserve_stats(request: Request) -> ConsoleStats:
        """The deployment now, per worker (the web console's live view reads it): placement, load, rates,
        KV, prefix cache, speculation, adapters, stage times."""
        caller(request)
        return await serving.console_stats()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict:
        caller(request)
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
        caller(request)
        return await serving.detokenize(body)


def _add_operations_routes(app: FastAPI, serving: OpenAIServing, http_requests: Counter) -> None:
    """/version, /health and /metrics: open to anyone who reaches the port."""

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


def _add_console(app: FastAPI, serving: OpenAIServing) -> None:
    """The web console: its page at /, its scripts and styles under /console. They hold no data: the page
    asks the /v1 routes for it, with the API key the user gives it."""

    @app.get("/console/auth", include_in_schema=False)
    async def console_auth(request: Request) -> dict:
        """Whether this server wants a key and accepts the one sent (the page asks before it asks for data,
        so that a missing key is a form to fill, not a 401 in the browser's console)."""
        try:
            serving.tenancy.authenticate(request.headers.get("authorization"))
        except APIError:
            return {"key_required": True, "authorized": False}
        return {"key_required": bool(serving.tenancy.config.api_keys), "authorized": True}

    @app.get("/", include_in_schema=False)
    async def console() -> FileResponse:
        return FileResponse(CONSOLE / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/console", StaticFiles(directory=CONSOLE), name="console")


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
