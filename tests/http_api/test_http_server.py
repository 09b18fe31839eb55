"""The HTTP server over stub deployments (no Ray, no model): a client that goes away, from a stream or from a
non-streaming request, cancels every request it opened (the stub's requests never finish); with no worker
alive, /health and requests answer 503 with Retry-After and an OpenAI error body."""

import asyncio
import json
import socket
import time

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster_configs.errors import Overloaded, Unavailable
from http_api.app import build_app
from http_api.serving import OpenAIServing
from scheduling.outputs import RequestOutput
from tests.support.http_app import served


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

    def generate(self, prompt, params, adapter, cache_salt=None):
        self.opened.append(EndlessStream(prompt, self.cancelled))
        return self.opened[-1]

    async def model_info(self) -> dict:
        return {"tokenizer": None, "vocab_size": 100, "max_model_len": 64}

    async def metrics(self) -> list[dict]:
        return []  # no worker's snapshot: /metrics shows the HTTP counts alone


class RefusingStream:
    def __init__(self, error: Exception):
        self.error = error

    async def next(self):
        raise self.error

    def cancel(self) -> None:
        pass


class DownDeployment(EndlessDeployment):
    """No worker alive; requests refused as the router refuses them."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def generate(self, prompt, params, adapter, cache_salt=None):
        return RefusingStream(self.error)

    async def num_serving_workers(self) -> int:
        return 0


@pytest.fixture
def server(request):
    deployment = getattr(request, "param", None) or EndlessDeployment()
    app = build_app(OpenAIServing(deployment, "stub", "/stub", None, False, "fp_stub"))
    with served(app) as url:
        yield url, deployment


def wait_for(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.load_sensitive
def test_a_dropped_non_streaming_request_cancels_each_of_its_choices(server):
    url, deployment = server
    body = json.dumps({"model": "stub", "prompt": [1, 2, 3], "n": 3, "max_tokens": 8}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as conn:  # the client goes once all are open
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: stub\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: len(deployment.opened) == 3, "the three choices to be opened")
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


@pytest.mark.parametrize("server",
                         [DownDeployment(Unavailable("no worker is available; retry in a few seconds"))],
                         indirect=True)
def test_with_no_worker_alive_health_and_requests_answer_503_with_retry_after(server):
    url, _ = server
    health = requests.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.headers["Retry-After"] == "1"
    assert health.json()["error"]["code"] == "no_worker_available"
    r = requests.post(f"{url}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"] == {"message": "no worker is available; retry in a few seconds",
                                 "type": "server_error", "param": None, "code": "no_worker_available"}


@pytest.mark.parametrize("server", [DownDeployment(Overloaded("every worker's queue is full; retry later"))],
                         indirect=True)
def test_an_overloaded_deployment_answers_429_with_retry_after(server):
    url, _ = server
    r = requests.post(f"{url}/v1/completions", json={"prompt": [1, 2], "stream": True}, timeout=10)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"


def test_metrics_count_each_answer_by_route_method_and_status(server):
    url, _ = server
    bad = {"model": "stub", "prompt": "x", "max_tokens": -5}
    for _ in range(3):
        assert requests.get(f"{url}/version", timeout=20).status_code == 200
    for _ in range(2):
        assert requests.post(f"{url}/v1/completions", json=bad, timeout=20).status_code == 400
    assert requests.get(f"{url}/no/such/route", timeout=20).status_code == 404
    text = requests.get(f"{url}/metrics", timeout=20).text
    counts = {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
              for family in text_string_to_metric_families(text) for s in family.samples
              if s.name == "http_requests_total"}
    assert counts == {("/version", "GET", "200"): 3, ("/v1/completions", "POST", "400"): 2,
                      ("none", "GET", "404"): 1}  # this scrape is counted once it has answered
