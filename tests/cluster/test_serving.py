"""The deployment of two_numa_sim.yaml (two workers pinned to one core each) through the client: exact
results under concurrency, placement, worker loss and rejoin, admission, adapters, bad input, job submit."""

import json
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
from ray.util.state import list_actors

import numaserve as ns
from actors.caller_lease import CallerGone
from actors.channel_wire import decode
from actors.deploy import DeploymentError
from actors.messages import GenerateRequest
from tests.cluster.conftest import (
    REPO,
    collect,
    paused,
    reference_outputs,
    sim_config,
    wait_for,
    wait_for_restart,
    worker_pid,
)
from tests.conftest import random_prompt
from tests.support.worker_stream import renewing

NAME = "serving"
GREEDY = ns.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
TEXTS = ["The quick brown fox", "def add(a, b):", "numaserve serves", "Grüße aus Köln! 🙂",
         "In the beginning"]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    # 16 running + 8 queued per worker: 48 requests admitted in all; a step-time target no step meets, so
    # the scheduler's policy visibly cuts the token budget
    return sim_config("two_numa_sim", max_queued_per_worker=8, engine={"max_num_seqs": 16},
                      target_step_ms=0.01,
                      adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"))


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, config):
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


def worker_handle(worker_id: str):
    return ray.get_actor(f"{NAME}.worker.{worker_id}", namespace="numaserve")


def worker_stats(client) -> dict:
    return client.stats()["workers"]



def test_greedy_results_equal_the_in_process_engine_under_32_concurrent_streams(client, llama_dir, config):
    prompts = [TEXTS[i % len(TEXTS)] if i % 3 == 0 else random_prompt(1 + 7 * i, seed=i) for i in range(32)]
    expected = reference_outputs(llama_dir, config, prompts, GREEDY)
    counts = ("num_requests", "num_steps", "num_caller_batches")
    before = {w: {k: s[k] for k in counts} for w, s in worker_stats(client).items()}
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: collect(client.stream(p, GREEDY)), prompts))
    done = {w: {k: s[k] - before[w][k] for k in counts} for w, s in worker_stats(client).items()}
    assert [g[0] for g in got] == [e.token_ids for e in expected]
    assert [g[1] for g in got] == [e.text for e in expected]
    assert {g[2] for g in got} == {"length"}
    assert sum(g[3] for g in got) < 32 * GREEDY.max_tokens  # tokens ready together rode in one chunk
    served = {w: d["num_requests"] for w, d in done.items()}
    assert sum(served.values()) == 32 and min(served.values()) > 0, served  # spread over both workers
    # this caller read at most one Ray item per engine step of a worker, however many of its streams ran
    # there (actors/caller_channel.py), its items carrying more chunks than there were items
    assert all(0 < d["num_caller_batches"] <= d["num_steps"] for d in done.values()), done
    assert sum(g[3] for g in got) > sum(d["num_caller_batches"] for d in done.values()), done


def test_generate_returns_the_prompt_ids_and_the_whole_completion(client, llama_dir, config):
    [expected] = reference_outputs(llama_dir, config, ["def add(a, b):"], GREEDY)
    done = client.generate("def add(a, b):", GREEDY)
    assert (done.prompt_token_ids, done.token_ids, done.text, done.finish_reason) == (
        expected.prompt_token_ids, expected.token_ids, expected.text, "length")


def test_logprobs_cross_the_worker_stream_router_and_client_as_in_process(client, llama_dir, config):
    params = [ns.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3),
              ns.SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True, logprobs=0)]
    expected = reference_outputs(llama_dir, config, ["def add(a, b):"] * 2, params)
    for sp, e in zip(params, expected):
        done = client.generate("def add(a, b):", sp)
        assert done.token_ids == e.token_ids and len(done.logprobs) == len(e.logprobs) == 10
        for row, expected_row in zip(done.logprobs, e.logprobs):
            # the top ones in order, then the sampled token if not among them
            assert list(row) == list(expected_row)
            # float32 sums split over other thread counts: equal to ~1e-6
            assert list(row.values()) == pytest.approx(list(expected_row.values()), abs=1e-5)
        chunks = list(client.stream("def add(a, b):", sp))
        assert [lp for c in chunks for lp in c.logprobs] == done.logprobs
        assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert client.generate("def add(a, b):", GREEDY).logprobs is None


