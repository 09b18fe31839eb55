"""Request ids: each HTTP request's id, as vLLM gives one: the client's X-Request-Id when it sends a plain
one, else a fresh uuid. It is in `request.state.request_id` (the access log's), in the `request_id` context
variable (what an error raised anywhere under the request reads, streams included), and in the response's
X-Request-Id header. A 500's body names it and the server log ties it to the full exception
(http_api/errors.py)."""

import contextvars
import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
# a client's id is taken as it is when it is this plain and short (it goes into logs and bodies)
CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,64}")

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def new_request_id(sent: bytes | None) -> str:
    """The client's id if plain, else a uuid in its dashed form (no long hex run, which would read as an
    internal id)."""
    if sent is not None and CLIENT_ID.fullmatch(sent):
        return sent.decode()
    return str(uuid.uuid4())


class RequestIds:
    """ASGI middleware, outermost but CORS: assigns the id before anything can fail."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = new_request_id(dict(scope["headers"]).get(HEADER))
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id.set(rid)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[*message.get("headers", ()), (HEADER, rid.encode())])
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(token)
