"""A caller that goes away has its requests aborted on the workers within a second, their KV blocks freed:
a driver streaming through ns.connect killed with SIGKILL, the HTTP actor killed mid-stream
(actors/caller_lease.py: Ray cancels neither, and tells a worker of its caller's death only 2 s later), an
HTTP connection dropped (RequestStream.cancel). A caller that only stalled past its lease resumes its stream.

The workers are paused from before the requests reach them (advanced a step at a time until each stream has
its first token), so the requests hold KV and stay in flight until aborted, whatever this machine's speed:
only an abort frees their blocks. The bound is GONE_WITHIN_S from the kill plus one stats round trip
measured just before (the poll's own cost under the same load)."""

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import ray
import requests

import numaserve as ns
from actors.caller_lease import LEASE_S
from benchmarks.ports import free_port
from tests.cluster.conftest import advance, paused, queued, sim_config, wait_for
from tests.conftest import random_prompt

NAME = "gone"
MODEL = "llama"
GONE_WITHIN_S = 1.0
NUM_STREAMS = 3
MAX_TOKENS = 480
REPO = Path(__file__).resolve().parents[2]

DRIVER = """
import sys
import threading
import numaserve as ns
from actors.caller_lease import LEASE_S
from tests.conftest import random_prompt
client = ns.connect(sys.argv[1], address=sys.argv[2])
params = ns.SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True)
num_streams = int(sys.argv[4])
started = threading.Barrier(num_streams, action=lambda: print("streaming", flush=True))
def read(i):
    stream = client.stream(random_prompt(8, seed=i), params)
    next(stream)
    started.wait()
    for _ in stream:
        pass
threads = [threading.Thread(target=read, args=(i,)) for i in range(num_streams)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir):
    config = sim_config("two_numa_sim", stream_interval_ms=0, engine={"max_num_seqs": 8},
                        http={"port": free_port(), "host": "127.0.0.1"})
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


def workers(client) -> list:
    return [ray.get_actor(f"{NAME}.worker.{w}", namespace="numaserve") for w in client.stats()["workers"]]


def used_blocks(handles) -> tuple[int, int]:
    """(KV blocks in use over the workers, requests in their engines), asked of each worker directly."""
    stats = ray.get([w.stats.remote() for w in handles])
    return (sum(s["num_used_blocks"] for s in stats),
            sum(s["num_running"] + s["num_waiting"] for s in stats))


def first_tokens_while_paused(client, started) -> None:
    """Paused workers: wait for the NUM_STREAMS requests to reach them, then step until started() (each
    stream has its first token; a few of MAX_TOKENS at most)."""
    wait_for(lambda: queued(client) == NUM_STREAMS, 60, "the requests to reach the workers")
    for _ in range(100):
        if started():
            return
        advance(client)
        time.sleep(0.05)
    raise AssertionError("the streams did not get their first tokens")


def wait_freed(handles, idle_blocks: int, start: float, bound_s: float, what: str) -> float:
    """Seconds from start until the workers hold no request and idle_blocks KV blocks; fails past bound_s."""
    while True:
        blocks, num_requests = used_blocks(handles)
        elapsed = time.monotonic() - start
        if blocks == idle_blocks and num_requests == 0:
            print(f"{what}: KV freed {elapsed:.3f} s after")
            return elapsed
        assert elapsed < bound_s, f"{what}: {num_requests} requests, {blocks} blocks after {elapsed:.2f} s"
        time.sleep(0.01)


def idle_state(client) -> tuple[list, int, float]:
    """(the worker handles, their KV blocks in use when idle, a stats round trip's seconds)."""
    handles = workers(client)
    wait_for(lambda: used_blocks(handles)[1] == 0, 60, "an idle deployment")
    start = time.monotonic()
    blocks, _ = used_blocks(handles)
    return handles, blocks, time.monotonic() - start


@pytest.mark.load_sensitive
def test_a_killed_driver_has_its_requests_aborted_within_a_second(client, ray_cluster):
    handles, idle_blocks, round_trip = idle_state(client)
    with paused(client):
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, NAME, ray_cluster.address, str(MAX_TOKENS), str(NUM_STREAMS)],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            line: list[str] = []
            reader = threading.Thread(target=lambda: line.append(driver.stdout.readline()), daemon=True)
            reader.start()
            first_tokens_while_paused(client, lambda: line == ["streaming\n"])
            assert used_blocks(handles)[0] > idle_blocks
            start = time.monotonic()
            driver.kill()
        finally:
            driver.kill()
            driver.wait()
        wait_freed(handles, idle_blocks, start, GONE_WITHIN_S + round_trip, "driver killed (SIGKILL)")
    assert num_callers_expired(handles) >= 1


def num_callers_expired(handles) -> int:
    return sum(s["num_callers_expired"] for s in ray.get([w.stats.remote() for w in handles]))


def healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).ok
    except requests.ConnectionError:
        return False


@pytest.mark.load_sensitive
@pytest.mark.parametrize("how", ["http actor killed", "connection dropped"])
def test_http_callers_gone_have_their_requests_aborted_within_a_second(client, how):
    api = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0)
    wait_for(lambda: healthy(client.http_url), 120, "the HTTP server (restarted, after its kill)")
    handles, idle_blocks, round_trip = idle_state(client)
    with ThreadPoolExecutor(NUM_STREAMS) as pool, paused(client):
        # each returns once its first token is out (the server's headers wait for it)
        opening = [pool.submit(api.completions.create, model=MODEL, prompt=random_prompt(8, seed=50 + i),
                               max_tokens=MAX_TOKENS, temperature=0, stream=True,
                               extra_body={"ignore_eos": True}) for i in range(NUM_STREAMS)]
        first_tokens_while_paused(client, lambda: all(o.done() for o in opening))
        streams = [o.result() for o in opening]
        assert used_blocks(handles)[0] > idle_blocks
        start = time.monotonic()
        if how == "http actor killed":
            ray.kill(ray.get_actor(f"{NAME}.http", namespace="numaserve"), no_restart=False)
        else:
            for s in streams:
                s.close()
        wait_freed(handles, idle_blocks, start, GONE_WITHIN_S + round_trip, how)


@pytest.mark.load_sensitive
def test_a_caller_whose_event_loop_stalls_past_its_lease_resumes_its_stream_exactly(client):
    """Its worker takes it for dead (its lease lapsed), aborts its request and ends its channel; once the
    caller's loop runs again it calls that worker again naming the request, learns it is gone (CallerGone),
    and resumes it where it was, on the worker the router gives: the tokens are the undisturbed run's."""
    params = ns.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = random_prompt(8, seed=70)
    expected = client.generate(prompt, params).token_ids
    handles = workers(client)
    expired = num_callers_expired(handles)
    chunks: list = []
    with ThreadPoolExecutor(1) as pool:
        with paused(client):
            reading = pool.submit(lambda: [chunks.append(c) for c in client.stream(prompt, params)])
            wait_for(lambda: queued(client) == 1, 60, "the request to reach its worker")
            for _ in range(100):
                if chunks:
                    break
                advance(client)
                time.sleep(0.05)
            assert chunks and not chunks[-1].finish_reason

            async def stall() -> None:
                time.sleep(2 * LEASE_S + 0.5)  # noqa: ASYNC251  (the point: the caller's loop blocked)

            client._streams.run(stall())
            wait_for(lambda: num_callers_expired(handles) > expired, 30, "the caller taken for dead")
            wait_for(lambda: queued(client) == 1, 60, "the request to be resumed on a worker")
        reading.result(timeout=120)
    assert [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].finish_reason == "length"