def test_each_worker_reports_its_simulated_nodes_core_and_one_thread(client):
    infos = {w: s["info"] for w, s in worker_stats(client).items()}
    assert sorted(infos) == ["local-numa0-0", "local-numa1-0"]
    for info, core in zip(infos.values(), (0, 1)):
        assert info["cpu_ids"] == [core] and info["thread_cpu_ids"] == [core]  # every thread of the process
        assert info["num_threads"] == 1 and info["engine_config"]["num_threads"] == 1
        assert info["num_pinned_threads"] > 1
        assert os.getpriority(os.PRIO_PROCESS, info["pid"]) == 0  # its main thread: not Ray's nice 15
        assert info["memory_policy"] == "bind:0" or info["memory_policy"].startswith("first-touch (")
    assert infos["local-numa0-0"]["pid"] != infos["local-numa1-0"]["pid"]


@pytest.mark.load_sensitive
def test_the_schedulers_policy_reaches_the_workers(client, config):
    # target_step_ms (this module's config) is below any step's time: a report of steps shrinks the budget
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.generate(random_prompt(200, seed=i), GREEDY), range(8)))
    budget = config.engine.max_num_batched_tokens

    def applied() -> dict | None:  # the report of those steps has been answered and applied
        stats = client.stats()
        return stats if any(w["token_budget"] < budget for w in stats["workers"].values()) else None

    stats = wait_for(applied, 30, "a worker to apply a shrunk token budget")
    assert set(stats["policies"]) == {"local-numa0-0", "local-numa1-0"}
    assert any(p["policy"]["token_budget"] < budget for p in stats["policies"].values())


def test_connect_works_from_another_driver_process(client, ray_cluster):
    code = (f"import numaserve as ns; c = ns.connect({NAME!r}, address={ray_cluster.address!r}); "
            "print(len(c.generate([5, 6, 7], ns.SamplingParams(max_tokens=5, ignore_eos=True)).token_ids))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "5"


def test_a_session_stays_on_one_worker(client):
    before = {w: s["num_requests"] for w, s in worker_stats(client).items()}
    for i in range(4):
        client.generate(random_prompt(5, seed=900 + i), GREEDY, session="chat-1")
    served = {w: s["num_requests"] - before[w] for w, s in worker_stats(client).items()}
    assert sorted(served.values()) == [0, 4]


def num_aborted(client) -> int:
    return sum(s["metrics"]["request_success"].get("abort", 0) for s in worker_stats(client).values())


@pytest.mark.load_sensitive
def test_closing_a_stream_aborts_its_request_on_the_worker(client):
    aborted = num_aborted(client)
    stream = client.stream(random_prompt(8, seed=5), ns.SamplingParams(max_tokens=400, temperature=0,
                                                                        ignore_eos=True))
    first = next(stream)
    assert first.token_ids and first.finish_reason is None
    with paused(client):  # it cannot run on to its 400 tokens before the close reaches its worker
        stream.close()
        wait_for(lambda: all(s.get("num_streams") == 0 and s.get("num_running") == 0
                             and s["num_outstanding_requests"] == 0
                             for s in worker_stats(client).values()), 20,
                 "the abort to reach the worker")
    assert num_aborted(client) == aborted + 1


def test_a_worker_names_the_submitted_requests_it_does_not_run_so_no_caller_waits_for_them(client):
    """A caller that calls its worker's stream again (the last one ended without an error: the worker
    restarted under it, or the caller's lease lapsed as a request ended, dropping its last item) learns which
    of its submitted requests nobody runs there: they come back CallerGone (the caller resumes them
    elsewhere), those it runs and those whose submit may still be in flight do not."""
    worker_id = "local-numa0-0"
    worker, caller_id = worker_handle(worker_id), uuid.uuid4().hex
    long = ns.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with paused(client, [worker_id]), renewing(worker, caller_id):  # the request holds its first token back
        ray.get(worker.submit.remote(GenerateRequest("runs", [5, 6, 7], long, caller_id=caller_id)))
        waits_for, submitted = ("runs", "unknown", "in-flight"), ("runs", "unknown")
        batches = worker.caller_stream.remote(caller_id, waits_for, submitted)
        ray.get(worker.abort.remote("runs"))  # its item comes after the gone ones, whenever it lands
        assert [(r, type(item)) for r, item in decode(ray.get(next(batches)))] == [("unknown", CallerGone)]
        [(request_id, out)] = decode(ray.get(next(batches)))
        assert (request_id, out.finish_reason) == ("runs", "abort")  # what it runs goes on as before
        assert next(batches, None) is None  # and the stream idles out once nothing of the caller runs


@pytest.mark.load_sensitive
def test_killing_a_worker_mid_stream_loses_no_request_and_the_restarted_worker_rejoins(client, llama_dir,
                                                                                       config):
    # every request goes on exactly: greedy ones and seeded sampled ones (the recomputed prompt and the new
    # worker's batches give the same logits bit for bit, tests/scheduling/test_batch_invariance.py, and the
    # draws resume where they were, tests/cluster/test_resume.py)
    params = [ns.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True) if i % 2 else
              ns.SamplingParams(max_tokens=300, temperature=0.9, top_p=0.95, seed=i, frequency_penalty=0.5,
                                ignore_eos=True) for i in range(12)]
    prompts = [random_prompt(20, seed=500 + i) for i in range(12)]
    expected = reference_outputs(llama_dir, config, prompts, params)
    victim_id = "local-numa0-0"
    victim, victim_pid = worker_handle(victim_id), worker_pid(client, victim_id)
    rerouted_before = client.stats()["routed"]["reroute"]
    streams = [client.stream(p, sp) for p, sp in zip(prompts, params)]
    firsts = [next(s) for s in streams]  # every request is running
    try:
        with paused(client):  # and stays so (on the victim too) until the kill has landed
            ray.kill(victim, no_restart=False)  # Ray restarts it
        rests = [collect(s) for s in streams]
    finally:  # the next tests need both workers back
        wait_for_restart(client, victim_id, victim_pid)
    assert [f.token_ids + r[0] for f, r in zip(firsts, rests)] == [e.token_ids for e in expected]
    assert [f.text + r[1] for f, r in zip(firsts, rests)] == [e.text for e in expected]
    assert all(r[2] == "length" for r in rests)
    assert client.stats()["routed"]["reroute"] > rerouted_before  # some streams did move
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.generate(random_prompt(30, seed=i), GREEDY), range(8)))
    assert worker_stats(client)[victim_id]["num_requests"] > 0  # a fresh process: served after it rejoined


