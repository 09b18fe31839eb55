"""The HTTP server over a stub deployment whose requests never finish (no Ray, no model): a client that goes
away, from a stream or from a non-streaming request, cancels every request it opened."""

import asyncio
import socket
import threading
import time

import openai
import pytest
import uvicorn

from actors.http_server import build_app
from actors.openai_serving import OpenAIServing
from scheduling.outputs import RequestOutput


class EndlessStream:
    """Its prompt's ids, one output, then nothing until cancelled."""

    def __init__(self, prompt: list[int], cancelled: list):
        self.items = [prompt, RequestOutput("r", [7], "x", None)]
        self.cancelled = cancelled

    async def next(self):
        if self.items:
            return self.items.pop(0)
        await asyncio.Event().wait()  # never set: only cancellation ends this

    def cancel(self) -> None:
        self.cancelled.append(self)


class EndlessDeployment:
    def __init__(self):
        self.opened, self.cancelled = [], []

    def generate(self, prompt, params, adapter):
        self.opened.append(EndlessStream(prompt, self.cancelled))
        return self.opened[-1]

    async def model_info(self) -> dict:
        return {"tokenizer": None, "vocab_size": 100, "max_model_len": 64}


@pytest.fixture
def server():
    deployment = EndlessDeployment()
    app = build_app(OpenAIServing(deployment, "stub", "/stub", None, False, "fp_stub"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server to start")
    yield f"http://127.0.0.1:{port}", deployment
    server.should_exit = True
    thread.join()


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_dropped_non_streaming_request_cancels_each_of_its_choices(server):
    url, deployment = server
    impatient = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model="stub", prompt=[1, 2, 3], n=3, max_tokens=8)
    assert len(deployment.opened) == 3
    wait_for(lambda: len(deployment.cancelled) >= 3, "the three choices to be cancelled")
    assert {id(s) for s in deployment.cancelled} == {id(s) for s in deployment.opened}


def test_a_dropped_stream_cancels_each_of_its_choices(server):
    url, deployment = server
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    stream = api.completions.create(model="stub", prompt=[[1, 2], [3, 4]], max_tokens=8, stream=True)
    assert next(iter(stream)).choices[0].text == "x"
    assert deployment.cancelled == []  # running until the client goes
    stream.close()
    wait_for(lambda: len(deployment.cancelled) >= 2, "the two choices to be cancelled")
    assert {id(s) for s in deployment.cancelled} == {id(s) for s in deployment.opened}
