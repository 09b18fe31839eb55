"""Errors as OpenAI answers them: {"error": {"message", "type", "param", "code"}} with the HTTP status a
client expects. Every failure a request can cause maps here; the server goes on serving. A body never carries
a traceback, a path, an address or a Ray id: an unexpected exception is a 500 saying "internal error" and the
request id (http_api/request_ids.py), under which the server log has the whole exception; a value the client
sent is echoed at most SHOWN_CHARS long."""

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster_configs.errors import AdapterError, InvalidRequest, Overloaded, Unavailable
from http_api.json_values import SHOWN_CHARS, param_of
from http_api.request_ids import request_id
from http_api.responses import sse_event

logger = logging.getLogger(__name__)

# what numaserve's own messages may hold that a client must not see: an absolute path (an adapter's folder
# resolved, the server's adapter_roots) and an engine request id (a uuid's 32 hex digits)
PATH = re.compile(r"(?<![\w.~-])/[^\s,;:()'\"]+")
HEX_ID = re.compile(r"(?<![0-9a-zA-Z.])(?=[0-9]*[a-fA-F])[0-9a-fA-F]{16,}(?![0-9a-zA-Z.+-])")
RETRY_AFTER_S = 1  # what a refused client is told to wait (Retry-After)
# fields whose union types give pydantic one error per member: one message for all of them
UNION_FIELDS = {
    "prompt": "must be a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": "..."}); the models here '
               "read text only",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "guided_json": "must be a JSON Schema: an object, or its JSON text",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, self.status, headers=self.headers)

    def sse_data(self) -> dict:
        """The body an error takes inside a stream that has already answered 200."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def as_api_error(e: Exception) -> APIError:
    """numaserve's own errors (and validation errors) as the status a client expects."""
    if isinstance(e, APIError):
        return e
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, Unavailable):
        return APIError(503, masked(e), type="server_error", code="no_worker_available", headers=retry)
    if isinstance(e, Overloaded):
        return APIError(429, masked(e), type="rate_limit_error", code="overloaded", headers=retry)
    if isinstance(e, (InvalidRequest, AdapterError)):
        return APIError(400, masked(e), param=getattr(e, "param", None), code="invalid_value")
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, HTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return APIError(e.status_code, str(e.detail), code=codes.get(e.status_code), headers=e.headers)
    return internal_error(e)


def invalid_request(message: str, param: str | None) -> APIError:
    """A request the engine's validation refused (scheduling/validation.py), as OpenAI answers it: a prompt
    too long for the context is context_length_exceeded."""
    return APIError(400, message, param=param,
                    code="context_length_exceeded" if "max_model_len" in message else "invalid_value")


def internal_error(e: BaseException) -> APIError:
    """A 500 naming only the request id; the log has the exception under that id."""
    rid = request_id.get()
    logger.error("internal error (request id %s)", rid, exc_info=e)
    return APIError(500, f"internal error (request id {rid}); the server goes on serving",
                    type="server_error", code="internal_error")


def masked(e: Exception) -> str:
    """numaserve's own message as a client sees it: each absolute path as <path>, each hex id as <id> (the
    log has it whole, under the request id)."""
    text = str(e)
    if PATH.search(text) or HEX_ID.search(text):
        logger.info("request id %s: %s", request_id.get(), text)
        text = HEX_ID.sub("<id>", PATH.sub("<path>", text))
    return text


def shown(value) -> str:
    """A client's value as a message echoes it: its repr, at most SHOWN_CHARS characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the body is not valid JSON ({detail} at character {first['loc'][-1]}); send a "
                             "JSON object", code="invalid_json")
    loc = _loc(first)
    if not loc:
        return APIError(400, "the body must be a JSON object of this endpoint's fields "
                             f"({first['msg'][:SHOWN_CHARS]})",
                        code="invalid_body")
    # a value that fits no member of a union type: one error per member, their locations past the field
    # name the member ("str", "list[int]", ...); the field is where they part
    field = _common_prefix([_loc(err) for err in errors if _loc(err)[:1] == loc[:1]])
    if len(field) < len(loc):
        param = param_of(field)
        name = next((str(x) for x in reversed(field) if not isinstance(x, int)), "")
        message = UNION_FIELDS.get(name, "has none of the accepted types (see /openapi.json)")
        return APIError(400, f"{param} {message}", param=param, code="invalid_type")
    param = param_of(loc)
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return APIError(400, f"{param} is not a field this endpoint accepts; remove it", param=param,
                        code="unknown_parameter")
    got = shown(first.get("input"))
    return APIError(400, f"{param}: {first['msg']} (got {got})", param=param,
                    code="invalid_type" if first["type"].endswith("_type") else "invalid_value")


def _loc(error: dict) -> tuple:
    return tuple(x for x in error["loc"] if x != "body")


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(prefix, loc)) if a != b), min(len(prefix), len(loc)))
        prefix = prefix[:n]
    return prefix


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, e: Exception) -> JSONResponse:
        return as_api_error(e).response()

    for kind in (APIError, RequestValidationError, HTTPException, InvalidRequest, AdapterError, Overloaded,
                 Unavailable):
        app.add_exception_handler(kind, handle)


class InternalErrors:
    """ASGI middleware, inside RequestIds: any exception the app lets out (a bug) is logged with the request
    id and answered as internal_error: a 500 before the response started, else, in an event stream, a last
    `data: {"error": ...}` event (a body already under way is only closed)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, ended, stream = False, False, False

        async def watched(message: Message) -> None:
            nonlocal started, ended, stream
            if message["type"] == "http.response.start":
                started = True
                stream = dict(message.get("headers", ())).get(b"content-type", b"").startswith(
                    b"text/event-stream")
            elif message["type"] == "http.response.body":
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:  # noqa: BLE001  (the one place a bug becomes an answer)
            error = internal_error(e)
            if not started:
                return await error.response()(scope, receive, send)
            if stream and not ended:
                event = sse_event(json.dumps(error.sse_data())) + sse_event("[DONE]")
                try:
                    await send({"type": "http.response.body", "body": event, "more_body": False})
                except OSError:
                    pass  # the client is gone
