"""Request bodies as the OpenAI endpoints read them: JSON objects in UTF-8, at most max_bytes, of values every
later stage can take. Python's json reads more than JSON (NaN, Infinity, lone UTF-16 surrogates, nesting as
deep as the stack, integers of 4,300 digits) and each of those reached the tokenizer, the sampler or the stack
limit as a 500; here each is a 400 naming where it is, before the endpoint runs."""

import asyncio
import json
import math

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from http_api.errors import APIError, as_api_error, param_of

MAX_DEPTH = 64  # objects in objects: a JSON Schema of a tool or response_format nests a few levels a field
INT64 = 2 ** 63  # every integer field fits in 64 bits (token ids, seeds, counts)
JSON_TYPES = (b"application/json", b"")  # no content type: curl -d and friends, read as JSON
THREAD_MIN_BYTES = 1 << 16  # parsed off the event loop from here: parsing then outlasts a thread's hop
PARSED = "numaserve.json"  # the scope key under which JSONBodies leaves the body's value for ParsedJSONRoute


def media_type(content_type: bytes) -> bytes:
    return content_type.split(b";")[0].strip().lower()


def read_json(body: bytes):
    """The body's JSON value, else APIError(400) saying what is wrong and where."""
    if not body.strip():
        raise APIError(400, "the body is empty; send a JSON object of this endpoint's fields",
                       code="invalid_json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 (byte {e.start}); send JSON in UTF-8",
                       code="invalid_json") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise APIError(400, f"the body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON ({e.msg} at character {e.pos}); send a JSON object",
                       code="invalid_json") from None
    except ValueError:  # an integer longer than sys.get_int_max_str_digits()
        raise APIError(400, "the body holds an integer of thousands of digits; integers here fit in 64 bits",
                       code="invalid_value") from None
    check_values(value)
    return value


def check_values(value) -> None:
    """APIError(400) at the first value no field takes: a lone surrogate, a non-finite number, an integer past
    64 bits, nesting past MAX_DEPTH. Walks with a stack (no recursion: the depth is the input's)."""
    stack = [(value, ())]
    while stack:
        v, loc = stack.pop()
        if isinstance(v, str):
            _check_text(v, loc)
        elif isinstance(v, float) and not math.isfinite(v):
            raise _bad(loc, f"NaN and Infinity are not JSON numbers (got {v})")
        elif isinstance(v, int) and not isinstance(v, bool) and not -INT64 <= v < INT64:
            raise _bad(loc, f"an integer of {len(str(abs(v)))} digits is out of range; integers here fit in "
                            "64 bits")
        elif isinstance(v, dict | list):
            if len(loc) >= MAX_DEPTH:
                raise _bad(loc, f"the body nests deeper than {MAX_DEPTH} levels")
            if isinstance(v, list) and set(map(type, v)) <= {int} and v:  # token ids: one pass at C speed
                if not (-INT64 <= min(v) and max(v) < INT64):
                    raise _bad(loc, "an integer is out of range; integers here fit in 64 bits")
                continue
            for key, item in (v.items() if isinstance(v, dict) else enumerate(v)):
                if isinstance(key, str):
                    _check_text(key, loc)
                stack.append((item, (*loc, key)))


def _check_text(s: str, loc: tuple) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(loc, f"a string holds a lone UTF-16 surrogate (U+{ord(s[e.start]):04X}); send valid "
                        "Unicode") from None


def _bad(loc: tuple, message: str) -> APIError:
    param = param_of(loc) if loc else None
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


class JSONBodies:
    """ASGI middleware for POST bodies. Every one here is JSON: `curl -d` labels its body form-urlencoded,
    and FastAPI would then not parse it, so it (and an unlabelled body) is relabelled application/json;
    another media type is a 415, as vLLM answers. None may exceed max_bytes: 413 with an OpenAI error body
    (Starlette's own limit answers in plain text), at once when Content-Length says so, else when the bytes
    read pass the limit. The body is read whole, then parsed and checked by read_json (a large one in a worker
    thread), and handed on with its value in the scope for ParsedJSONRoute (FastAPI's route would parse it
    again). In the event loop, a large body's parse held up the actor's other requests."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

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
            scope[PARSED] = (read_json(body) if len(body) < THREAD_MIN_BYTES
                             else await asyncio.to_thread(read_json, body))
        except APIError as e:
            return await e.response()(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # http.disconnect, which the endpoints watch for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


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