@pytest.mark.load_sensitive
def test_overloaded_is_raised_not_a_hang_when_admission_is_full_and_service_goes_on(client):
    long = ns.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    # admitted and not streamed: the 48 stay outstanding until their callers (here) finish them
    admissions = ray.get([client.router.admit.remote(random_prompt(8, seed=700 + i), long)
                          for i in range(48)])
    with ThreadPoolExecutor(1) as pool:
        refused = pool.submit(client.generate, "The quick brown fox", GREEDY)
        with pytest.raises(ns.Overloaded, match="every worker's queue is full"):
            refused.result(timeout=60)  # not left waiting
    assert client.stats()["num_overloaded"] >= 1
    ray.get([client.router.finish.remote(a.request_id) for a in admissions])
    wait_for(lambda: all(s["num_outstanding_requests"] == 0 and s.get("num_running") == 0
                         for s in worker_stats(client).values()), 30, "the cancelled requests to drain")
    assert client.generate("The quick brown fox", GREEDY).finish_reason == "length"


@pytest.mark.parametrize("prompt, kwargs, match", [
    ("", {}, "the prompt is empty"),
    ([], {}, "the prompt is empty"),
    ([1.5, 2], {}, "a prompt is a str or a list of int token ids"),
    ({"text": "hi"}, {}, "a prompt is a str or a list of int token ids"),
    (None, {}, "a prompt is a str or a list of int token ids"),
    ([5, 10**6], {}, "outside the vocabulary"),
    (random_prompt(600, seed=1), {}, "shorten the prompt"),  # checked by the worker's engine
    ("hello", {"params": {"max_tokens": 3}}, "params must be a numaserve.SamplingParams"),
    ("hello", {"adapter": "nope"}, "unknown adapter 'nope'"),
    ("hello", {"session": 7}, "session must be a str"),
])
def test_bad_requests_raise_invalid_request_through_the_client_and_service_goes_on(client, prompt, kwargs,
                                                                                   match):
    with pytest.raises(ns.InvalidRequest, match=match):
        client.generate(prompt, **kwargs)
    with pytest.raises(ns.InvalidRequest, match=match):
        next(client.stream(prompt, **kwargs))
    assert client.generate([5, 6, 7], GREEDY).finish_reason == "length"


