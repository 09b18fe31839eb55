"""A deployment whose worker is a tensor-parallel group: two_numa_sim with engine.tensor_parallel_size 2 runs
one worker, rank 0 in the worker actor on node 0's core and a follower process pinned to node 1's. Each node
declares 0.05 GiB (memory_gib), too little for the demo model's weights and KV pool on one rank (the
deployment is refused, naming tensor_parallel_size 2) and enough for a rank of two. Its HTTP streams (the
official openai client) equal the in-process engine's greedy output; a follower killed while 8 streams are
in flight fails the group's step, the worker restarts with a new group, and every stream resumes with the
tokens of an undisturbed run; afterwards no process of the old group and no /dev/shm segment remain, and none
of the group's processes outlives the deployment's shutdown."""

import threading
from pathlib import Path

import openai
import psutil
import pytest

import numaserve as ns
from actors.deploy import DeploymentError
from benchmarks.ports import free_port
from tests.cluster.conftest import (
    advance,
    paused,
    queued,
    reference_outputs,
    sim_config,
    wait_for,
    wait_for_restart,
)
from tests.cluster.test_faults import in_daemon_thread
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter

NAME = "tp"
WORKER = "local-numa0-0"  # the group: rank 0 on node 0, rank 1 on node 1
GREEDY = ns.SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
PROMPTS = [random_prompt(5 + 3 * i, seed=700 + i) for i in range(8)]
STREAM_BOUND_S = 180.0  # a stream not ended by then is hung
BACK_WITHIN_S = 120.0  # a restarted worker serves again within this (a bound on liveness, not speed)
# the demo model's rank at tensor_parallel_size 1: 13.6 MB of weights + 50.3 MB of bfloat16 KV (its pool holds
# max_num_seqs 16 of max_model_len 1024) = 64.0 MB; at 2: 6.8 MB + 25.2 MB = 32.0 MB. A node: 53.7 MB (int8
# KV, the default, would fit one rank)
SMALL_NODES = [{"id": 0, "cpus": [0], "memory_gib": 0.05}, {"id": 1, "cpus": [1], "memory_gib": 0.05}]


def small_nodes_config(size: int, **fields) -> ns.ClusterConfig:
    return sim_config("two_numa_sim", machines=[{"name": "local", "numa_nodes": SMALL_NODES}],
                      engine={"tensor_parallel_size": size, "max_num_seqs": 16, "kv_dtype": "bfloat16"},
                      **fields)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return small_nodes_config(2, http={"port": free_port(), "host": "127.0.0.1"},
                              adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"))


@pytest.fixture(scope="module")
def client(ray_cluster, config):
    client = ns.serve(config, name=NAME)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def expected(config) -> list[ns.Completion]:
    """The prompts through the in-process engine with the worker's engine config (two ranks too)."""
    llm = ns.LLM(config.model, **config.engine.model_dump(exclude={"num_threads"}))
    try:
        return llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()


def test_a_node_too_small_for_the_model_on_one_rank_refuses_it_naming_the_size_that_fits(ray_cluster):
    # refused before any actor starts (the module's deployment, at size 2 on the same nodes, serves)
    with pytest.raises(DeploymentError, match=r"node 0 .* 0.05 GiB: set engine.tensor_parallel_size: 2"):
        ns.serve(small_nodes_config(1), name="tp-small")


def group_pids(client) -> list[int]:
    """The worker's ranks' processes, rank 0 (the worker actor) first."""
    return client.stats()["workers"][WORKER]["tensor_parallel"]["pids"]


def test_one_worker_over_both_nodes_serves_http_streams_equal_to_the_in_process_engine(client, expected):
    workers = client.stats()["workers"]
    assert list(workers) == [WORKER]
    tp = workers[WORKER]["tensor_parallel"]
    assert tp["size"] == 2 and len(tp["pids"]) == 2
    assert psutil.Process(tp["pids"][1]).cpu_affinity() == [1]  # node 1's core
    api = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0,
                        timeout=STREAM_BOUND_S)
    for prompt, reference in zip(PROMPTS[:4], expected):
        text, finish = "", None
        for chunk in api.completions.create(model="base", prompt=prompt, max_tokens=GREEDY.max_tokens,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert (text, finish) == (reference.text, "length")


def test_an_adapter_on_the_group_serves_http_streams_equal_to_the_in_process_engine_with_it(client, config,
                                                                                             tmp_path):
    """Each rank's slots hold its part of the adapter; the follower gets it through rank 0's pipe."""
    path = make_adapter(config.model, tmp_path / "tp-adapter", seed=1)
    client.register_adapter("tp-adapter", path)
    params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with_adapter = reference_outputs(config.model, config, PROMPTS[:2], params, adapters={"tp-adapter": path})
    assert [c.token_ids for c in with_adapter] != \
        [c.token_ids for c in reference_outputs(config.model, config, PROMPTS[:2], params)]
    api = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="unused", max_retries=0,
                        timeout=STREAM_BOUND_S)
    for prompt, reference in zip(PROMPTS[:2], with_adapter):
        text = "".join(chunk.choices[0].text for chunk in api.completions.create(
            model="tp-adapter", prompt=prompt, max_tokens=params.max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if chunk.choices)
        assert text == reference.text


def _stream(client, prompt, started: threading.Semaphore) -> list[int]:
    token_ids = []
    for chunk in client.stream(prompt, GREEDY):
        if not token_ids and chunk.token_ids:
            started.release()  # once per stream
        token_ids += chunk.token_ids
    return token_ids


def test_a_follower_killed_mid_stream_restarts_the_group_and_loses_none_of_8_streams(client, expected):
    old = group_pids(client)
    old_worker, old_follower = psutil.Process(old[0]), psutil.Process(old[1])
    started = threading.Semaphore(0)
    # paused from before the streams start: the group takes only the steps `advance` asks for, one at a time
    # until every stream has its first tokens (a few of its 300), so every stream is mid-flight when the rank
    # dies, whatever this machine's speed
    with paused(client):
        futures = [in_daemon_thread(_stream, client, p, started) for p in PROMPTS]
        wait_for(lambda: queued(client) == len(PROMPTS), 60, "the 8 streams to reach the worker")
        num_started = 0
        for _ in range(20):
            advance(client, 1)
            while num_started < len(PROMPTS) and started.acquire(timeout=2):
                num_started += 1
            if num_started == len(PROMPTS):
                break
        assert num_started == len(PROMPTS), "the streams did not start"
        assert not any(f.done() for f in futures)
        old_follower.kill()
    # the group's next step fails with RankLost: the worker ends, Ray restarts it (both ranks) and the
    # callers resume their streams there
    for f, reference in zip(futures, expected):
        assert f.result(timeout=STREAM_BOUND_S) == reference.token_ids
    wait_for_restart(client, WORKER, old[0], BACK_WITHIN_S)
    new = group_pids(client)
    assert not set(new) & set(old)
    for proc in (old_worker, old_follower):  # the old group's processes are gone (or unreaped zombies)
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    assert psutil.Process(new[1]).is_running()
    assert not list(Path("/dev/shm").glob("numaserve-tp-*"))  # unlinked once its ranks mapped it
    assert client.generate(PROMPTS[0], GREEDY).token_ids == expected[0].token_ids


def test_a_deployment_shut_down_leaves_no_rank_process(client):
    pids = group_pids(client)
    client.shutdown()
    procs = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    wait_for(lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs), 30,
             "the group's processes to end")
