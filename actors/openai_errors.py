"""Errors as OpenAI answers them: {"error": {"message", "type", "param", "code"}} with the HTTP status a
client expects. Every failure a request can cause maps here; the server goes on serving."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster_configs.errors import AdapterError, InvalidRequest, Overloaded, Unavailable

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
        return APIError(503, str(e), type="server_error", code="no_worker_available", headers=retry)
    if isinstance(e, Overloaded):
        return APIError(429, str(e), type="rate_limit_error", code="overloaded", headers=retry)
    if isinstance(e, (InvalidRequest, AdapterError)):
        return APIError(400, str(e), param=getattr(e, "param", None), code="invalid_value")
    if isinstance(e, RequestValidationError):
        return _validation_error(e)
    if isinstance(e, HTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return APIError(e.status_code, str(e.detail), code=codes.get(e.status_code), headers=e.headers)
    return APIError(500, f"internal error ({type(e).__name__}: {e}); the server goes on serving",
                    type="server_error", code="internal_error")


def _validation_error(e: RequestValidationError) -> APIError:
    errors = e.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the body is not valid JSON ({detail} at character {first['loc'][-1]}); send a "
                             "JSON object", code="invalid_json")
    loc = _loc(first)
    if not loc:
        return APIError(400, f"the body must be a JSON object of this endpoint's fields ({first['msg']})",
                        code="invalid_body")
    # a value that fits no member of a union type: one error per member, their locations past the field
    # name the member ("str", "list[int]", ...); the field is where they part
    field = _common_prefix([_loc(err) for err in errors if _loc(err)[:1] == loc[:1]])
    if len(field) < len(loc):
        param = _param(field)
        name = next((str(x) for x in reversed(field) if not isinstance(x, int)), "")
        message = UNION_FIELDS.get(name, "has none of the accepted types (see /openapi.json)")
        return APIError(400, f"{param} {message}", param=param, code="invalid_type")
    param = _param(loc)
    if first["type"] == "missing":
        return APIError(400, f"{param} is required", param=param, code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return APIError(400, f"{param} is not a field this endpoint accepts; remove it", param=param,
                        code="unknown_parameter")
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
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


def _param(loc: tuple) -> str:
    """The OpenAI param of a location: ("messages", 0, "content") -> messages[0].content."""
    param = str(loc[0])
    for part in loc[1:]:
        param += f"[{part}]" if isinstance(part, int) else f".{part}"
    return param


def install_error_handlers(app: FastAPI) -> None:
    async def handle(request: Request, e: Exception) -> JSONResponse:
        return as_api_error(e).response()

    for kind in (APIError, RequestValidationError, HTTPException, InvalidRequest, AdapterError, Overloaded,
                 Exception):
        app.add_exception_handler(kind, handle)


class JSONBodies:
    """ASGI middleware for request bodies. Every one here is JSON: `curl -d` labels its body form-urlencoded,
    and FastAPI would then not parse it, so it (and an unlabelled body) is relabelled application/json. None
    may exceed max_bytes: 413 with an OpenAI error body (Starlette's own limit answers in plain text), at once
    when Content-Length says so, else when the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        content_type = headers.get(b"content-type", b"")
        if not content_type or content_type.startswith(b"application/x-www-form-urlencoded"):
            scope = dict(scope, headers=[*((k, v) for k, v in scope["headers"] if k != b"content-type"),
                                         (b"content-type", b"application/json")])
        too_large = HTTPException(413, f"the request body is larger than {self.max_bytes >> 20} MiB; send a "
                                       "shorter prompt (as token ids it takes ~7 bytes a token)")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await as_api_error(too_large).response()(scope, receive, send)
        num_bytes = 0

        async def receive_at_most() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                raise too_large  # an HTTPException: FastAPI's body reading lets it through to the handlers
            return message

        await self.app(scope, receive_at_most, send)
