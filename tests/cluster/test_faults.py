"""The kill matrix: each actor of the deployment killed (Ray restarts it) under 32 concurrent greedy streams,
16 through the HTTP server (the official openai client) and 16 through ns.Client (4 of them with an adapter).
Every stream has a bounded wall time; per class: completed (tokens equal to the in-process engine's), failed
with the expected typed error, hung (always zero). Then new requests are served again.

Streams run 400 tokens and the kill comes as soon as the streams it can reach have their first tokens (an HTTP
server's kill waits for the HTTP streams only: the client streams, an adapter's load among them, may start
later), with the workers paused from just before the kill until just after it: the streams it reaches are in
flight when it lands, however fast this machine runs them."""

import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass

import openai
import pytest
import ray

import numaserve as ns
from benchmarks.ports import free_port
from tests.cluster.conftest import (
    reference_outputs,
    sim_config,
    wait_for,
    wait_for_restart,
    worker_pid,
)
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter

NAME = "faults"
MODEL = "llama"
NUM_HTTP, NUM_CLIENT, NUM_ADAPTER = 16, 16, 4  # the last NUM_ADAPTER client streams use adapter "a"
GREEDY = ns.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
STREAM_BOUND_S = 90.0  # a stream not ended by then is hung
BACK_WITHIN_S = 120.0  # a restarted actor serves again within this (a bound on liveness, not speed)
PROMPTS = [random_prompt(6 + i % 11, seed=100 + i) for i in range(NUM_HTTP + NUM_CLIENT)]


@dataclass
class Outcome:
    """One stream's, filled in as it runs: a hung one shows how far it got."""
    via: str  # "http" | "client"
    text: str = ""
    token_ids: tuple = ()
    error: Exception | None = None
    finished: bool = False
    request_id: str = ""
    num_chunks: int = 0
    hung: bool = False  # not ended within STREAM_BOUND_S after the kill

    def __str__(self) -> str:
        return (f"{self.via} stream {self.request_id or '(no chunk)'}: {self.num_chunks} chunks, "
                f"{len(self.text)} chars, {len(self.token_ids)} tokens, finished {self.finished}, "
                f"error {self.error!r}")


def is_connection_error(e: Exception) -> bool:
    return isinstance(e, (openai.APIConnectionError, OSError)) or any(
        word in type(e).__name__ for word in ("Connect", "Protocol", "Read", "Network"))


@pytest.fixture(scope="module")
def adapter_dir(llama_dir, tmp_path_factory):
    return make_adapter(llama_dir, tmp_path_factory.mktemp("faults") / "a", seed=1)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return sim_config("two_numa_sim", max_queued_per_worker=16, engine={"max_num_seqs": 16},
                      adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
                      http={"port": free_port(), "host": "127.0.0.1"})


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, config, adapter_dir):
    client = ns.serve(config, model=llama_dir, name=NAME)
    client.register_adapter("a", adapter_dir)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def api(client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0,
                         timeout=STREAM_BOUND_S)


@pytest.fixture(scope="module")
def expected(llama_dir, config, adapter_dir) -> list[ns.Completion]:
    num_base = NUM_HTTP + NUM_CLIENT - NUM_ADAPTER
    return (reference_outputs(llama_dir, config, PROMPTS[:num_base], GREEDY)
            + reference_outputs(llama_dir, config, PROMPTS[num_base:], GREEDY, adapters={"a": adapter_dir}))


