"""Request bodies as the OpenAI endpoints read them: JSON objects in UTF-8, at most max_bytes, of values every
later stage can take (http_api/json_values.py's read_json; each value it refuses a 400 naming where it is,
before the endpoint runs), parsed where they hold up the streams least: small ones on the event loop, larger
ones in a thread, the largest in a process of their own (http_api/body_parser.py)."""

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from http_api.body_parser import BodyParser
from http_api.errors import APIError, as_api_error
from http_api.json_values import BodyError, read_json

JSON_TYPES = (b"application/json", b"")  # no content type: curl -d and friends, read as JSON
THREAD_MIN_BYTES = 1 << 16  # parsed off the event loop from here: parsing then outlasts a thread's hop
# parsed in the body parser's process from here (http_api/body_parser.py): a thread still holds the GIL the
# streams' writer needs, ~90 ms for 5 MB of token ids; a legitimate body is rarely this large (a 32k-token
# prompt as token ids is ~200 kB)
PROCESS_MIN_BYTES = 1 << 20
PARSED = "numaserve.json"  # the scope key under which JSONBodies leaves the body's value for ParsedJSONRoute
# routes whose token-id lists are prompts: a longer list than the context is refused in the parser's process
PROMPT_ROUTES = ("/v1/completions", "/v1/embeddings")


def media_type(content_type: bytes) -> bytes:
    return content_type.split(b";")[0].strip().lower()


def as_400(e: BodyError) -> APIError:
    return APIError(400, e.message, param=e.param, code=e.code)


class JSONBodies:
    """ASGI middleware for POST bodies. Every one here is JSON: `curl -d` labels its body form-urlencoded,
    and FastAPI would then not parse it, so it (and an unlabelled body) is relabelled application/json;
    another media type is a 415, as vLLM answers. None may exceed max_bytes: 413 with an OpenAI error body
    (Starlette's own limit answers in plain text), at once when Content-Length says so, else when the bytes
    read pass the limit. The body is read whole, then parsed and checked by read_json (from THREAD_MIN_BYTES
    in a worker thread, from PROCESS_MIN_BYTES in the body parser's process), and handed on with its value in
    the scope for ParsedJSONRoute (FastAPI's route would parse it again). In the event loop, a large body's
    parse held up the actor's other requests. max_model_len(), where given, bounds a prompt's token ids in
    the parser's process (None: no bound; a failure to learn it, too)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 max_model_len: Callable[[], Awaitable[int | None]] | None = None):
        self.app, self.max_bytes, self.max_model_len = app, max_bytes, max_model_len
        self.parser = BodyParser()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        kind = media_type(headers.get(b"content-type", b""))
        if kind == b"application/x-www-form-urlencoded":
            kind = b""
        if kind not in JSON_TYPES and not kind.endswith(b"+json"):
            error = APIError(415, f"the body's Content-Type is {kind.decode('latin-1')[:100]!r}; send "
                                  "application/json", code="unsupported_media_type")
            return await error.response()(scope, receive, send)
        scope = dict(scope, headers=[*((k, v) for k, v in scope["headers"] if k != b"content-type"),
                                     (b"content-type", b"application/json")])
        too_large = HTTPException(413, f"the request body is larger than {self.max_bytes >> 20} MiB; send a "
                                       "shorter prompt (as token ids it takes ~7 bytes a token)")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await as_api_error(too_large).response()(scope, receive, send)
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            if num_bytes > self.max_bytes:
                return await as_api_error(too_large).response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            scope[PARSED] = await self._parsed(body, scope["path"])
        except BodyError as e:
            return await as_400(e).response()(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # http.disconnect, which the endpoints watch for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


    async def _parsed(self, body: bytes, path: str):
        if len(body) < THREAD_MIN_BYTES:
            return read_json(body)
        if len(body) < PROCESS_MIN_BYTES:
            return await asyncio.to_thread(read_json, body)
        return await self.parser.read_json(body, await self._max_ids(path))

    async def _max_ids(self, path: str) -> int | None:
        if self.max_model_len is None or path not in PROMPT_ROUTES:
            return None
        try:
            return await self.max_model_len()
        except Exception:  # noqa: BLE001  (the deployment not reachable: no bound here, the endpoint refuses)
            return None


class ParsedJSONRequest(Request):
    async def json(self):
        return self.scope[PARSED] if PARSED in self.scope else await super().json()


class ParsedJSONRoute(APIRoute):
    """FastAPI's route, reading a body JSONBodies has parsed from the scope rather than parsing it again."""

    def get_route_handler(self):
        handle = super().get_route_handler()

        async def handle_parsed(request: Request):
            return await handle(ParsedJSONRequest(request.scope, request.receive))
        return handle_parsed
