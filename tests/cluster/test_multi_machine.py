"""two_node_sim.yaml on a ray.cluster_utils.Cluster of two simulated machines with two NUMA nodes each:
one worker per declared node across machines; removing a machine mid-stream loses no request."""

import pytest
import ray

import numaserve as ns
from tests.cluster.conftest import collect, paused, reference_outputs, sim_config, wait_for
from tests.conftest import random_prompt

NAME = "multi"


@pytest.mark.load_sensitive
def test_workers_span_machines_and_losing_one_mid_stream_loses_no_request(ray_cluster, llama_dir):
    config = sim_config("two_node_sim")
    sim1 = ray_cluster.add_node(num_cpus=2, resources=config.ray_resources("sim1"))
    client = ns.serve(config, model=llama_dir, name=NAME)
    try:
        infos = {w: s["info"] for w, s in client.stats()["workers"].items()}
        assert sorted((i["machine"], i["numa_node"], tuple(i["cpu_ids"])) for i in infos.values()) == [
            ("sim0", 0, (0,)), ("sim0", 1, (1,)), ("sim1", 0, (0,)), ("sim1", 1, (1,))]
        head = ray.get_runtime_context().get_node_id()
        for info in infos.values():
            assert info["ray_node_id"] == (head if info["machine"] == "sim0" else sim1.node_id)
            assert info["thread_cpu_ids"] == info["cpu_ids"] and info["num_threads"] == 1

        params = ns.SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)
        prompts = [random_prompt(16, seed=300 + i) for i in range(16)]
        expected = reference_outputs(llama_dir, config, prompts, params)
        streams = [client.stream(p, params) for p in prompts]
        firsts = [next(s) for s in streams]
        with paused(client):  # sim1's streams are in flight when it goes, whatever this machine's speed
            ray_cluster.remove_node(sim1)  # its raylet and every worker process on it die
        rests = [collect(s) for s in streams]
        assert [f.token_ids + r[0] for f, r in zip(firsts, rests)] == [e.token_ids for e in expected]
        assert [f.text + r[1] for f, r in zip(firsts, rests)] == [e.text for e in expected]

        assert client.stats()["routed"]["reroute"] >= 1
        # a sim1 worker none of the streams reported lost is marked down when a stats call finds it dead
        alive = {"sim0-numa0-0": True, "sim0-numa1-0": True, "sim1-numa0-0": False, "sim1-numa1-0": False}
        wait_for(lambda: {w: s["alive"] for w, s in client.stats()["workers"].items()} == alive, 60,
                 "the router to have sim1's workers down")
        assert client.generate("The quick brown fox", params).finish_reason == "length"
    finally:
        client.shutdown()