def _http_stream(api, prompt, started, out: Outcome) -> Outcome:
    try:
        stream = api.completions.create(model=MODEL, prompt=prompt, max_tokens=GREEDY.max_tokens,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        started.release()  # the server answers a stream's headers once its first token is out (its text
        for chunk in stream:  # may be empty for a while: a token's bytes need not end a character)
            out.request_id, out.num_chunks = chunk.id, out.num_chunks + 1
            if chunk.choices and chunk.choices[0].text:
                out.text += chunk.choices[0].text
            out.finished = out.finished or bool(chunk.choices and chunk.choices[0].finish_reason)
    except (openai.APIError, OSError) as e:
        out.error = e
    except Exception as e:  # the HTTP library's own, when the connection breaks mid-stream
        if not is_connection_error(e):
            raise
        out.error = e
    return out


def _client_stream(client, prompt, adapter, started, out: Outcome) -> Outcome:
    try:
        for chunk in client.stream(prompt, GREEDY, adapter=adapter):
            out.request_id, out.num_chunks = chunk.request_id, out.num_chunks + 1
            if not out.token_ids:
                started.release()  # once per stream
            out.text += chunk.text
            out.token_ids += tuple(chunk.token_ids)
            out.finished = chunk.finish_reason is not None
    except ns.NumaserveError as e:
        out.error = e
    return out


def run_killing(client, api, actor: str, reaches: str = "all") -> tuple[list[Outcome], int]:
    """The 32 streams, `actor` killed once every stream it reaches ("all" | "http") has its first tokens:
    (outcome per stream, marked hung if it had not ended STREAM_BOUND_S later; how many of the streams it
    reaches had not finished when the kill came).

    Each stream runs in a daemon thread: a hung one is counted, never waited for (a pool's shutdown would
    wait for it forever). Whatever fails, every worker is resumed before this returns or raises."""
    wait_for(lambda: serves(client, api), BACK_WITHIN_S, "the deployment to serve before the kill")
    http_started, client_started = threading.Semaphore(0), threading.Semaphore(0)
    num_base = NUM_HTTP + NUM_CLIENT - NUM_ADAPTER
    outcomes = [Outcome("http") for _ in range(NUM_HTTP)] + [Outcome("client") for _ in range(NUM_CLIENT)]
    futures = [in_daemon_thread(_http_stream, api, p, http_started, outcomes[i])
               for i, p in enumerate(PROMPTS[:NUM_HTTP])]
    futures += [in_daemon_thread(_client_stream, client, p, "a" if i >= num_base else None, client_started,
                                 outcomes[i])
                for i, p in enumerate(PROMPTS) if i >= NUM_HTTP]
    gates = [http_started] * NUM_HTTP + ([client_started] * NUM_CLIENT if reaches == "all" else [])
    for gate in gates:  # every stream the kill reaches has its first tokens
        assert gate.acquire(timeout=60), "the streams did not start"
    workers = set(client.stats()["workers"])
    try:
        # paused, the workers hold every stream in flight while the kill lands, whatever this machine's speed
        assert set(client.pause_generation()) == workers, "a worker did not pause"
        num_running = sum(not f.done() for f in futures[:len(gates)])
        ray.kill(ray.get_actor(f"{NAME}.{actor}", namespace="numaserve"), no_restart=False)
    finally:  # through the router (restarted, if it was the one killed); a killed worker comes back unpaused
        wait_for(lambda: answer(client.resume_generation) is not None, BACK_WITHIN_S, "the workers to resume")
    wait(futures, timeout=STREAM_BOUND_S)
    for future, outcome in zip(futures, outcomes):
        if future.done():
            future.result()  # an unexpected exception in the stream's thread fails the test here
        else:
            outcome.hung = True
    if any(o.hung for o in outcomes):
        print(f"after killing {actor}: workers {answer(lambda: client.stats()['workers'])}")
    return outcomes, num_running


def in_daemon_thread(fn, *args) -> Future:
    """fn(*args) run in a daemon thread; its Future."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (the Future carries it to the test)
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def exact(outcome: Outcome, reference: ns.Completion) -> bool:
    if outcome.error is not None or not outcome.finished or outcome.text != reference.text:
        return False
    return outcome.via == "http" or list(outcome.token_ids) == reference.token_ids


def counts(outcomes, expected) -> dict:
    """completed, failed, hung; with the streams that did none of these (each described) under "other"."""
    completed = [not o.hung and exact(o, e) for o, e in zip(outcomes, expected)]
    failed = [not o.hung and o.error is not None for o in outcomes]
    result = {"completed": sum(completed), "failed": sum(failed), "hung": sum(o.hung for o in outcomes)}
    others = [str(o) for o, c, f in zip(outcomes, completed, failed) if o.hung or not (c or f)]
    return result | ({"other": others} if others else {})


def answer(call):
    """call()'s value, or None while the actor it reaches is restarting."""
    try:
        return call()
    except ns.Unavailable:
        return None


def serves(client, api) -> bool:
    try:
        done = client.generate([5, 6, 7], ns.SamplingParams(max_tokens=3, ignore_eos=True))
        r = api.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3,
                                   extra_body={"ignore_eos": True})
    except (ns.NumaserveError, openai.APIError):
        return False
    return len(done.token_ids) == 3 and r.usage.completion_tokens == 3


