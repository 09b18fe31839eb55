"""Lifecycle: the HTTP app's outermost ASGI layer. It writes one access-log line per request and drains
the server when the deployment stops: new requests are answered 503 (OpenAI's error body, Retry-After),
those in flight finish up to a timeout, then are cancelled (their streams end, their requests are aborted).

The access line's request id is the response's X-Request-Id when an inner layer set one, else one made here
(and sent as X-Request-Id), so the line always names the id the client saw.
"""

import asyncio
import logging
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from http_api.errors import RETRY_AFTER_S, APIError

DRAIN_POLL_S = 0.05
CANCEL_WAIT_S = 5.0  # for the cancelled requests to unwind
access_log = logging.getLogger("numaserve.access")


class Lifecycle:
    def __init__(self, app: ASGIApp):
        self.app = app
        self.draining = False
        self.in_flight: set[asyncio.Task] = set()  # the tasks uvicorn runs the requests in
        self.cancelled: set[asyncio.Task] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, request_id = "-", ""  # "-": no response began

        async def send_logged(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                request_id = next((v.decode() for k, v in headers if k.lower() == b"x-request-id"), "")
                if not request_id:
                    request_id = uuid.uuid4().hex
                    message = dict(message, headers=[*headers, (b"x-request-id", request_id.encode())])
            await send(message)

        task = asyncio.current_task()
        try:
            if self.draining:
                refusal = APIError(503, "the server is shutting down; retry in a moment (another replica may "
                                        "answer)", type="server_error", code="server_shutting_down",
                                   headers={"Retry-After": str(RETRY_AFTER_S)})
                await refusal.response()(scope, receive, send_logged)
            else:
                self.in_flight.add(task)
                await self.app(scope, receive, send_logged)
        except asyncio.CancelledError:
            if task not in self.cancelled:
                raise
            status = "aborted"  # by drain(): uvicorn closes the connection of a response left unfinished
        finally:
            self.in_flight.discard(task)
            self.cancelled.discard(task)
            access_log.info("%s %s %s %s %.1f ms", request_id or "-", scope["method"], scope["path"], status,
                            (time.perf_counter() - start) * 1e3)

    async def drain(self, timeout_s: float) -> int:
        """Refuses new requests from now on, waits up to timeout_s for those in flight, then cancels the
        rest; -> how many were cancelled."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = list(self.in_flight)
        self.cancelled.update(left)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=CANCEL_WAIT_S)
        return len(left)


def log_access_to_stderr() -> None:
    """The access lines on this process's stderr (a Ray actor's reaches the driver's output, or its log
    file when the deployment is detached)."""
    if not access_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
