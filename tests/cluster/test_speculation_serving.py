"""Speculative decoding through the deployment (two_numa_sim.yaml): greedy results equal the in-process engine
without speculation under concurrent streams (n-gram drafts in mode "on", a draft model in mode "auto"), each
worker reports its figures, and a worker killed mid-stream loses no request and changes no token (greedy and
seeded sampling)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

import numaserve as ns
from tests.cluster.conftest import collect, reference_outputs, sim_config
from tests.conftest import random_prompt
from tests.test_speculation import perturbed_copy

NAME = "speculation"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "mode": "on", "prompt_lookup_min": 1}
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b):\n    return a + b\n",
         "numaserve serves language models. numaserve", "In the beginning was the word, and the word"]


@pytest.fixture(scope="module")
def plain_config():
    return sim_config("two_numa_sim", engine={"max_num_seqs": 16})


@pytest.fixture(scope="module", params=["ngram", "draft"])
def client(request, ray_cluster, llama_dir, tmp_path_factory):
    """One deployment at a time: n-gram drafts in mode "on", then a draft model in mode "auto"."""
    spec = SPEC
    if request.param == "draft":
        draft = perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), scale=0.3)
        spec = {"method": "draft", "draft_model": str(draft), "mode": "auto"}
    client = ns.serve(sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": spec}),
                      model=llama_dir, name=NAME)
    client.method = request.param
    yield client
    client.shutdown()


def num_accepted(client) -> dict[str, int]:
    return {w: s.get("spec_num_accepted_tokens", 0) for w, s in client.stats()["workers"].items()}  # 0: down


def test_greedy_results_through_the_client_equal_no_speculation(client, llama_dir, plain_config):
    prompts = [TEXTS[i % len(TEXTS)] if i % 2 else random_prompt(3 + 5 * i, seed=i) for i in range(16)]
    params = [ns.SamplingParams(max_tokens=10 + i, temperature=0, ignore_eos=True, stop=["lazy"] if i == 1 else ())
              for i in range(16)]
    expected = reference_outputs(llama_dir, plain_config, prompts, params)
    before = num_accepted(client)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda a: collect(client.stream(*a)), zip(prompts, params)))
    assert [g[:3] for g in got] == [(e.token_ids, e.text, e.finish_reason) for e in expected]
    after = num_accepted(client)
    assert sum(after.values()) > sum(before.values()), after  # speculation did run
    for stats in client.stats()["workers"].values():
        assert {"spec_num_drafts", "spec_accepted_per_position", "spec_depth", "spec_accept_rate_ema"} <= set(stats)


def test_killing_a_speculating_worker_mid_stream_changes_no_token(client, llama_dir, plain_config):
    # seeded sampling gives the tokens of no speculation with deterministic drafts (n-gram); a draft model's
    # sampled drafts give the same distribution, not the same tokens: greedy only there
    params = [ns.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True) if i % 2 or client.method != "ngram"
              else
              ns.SamplingParams(max_tokens=200, temperature=0.9, top_p=0.95, seed=i, frequency_penalty=0.5,
                                ignore_eos=True) for i in range(8)]
    prompts = [random_prompt(20, seed=700 + i) + random_prompt(6, seed=i) * 3 for i in range(8)]
    expected = reference_outputs(llama_dir, plain_config, prompts, params)  # no speculation: same tokens
    rerouted_before = client.stats()["routed"]["reroute"]
    survivor, before = "local-numa1-0", num_accepted(client)
    streams = [client.stream(p, sp) for p, sp in zip(prompts, params)]
    firsts = [next(s) for s in streams]
    ray.kill(ray.get_actor(f"{NAME}.worker.local-numa0-0", namespace="numaserve"), no_restart=False)
    rests = [collect(s) for s in streams]
    assert [f.token_ids + r[0] for f, r in zip(firsts, rests)] == [e.token_ids for e in expected]
    assert [f.text + r[1] for f, r in zip(firsts, rests)] == [e.text for e in expected]
    assert client.stats()["routed"]["reroute"] > rerouted_before
    assert num_accepted(client)[survivor] > before[survivor]  # it speculated, on the moved requests too