@pytest.mark.load_sensitive
def test_a_killed_worker_loses_no_stream_of_32(client, api, expected):
    victim_pid = worker_pid(client, "local-numa0-0")
    outcomes, num_running = run_killing(client, api, "worker.local-numa0-0")
    assert num_running > 0
    assert counts(outcomes, expected) == {"completed": 32, "failed": 0, "hung": 0}
    wait_for_restart(client, "local-numa0-0", victim_pid, BACK_WITHIN_S)
    assert serves(client, api)


@pytest.mark.load_sensitive
def test_a_killed_scheduler_restarts_from_fresh_telemetry_and_no_stream_is_lost(client, api, expected):
    before = client.stats()["policies"]
    outcomes, num_running = run_killing(client, api, "scheduler")
    assert num_running > 0
    assert counts(outcomes, expected) == {"completed": 32, "failed": 0, "hung": 0}
    # the new scheduler knows nothing it was not told again: every worker's policy is back from its reports
    after = wait_for(lambda: ((p := answer(lambda: client.stats()["policies"])) and "error" not in p
                              and len(p) == 2 and p),
                     BACK_WITHIN_S, "the restarted scheduler's policies")
    assert set(after) == set(before)
    assert serves(client, api)


@pytest.mark.load_sensitive
def test_a_killed_adapter_cache_reloads_its_registry_and_adapter_streams_go_on(client, api, expected):
    outcomes, num_running = run_killing(client, api, "adapters")
    assert num_running > 0
    assert counts(outcomes, expected) == {"completed": 32, "failed": 0, "hung": 0}
    cache = wait_for(lambda: answer(lambda: client.stats()["adapter_cache"]), BACK_WITHIN_S,
                     "the adapter cache")
    assert cache["num_adapters"] == 1  # its registry, reloaded
    assert client.generate(PROMPTS[-1], GREEDY, adapter="a").token_ids == expected[-1].token_ids


@pytest.mark.load_sensitive
def test_a_killed_http_server_fails_only_its_connections_then_serves_again(client, api, expected):
    outcomes, num_running = run_killing(client, api, "http", reaches="http")
    assert num_running > 0
    http, direct = outcomes[:NUM_HTTP], outcomes[NUM_HTTP:]
    assert counts(direct, expected[NUM_HTTP:]) == {"completed": NUM_CLIENT, "failed": 0, "hung": 0}
    http_counts = counts(http, expected[:NUM_HTTP])
    assert (http_counts["hung"] == 0
            and http_counts["completed"] + http_counts["failed"] == NUM_HTTP), http_counts
    assert http_counts["failed"] > 0  # the kill came while they streamed
    assert all(is_connection_error(o.error) for o in http if o.error is not None)  # nothing else
    start = time.monotonic()
    wait_for(lambda: serves(client, api), BACK_WITHIN_S, "the HTTP server to serve again")
    print(f"http kill: {http_counts}, served again after {time.monotonic() - start:.1f} s")


@pytest.mark.load_sensitive
def test_a_killed_router_loses_no_stream_and_new_requests_are_served_after_its_restart(client, api, expected):
    """No stream passes through the router (it only places them): its death ends none, each ends exactly as
    undisturbed, and the admissions asked while it restarts wait for it."""
    old_pid = client.stats()["router_pid"]
    outcomes, num_running = run_killing(client, api, "router")
    assert num_running > 0
    assert counts(outcomes, expected) == {"completed": 32, "failed": 0, "hung": 0}
    assert client.stats()["router_pid"] != old_pid  # it did restart
    assert serves(client, api)
