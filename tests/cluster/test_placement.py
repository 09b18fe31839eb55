"""The router places requests and carries none of their tokens (actors/request_stream.py): it handles two
calls per request; a 5 MB prompt costs its own request only; a cold adapter's fetch costs its own request
only.

Timing bounds here are about blocking, not speed. A stall of the kind these tests guard against lasts
seconds, and stretches under load like everything else: a 5 MB prompt tokenized in the router's event loop
stalled everything for ~3 s (/health answering in 3.5 s); a worker's blocking fetch from a restarting adapter
cache stalls its every stream for the whole of the fetch's wait (the cache's new process: ~2 s alone, ~17 s
under the stress mode's burner). A loaded machine without any stall stretches /health and the gaps too, but
by less: under the burner (every core busy) /health took 0.5-1.6 s just before the 5 MB prompt, up to 1.26 s
during it (0.22 -> 0.61 s in another run), while the prompt's own POST took up to 2 s. So each test bounds
what it measures by the same load just before (/health, or a stream's longest gap):
- the 5 MB test: under twice that + ALLOWANCE_S = 1 s (1.2 s alone, a third of the 3.5 s stall);
- the cold-adapter test: under that + half the wait its own fetch provokes (a blocking fetch adds it whole).
Chunks are sent as soon as they are ready (stream_interval_ms=0), so a gap between two chunks of a stream is
a gap in its decoding."""

import contextlib
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import requests

import numaserve as ns
from benchmarks.ports import free_port
from tests.cluster.conftest import reference_outputs, sim_config, wait_for
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter

NAME = "placement"
ALLOWANCE_S = 1.0  # see the module's docstring
CACHE_RESTART_S = 0.5  # the adapter cache's restart takes at least this (a new process: ~2 s here)
GREEDY = ns.SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
LONG = ns.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    # max_loras=1: a worker that served "a" then "b" holds only "b"; "a" must be fetched again
    return sim_config("two_numa_sim", stream_interval_ms=0, engine={"max_num_seqs": 16, "max_loras": 1},
                      adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
                      http={"port": free_port(), "host": "127.0.0.1"}, router={"sweep_grace_s": 10})


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, config):
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


class Timed:
    """Client streams read in a thread, each chunk's arrival time kept: one stream, or with `until`, one after
    another until that event is set (the load must outlast what a test measures, at any decoding speed)."""

    def __init__(self, client, prompt, params, until: threading.Event | None = None, **kwargs):
        self.arrivals: list[list[float]] = []  # per stream
        self.token_ids: list[list[int]] = []  # per stream
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(client, prompt, params, until), kwargs=kwargs)
        self.thread.start()

    def _read(self, client, prompt, params, until, **kwargs):
        while True:
            self.arrivals.append([])
            self.token_ids.append([])
            with contextlib.closing(client.stream(prompt, params, **kwargs)) as chunks:
                for chunk in chunks:
                    self.arrivals[-1].append(time.monotonic())
                    self.token_ids[-1] += chunk.token_ids
                    self.first.set()
                    if until is not None and until.is_set():
                        return  # closing the stream aborts it
            if until is None or until.is_set():
                return

    def num_chunks(self) -> int:
        return sum(map(len, self.arrivals))

    def max_gap(self, start: float, end: float) -> float:
        """The longest wait for a stream's chunk during [start, end] (a wait that spans it counts whole)."""
        return max((b - a for times in self.arrivals for a, b in itertools.pairwise(times)
                    if b >= start and a <= end), default=0.0)

    def streamed_through(self, start: float, end: float) -> bool:
        """Whether chunks came before start and after end: it decoded all along (streams back to back)."""
        flat = [t for times in self.arrivals for t in times]
        return any(t <= start for t in flat) and any(t >= end for t in flat)


@pytest.fixture(scope="module")
def adapters(client, llama_dir, tmp_path_factory) -> None:
    """Adapters "a" and "b" registered once (the stress mode repeats the test that uses them)."""
    root = tmp_path_factory.mktemp("adapters")
    for name, seed in (("a", 1), ("b", 2)):
        client.register_adapter(name, make_adapter(llama_dir, root / name, seed=seed))


def calls(client) -> dict:
    return client.stats()["calls"]


def test_the_router_handles_at_most_two_calls_per_request_whatever_its_length(client, llama_dir, config):
    prompts = [random_prompt(8 + i, seed=300 + i) for i in range(16)]
    before = calls(client)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: client.generate(p, GREEDY).token_ids, prompts))
    assert got == [e.token_ids for e in reference_outputs(llama_dir, config, prompts, GREEDY)]
    assert all(len(ids) == 64 for ids in got)
    # finish is sent without waiting for it: let the last ones land
    after = wait_for(lambda: (c := calls(client))["finish"] - before["finish"] >= 16 and c, 30,
                     "the streams' finish calls")
    per_request = sum(after[k] - before[k] for k in after) / 16
    assert per_request <= 2, (before, after)
    print(f"router calls per request: {per_request:.2f} ({ {k: after[k] - before[k] for k in after} })")


