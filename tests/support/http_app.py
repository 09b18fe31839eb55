"""An ASGI app served by uvicorn in a thread of the test process on 127.0.0.1 (the HTTP tests without Ray)."""

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

START_TIMEOUT_S = 20.0  # generous: a loaded machine starts the server in well under a second


@contextlib.contextmanager
def served(app) -> Iterator[str]:
    """Serve app until the block ends -> its base URL (http://127.0.0.1:port)."""
    sock = socket.create_server(("127.0.0.1", 0))  # bound here and handed over: no other socket takes it
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive(), "the server did not stop"
