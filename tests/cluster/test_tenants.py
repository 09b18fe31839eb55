"""Tenants and limits on a deployment with API keys (http: api_keys, max_prompt_tokens, max_tokens_cap,
max_concurrent_per_client), over loopback with the official openai client and through the Python client:
a second tenant's identical prompt gets no prefix-cache hit while the same tenant's does, keys are checked,
every limit answers its status with an OpenAI body and the deployment serves on; the engines' decisions
reach client.stats(), and `numaserve stats --watch` draws its table from the live deployment."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

import numaserve as ns
from benchmarks.ports import free_port
from numaserve.cli import main
from tests.cluster.conftest import paused, queued, sim_config, wait_for
from tests.conftest import random_prompt

NAME = "tenants"
KEYS = ("key-alpha", "key-beta")
GREEDY = ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir):
    config = sim_config("two_numa_sim", http={"port": free_port(), "api_keys": KEYS, "max_prompt_tokens": 100,
                                              "max_tokens_cap": 480, "max_concurrent_per_client": 2})
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


def api(client, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{client.http_url}/v1", api_key=key, max_retries=0)


def prefix_hits(client) -> int:
    return sum(w["metrics"]["values"]["prefix_cache_hits"] for w in client.stats()["workers"].values()
               if "metrics" in w)


def complete(client, key: str, prompt, **kw):
    return api(client, key).completions.create(model="llama", prompt=prompt,
                                               max_tokens=kw.pop("max_tokens", 2),
                                               extra_body={"ignore_eos": True} | kw)


def test_a_second_tenant_gets_no_prefix_hit_where_the_same_tenant_does(client):
    prompt = random_prompt(49, seed=401)  # three full blocks of 16 and the token that computes anew
    complete(client, KEYS[0], prompt)
    before = prefix_hits(client)
    complete(client, KEYS[1], prompt)  # another key: another salt, whichever worker serves it
    assert prefix_hits(client) == before
    complete(client, KEYS[0], prompt)  # the same key: routed to its cached prefix
    assert prefix_hits(client) - before >= 48


def test_the_python_clients_cache_salt_separates_tenants_on_one_worker(client):
    prompt = random_prompt(49, seed=402)
    client.generate(prompt, GREEDY, session="t", cache_salt="tenant-a")  # the session pins one worker
    before = prefix_hits(client)
    client.generate(prompt, GREEDY, session="t", cache_salt="tenant-b")
    assert prefix_hits(client) == before
    client.generate(prompt, GREEDY, session="t", cache_salt="tenant-a")
    assert prefix_hits(client) - before >= 48


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_missing_or_wrong_key_is_a_401_that_does_not_echo_it_and_service_goes_on(client, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = requests.post(f"{client.http_url}/v1/completions", json={"prompt": "hi"}, headers=headers, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert key is None or key not in r.text
    assert requests.get(f"{client.http_url}/health", timeout=30).status_code == 200  # open, as vLLM's
    assert complete(client, KEYS[0], [5, 6, 7]).usage.completion_tokens == 2


@pytest.mark.parametrize("prompt, max_tokens, code", [
    (random_prompt(101, seed=3), 2, "prompt_too_long"),
    ([5, 6, 7], 481, "max_tokens_exceeded"),
])
def test_the_length_limits_are_400s_naming_the_setting(client, prompt, max_tokens, code):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, KEYS[0], prompt, max_tokens=max_tokens)
    assert e.value.body["code"] == code
    assert complete(client, KEYS[0], [5, 6, 7]).usage.completion_tokens == 2


@pytest.mark.load_sensitive
def test_a_clients_third_open_request_is_a_429_and_other_clients_are_served(client):
    """Two streams of 480 tokens are open (the cap; the model holds 512 positions) when a third request of
    the same key comes: 429. The workers are paused until then, so both streams are still open."""
    def open_stream():  # returns once the stream's first token came (the server's headers wait for it)
        return api(client, KEYS[0]).completions.create(model="llama", prompt=[5, 6, 7], max_tokens=480,
                                                       stream=True, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(2) as pool:
        with paused(client):
            opening = [pool.submit(open_stream) for _ in range(2)]
            # both reached a worker's engine, so the server counted both
            wait_for(lambda: queued(client) == 2, 30, "the two streams to be admitted")
            with pytest.raises(openai.RateLimitError) as e:
                complete(client, KEYS[0], [5, 6, 7])
            assert "max_concurrent_per_client=2" in e.value.body["message"]
        streams = [o.result(timeout=60) for o in opening]
    assert complete(client, KEYS[1], [5, 6, 7]).usage.completion_tokens == 2  # another client
    for s in streams:
        s.close()
    wait_for(lambda: _serves(client), 30, "the client's slots to be released")


def _serves(client) -> bool:
    try:
        return complete(client, KEYS[0], [5, 6, 7]).usage.completion_tokens == 2
    except openai.RateLimitError:
        return False


@pytest.mark.load_sensitive
def test_a_deadline_that_expires_before_anything_is_sent_is_a_408(client):
    with paused(client):  # no token can come before the deadline: a paused worker still ends expired requests
        with pytest.raises(openai.APIStatusError) as e:
            complete(client, KEYS[0], [5, 6, 7], max_tokens=300, deadline_s=0.001)
        done = client.generate([5, 6, 7], ns.SamplingParams(max_tokens=300, ignore_eos=True, deadline_s=0.05))
    assert e.value.status_code == 408 and e.value.body["code"] == "deadline_exceeded"
    assert done.finish_reason == "abort" and done.token_ids == []
    assert complete(client, KEYS[0], [5, 6, 7]).usage.completion_tokens == 2


def test_decisions_reach_the_client_and_stats_watch_draws_the_live_table(client, capsys, monkeypatch):
    # rich's console width off a terminal: wide enough for the whole table
    monkeypatch.setenv("COLUMNS", "200")
    decisions = client.stats()["decisions"]
    assert len(decisions) == 2 and all(any(d["topic"] == "kernel" for d in ds) for ds in decisions.values())
    assert main(["stats", "--name", NAME, "--watch", "--count", "2", "--interval", "0.2"]) in (0, None)
    out = capsys.readouterr().out
    assert all(worker in out for worker in decisions) and "tokens/s" in out, out