def test_a_5_mb_prompt_is_refused_without_stalling_other_streams_or_health(client):
    url = client.http_url
    stop = threading.Event()
    streams = [Timed(client, random_prompt(8, seed=400 + i), LONG, until=stop) for i in range(8)]
    assert all(s.first.wait(120) for s in streams)
    # encoded beforehand: this process's own JSON encoding would hold its GIL (and its threads' clocks) ~40 ms
    body = json.dumps({"prompt": "hello world " * (5_000_000 // 12)}).encode()
    health: list[float] = []
    posting = threading.Event()
    session = requests.Session()  # one connection: /health's own time, not a TCP handshake's

    def poll_health():
        while posting.is_set():
            start = time.monotonic()
            assert session.get(f"{url}/health", timeout=30).status_code == 200
            health.append((start, time.monotonic() - start))
            time.sleep(0.02)

    posting.set()
    poller = threading.Thread(target=poll_health)
    poller.start()
    baseline_start = time.monotonic()
    wait_for(lambda: len(health) >= 20, 60, "/health to answer")  # the same load, without the big prompt
    start = time.monotonic()
    r = requests.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=120)
    end = time.monotonic()
    time.sleep(0.2)  # and just after it
    posting.clear()
    poller.join()
    stop.set()
    for s in streams:
        s.thread.join(120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
    assert "characters, more than max_model_len" in r.json()["error"]["message"]  # refused untokenized
    before = [seconds for at, seconds in health if at < start]
    during = [seconds for at, seconds in health if at >= start]
    assert during and max(during) < 2 * max(before) + ALLOWANCE_S, (before, during)
    gaps_before = [s.max_gap(baseline_start, start) for s in streams]
    gaps = [s.max_gap(start, end + 0.2) for s in streams]
    assert max(gaps) < 2 * max(gaps_before) + ALLOWANCE_S, (gaps_before, gaps, end - start)
    print(f"5 MB prompt: 400 after {end - start:.3f} s; /health max {max(before):.3f} s before, "
          f"{max(during):.3f} s during; stream gaps max {max(gaps_before):.3f} s before, "
          f"{max(gaps):.3f} s during")
    assert all(s.streamed_through(start, end + 0.2) for s in streams)  # the load lasted


def test_a_cold_adapter_fetch_does_not_stall_the_other_streams_of_its_worker(client, adapters):
    """Session stickiness puts everything on one worker. It served "a" then "b" (max_loras=1: it holds "b"
    only), so a request with "a" needs "a" fetched again, and the adapter cache is killed just before it:
    the fetch waits for the cache's restart (seconds) while the worker's 8 other streams go on."""
    before = {w: s["num_requests"] for w, s in client.stats()["workers"].items()}
    for name in ("a", "b"):
        client.generate([5, 6, 7], GREEDY, adapter=name, session="one-worker")
    stop = threading.Event()
    streams = [Timed(client, random_prompt(8, seed=500 + i), LONG, until=stop, session="one-worker")
               for i in range(8)]
    assert all(s.first.wait(120) for s in streams)
    baseline_start = time.monotonic()
    # the same load without a cold fetch: a few steps of every stream
    wait_for(lambda: all(s.num_chunks() >= 16 for s in streams), 120, "the streams' baseline chunks")
    baseline_end = time.monotonic()
    ray.kill(ray.get_actor(f"{NAME}.adapters", namespace="numaserve"), no_restart=False)
    start = time.monotonic()
    cold = Timed(client, [5, 6, 7], GREEDY, adapter="a", session="one-worker")
    assert cold.first.wait(120), "the cold adapter's request did not start"
    end = time.monotonic()
    cold.thread.join(120)
    stop.set()
    for s in streams:
        s.thread.join(120)
    waited = end - start
    assert waited > CACHE_RESTART_S  # it did wait for the cache's restart
    gaps_before = [s.max_gap(baseline_start, baseline_end) for s in streams]
    gaps = [s.max_gap(start, end) for s in streams]
    # a fetch that blocked the worker would hold its streams for about the whole wait; one that does not
    # leaves them the gaps of the load before, stretched by the restarting cache's process (it competes for
    # the 2 cores: gaps of ~0.25 s seen in a full-suite run, under 0.1 s alone)
    assert max(gaps) < max(gaps_before) + waited / 2, (gaps_before, gaps, f"cold: waited {waited:.2f} s")
    print(f"cold adapter: first token after {waited:.2f} s; the worker's other streams' gaps max "
          f"{max(gaps_before):.3f} s before, {max(gaps):.3f} s during")
    assert len(cold.token_ids[0]) == GREEDY.max_tokens
    assert all(s.streamed_through(start, end) for s in streams)  # the load lasted
    served = {w: s.get("num_requests", 0) - before[w] for w, s in client.stats()["workers"].items()}
    num_streams = sum(len(s.arrivals) for s in streams)
    assert sorted(served.values()) == [0, 3 + num_streams], served  # "a", "b", the cold one and the streams


def test_an_admission_whose_caller_went_away_without_finish_is_released(client, config):
    """A caller killed between admit and finish (here: an admission never streamed nor finished) is released
    by the router's sweep once sweep_grace_s has passed without its worker streaming it."""
    before = client.stats()["num_swept"]
    grace_s = config.router.sweep_grace_s
    admission = ray.get(client.router.admit.remote([5, 6, 7], GREEDY))
    worker_id = admission.placement.worker_id
    assert client.stats()["workers"][worker_id]["num_outstanding_requests"] >= 1
    wait_for(lambda: client.stats()["num_swept"] > before, grace_s + 60, "the sweep")
    wait_for(lambda: client.stats()["workers"][worker_id]["num_outstanding_requests"] == 0, 30,
             "the admission to be released")