def test_adapters_are_validated_persisted_across_a_restart_and_served(client, llama_dir, config, tmp_path):
    from tests.models.test_lora import make_adapter

    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    with pytest.raises(ns.AdapterError, match="adapter_model.safetensors: missing"):
        client.register_adapter("half", tmp_path / "half")
    with pytest.raises(ns.AdapterError, match="not a directory"):
        client.register_adapter("gone", tmp_path / "gone")
    adapter = make_adapter(llama_dir, tmp_path / "a", seed=1)
    with pytest.raises(ns.AdapterError, match="is not valid"):
        client.register_adapter("bad name!", adapter)
    client.register_adapter("a", adapter)
    client.register_adapter("a", adapter)  # the same again: a no-op
    [registration] = json.loads(Path(config.adapter_registry).read_text())["registrations"]
    assert registration["deployment"] == NAME and registration["adapters"] == {"a": str(adapter)}
    other = make_adapter(llama_dir, tmp_path / "a2", seed=2)
    client.register_adapter("a", other)  # other weights: its next version
    [registration] = json.loads(Path(config.adapter_registry).read_text())["registrations"]
    assert registration["adapters"] == {"a": str(other)} and registration["versions"] == {"a": 2}
    assert registration["model"]["path"] == str(Path(llama_dir).resolve())

    def cache_process():
        [state] = list_actors(filters=[("name", "=", f"{NAME}.adapters")])
        return state.state, state.pid

    cache = ray.get_actor(f"{NAME}.adapters", namespace="numaserve")
    _, pid = cache_process()
    ray.kill(cache, no_restart=False)
    wait_for(lambda: cache_process()[0] == "ALIVE" and cache_process()[1] != pid, 60,
             "the adapter cache to restart")
    assert ray.get(cache.adapters.remote()) == {"a": str(other)}  # read back from its file
    assert ray.get(cache.resolve.remote("a")) == "a@2"  # its version too

    prompts = [random_prompt(20, seed=40 + i) for i in range(4)]
    expected = reference_outputs(llama_dir, config, prompts, GREEDY, adapters={"a": other})
    base = reference_outputs(llama_dir, config, prompts, GREEDY)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: client.generate(p, GREEDY, adapter="a").token_ids, prompts))
    assert got == [e.token_ids for e in expected] != [b.token_ids for b in base]


def test_a_client_script_submitted_with_ray_job_submit_reaches_the_deployment(ray_cluster, client, llama_dir,
                                                                              config):
    [expected] = reference_outputs(llama_dir, config, ["def add(a, b):"],
                                   ns.SamplingParams(max_tokens=8, temperature=0))
    ray_cli = Path(sys.executable).with_name("ray")
    job = subprocess.run(
        [str(ray_cli), "job", "submit", "--address", f"http://{ray_cluster.webui_url}", "--working-dir",
         str(REPO), "--", sys.executable, "tests/cluster/job_client.py", "def add(a, b):", "--name", NAME,
         "--max-tokens", "8"],
        check=False, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    line = next(x for x in job.stdout.splitlines() if x.startswith("COMPLETION "))
    assert json.loads(line.removeprefix("COMPLETION ")) == {
        "token_ids": expected.token_ids, "text": expected.text, "finish_reason": expected.finish_reason}


def test_serve_and_connect_refuse_what_they_cannot_do(client, llama_dir, tmp_path):
    with pytest.raises(DeploymentError, match="already running"):
        ns.serve(sim_config("two_numa_sim"), model=llama_dir, name=NAME)
    with pytest.raises(DeploymentError, match="numa_local_0, numa_local_1 are taken by another deployment"):
        ns.serve(sim_config("two_numa_sim"), model=llama_dir, name="second")
    elsewhere = sim_config("two_numa_sim",
                           machines=[{"name": "elsewhere", "numa_nodes": [{"id": 0, "cpus": [0]}]}])
    with pytest.raises(DeploymentError, match="no Ray node offers numa_elsewhere_0"):
        ns.serve(elsewhere, model=llama_dir, name="elsewhere")
    with pytest.raises(ns.CheckpointError, match="config.json"):
        ns.serve(sim_config("two_numa_sim"), model=tmp_path / "missing", name="missing")
    with pytest.raises(DeploymentError, match="deployment name 'a.b' is not valid"):
        ns.serve(sim_config("two_numa_sim"), model=llama_dir, name="a.b")
    with pytest.raises(DeploymentError, match="config must be a ClusterConfig"):
        ns.serve(config=42, model=llama_dir)
    with pytest.raises(DeploymentError, match="no numaserve deployment named 'nope'"):
        ns.connect("nope")
    assert ns.connect(NAME).generate([5, 6, 7], GREEDY).finish_reason == "length"
