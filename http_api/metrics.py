"""The HTTP actor's request counts for /metrics: `http_requests_total{handler, method, status}`, as
prometheus-fastapi-instrumentator counts them for vLLM's API server, with the exact status code.

An ASGI middleware, outermost but for the CORS one, so that every answer is counted: a 401, a 413 of the
body check, a 404 of no route (handler "none", as the instrumentator names it), a 499 of a client gone
before the answer, a 500 of an error nothing handled (counted when the call raises before any answer).
"""

from collections import Counter

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "none"  # the handler label of a path no route matched


class CountRequests:
    def __init__(self, app: ASGIApp, counts: Counter):
        self.app = app
        self.counts = counts  # (handler, method, status) -> requests answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.counts[(handler_of(scope), scope["method"], str(status))] += 1


def handler_of(scope: Scope) -> str:
    """The path template of the route that served the request, or that would have: a body check answers
    before routing, and its 400 still counts under the route its path names."""
    route = scope.get("route")
    for candidate in () if route is not None else getattr(scope.get("app"), "routes", ()):
        if candidate.matches(scope)[0] != Match.NONE:
            route = candidate
            break
    return getattr(route, "path", UNMATCHED)
