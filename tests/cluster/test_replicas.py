"""Two HTTP actors and two routers serve one deployment (issue #27): both HTTP actors take connections on one
port (SO_REUSEPORT); a session lands on the same worker whichever router admits it; each worker's admission
bound holds across both routers (the surplus gets Overloaded / 429); a router lost for good leaves its
callers to the other."""

import threading

import pytest
import ray
import requests

import numaserve as ns
from actors.client import Client
from benchmarks.ports import free_port
from scheduling.session_hash import session_ranking
from tests.cluster.conftest import paused, sim_config, wait_for
from tests.conftest import random_prompt

NAME = "replicas"
BOUND = 2  # max_num_seqs 2 + max_queued_per_worker 0: each worker holds at most 2 admitted requests
SHORT = ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def config():
    return sim_config("two_numa_sim", max_queued_per_worker=0, engine={"max_num_seqs": BOUND},
                      http={"port": free_port(), "replicas": 2}, router={"replicas": 2})


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, config):
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


def actor(name: str):
    return ray.get_actor(f"{NAME}.{name}", namespace="numaserve")


def pinned(client, *routers: str) -> Client:
    """A client of the deployment that admits through these routers, in this order."""
    return Client(NAME, [actor(r) for r in routers], client.adapter_cache, client.http_url)


def served(client) -> dict[str, int]:
    return {w: s["num_requests"] for w, s in client.stats()["workers"].items()}


def complete(url: str, seed: int) -> requests.Response:
    # a new connection each (requests opens one per call): the kernel picks an HTTP actor for each
    return requests.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": random_prompt(6, seed=seed), "max_tokens": 4, "temperature": 0, "ignore_eos": True})


def test_both_http_actors_serve_connections_on_one_port(client):
    before = [ray.get(actor(h).stats.remote()) for h in ("http", "http.1")]
    assert before[0]["pid"] != before[1]["pid"]
    for i in range(16):
        r = complete(client.http_url, seed=i)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    after = [ray.get(actor(h).stats.remote()) for h in ("http", "http.1")]
    counts = [a["num_requests"] - b["num_requests"] for a, b in zip(after, before)]
    assert sum(counts) == 16 and min(counts) > 0, counts  # all 16 on one actor: p = 2 ** -15


def test_a_session_lands_on_the_same_worker_whichever_router_admits_it(client):
    via = [pinned(client, "router"), pinned(client, "router.1")]
    workers = sorted(client.stats()["workers"])
    for i, session in enumerate(["chat-a", "chat-b", "chat-c", "chat-d"]):
        home = session_ranking(session, workers)[0]
        for turn in range(4):
            before = served(client)
            done = via[turn % 2].generate(random_prompt(5, seed=100 * i + turn), SHORT, session=session)
            assert len(done.token_ids) == 4
            after = served(client)
            assert {w for w in workers if after[w] > before[w]} == {home}, (session, turn)


def test_the_admission_bound_holds_across_both_routers_and_the_surplus_is_refused(client):
    via = [pinned(client, "router"), pinned(client, "router.1")]
    long = ns.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outcomes: list = []

    def request(i: int) -> None:
        try:
            outcomes.append(via[i % 2].generate(random_prompt(6, seed=300 + i), long))
        except ns.Overloaded as e:
            outcomes.append(e)

    num_requests = 10
    with paused(client):  # nothing admitted finishes: what the workers hold is what they admitted
        threads = [threading.Thread(target=request, args=(i,)) for i in range(num_requests)]
        for t in threads:
            t.start()
        num_slots = BOUND * len(client.stats()["workers"])
        wait_for(lambda: len(outcomes) == num_requests - num_slots, 60, "the surplus to be refused")
        held = {w: len(ray.get(actor(f"worker.{w}").admission_ids.remote()))
                for w in client.stats()["workers"]}
        assert all(n <= BOUND for n in held.values()), held
        assert sum(held.values()) == num_slots, held
        assert all(isinstance(o, ns.Overloaded) for o in outcomes)
        r = complete(client.http_url, seed=399)
        assert r.status_code == 429, r.text  # either HTTP actor, either router: the workers are full
    for t in threads:
        t.join(timeout=60)
    done = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(done) == num_slots and all(len(d.token_ids) == 8 for d in done)


def test_with_one_router_gone_for_good_requests_are_served_through_the_other(client):
    """Last in this module: it leaves the deployment with one router."""
    caller = pinned(client, "router.1", "router")
    stream = caller.stream(random_prompt(6, seed=500), SHORT)
    first = next(stream)  # admitted by router.1, streaming from its worker
    ray.kill(actor("router.1"), no_restart=True)
    assert len(first.token_ids) + sum(len(c.token_ids) for c in stream) == 4  # no stream passes a router
    done = caller.generate(random_prompt(6, seed=501), SHORT)
    assert len(done.token_ids) == 4
    for i in range(8):  # HTTP actor 1 admitted through router.1 first
        r = complete(client.http_url, seed=600 + i)
        assert r.status_code == 200, r.text
