"""actors/http_lifecycle.Lifecycle around a small app served by uvicorn (no Ray): the access line per request
with the id the client saw, the drain's 503 for new requests, in-flight requests finishing, and those left
at the timeout cancelled."""

import asyncio
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from http_api.lifecycle import Lifecycle


def build_app(release: asyncio.Event) -> Starlette:
    async def quick(request):
        """An id given as ?id= is set as an inner layer would set it."""
        given = request.query_params.get("id")
        return PlainTextResponse("ok", headers={"X-Request-Id": given} if given else None)

    async def held(request):
        """Streams one line, then waits for `release`, then one more line."""
        async def lines():
            yield b"first\n"
            await release.wait()
            yield b"last\n"
        return StreamingResponse(lines())

    return Starlette(routes=[Route("/quick", quick), Route("/held", held)])


@pytest.fixture
def served():
    """.base (url), .lifecycle, .run(coroutine) on the server's loop (-> its result), .start(coroutine) (-> a
    future), .release (the held streams' event)"""
    loop = asyncio.new_event_loop()
    release = asyncio.Event()
    lifecycle = Lifecycle(build_app(release))
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(lifecycle, lifespan="off", log_config=None, log_level="critical"))
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),),
                              daemon=True)
    thread.start()

    def start(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop)

    def run(coroutine, timeout_s: float = 30):
        return start(coroutine).result(timeout_s)

    async def started():
        while not server.started:
            await asyncio.sleep(0.01)
    run(started())
    yield SimpleNamespace(base=f"http://127.0.0.1:{sock.getsockname()[1]}", lifecycle=lifecycle, run=run,
                          start=start, release=release)
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_each_request_is_logged_once_with_the_id_the_client_saw(served, caplog):
    base = served.base

    def access_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "numaserve.access"]
    with caplog.at_level(logging.INFO, logger="numaserve.access"):
        made = requests.get(f"{base}/quick", timeout=10)
        given = requests.get(f"{base}/quick?id=abc123", timeout=10)
        missing = requests.get(f"{base}/nowhere", timeout=10)
        deadline = time.monotonic() + 10  # a line is written after its answer: the client may be first
        while len(access_lines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    made_id = made.headers["X-Request-Id"]
    assert len(made_id) == 32 and given.headers["X-Request-Id"] == "abc123"
    assert [line.rsplit(" ", 2)[0] for line in access_lines()] == [
        f"{made_id} GET /quick 200", "abc123 GET /quick 200",
        f"{missing.headers['X-Request-Id']} GET /nowhere 404"]


def test_a_drain_refuses_new_requests_and_waits_for_those_in_flight(served):
    held = requests.get(f"{served.base}/held", stream=True, timeout=30)
    lines = held.iter_lines()
    assert next(lines) == b"first"
    draining = served.start(served.lifecycle.drain(30))
    refused = requests.get(f"{served.base}/quick", timeout=10)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    assert not draining.done()
    served.run(_set(served.release))
    assert list(lines) == [b"last"]
    assert draining.result(10) == 0


def test_a_drain_cancels_what_is_left_at_its_timeout(served, caplog):
    held = requests.get(f"{served.base}/held", stream=True, timeout=30)
    lines = held.iter_lines()
    assert next(lines) == b"first"
    with caplog.at_level(logging.INFO, logger="numaserve.access"):
        assert served.run(served.lifecycle.drain(0.2)) == 1
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        list(lines)  # the connection closed before the response's end
    assert any(r.getMessage().split(" ")[1:4] == ["GET", "/held", "aborted"] for r in caplog.records)


async def _set(event: asyncio.Event) -> None:
    event.set()
