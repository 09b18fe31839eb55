"""Adapters come and go in a running two_numa_sim deployment, over ns.Client and over HTTP with the `openai`
client: other weights registered under a served name are its next version; a stream admitted before finishes
on the old weights (PEFT's greedy tokens over them) while a request admitted after gets the new (PEFT's over
them); an unloaded name is refused (HTTP: 404 with OpenAI's error body); and once the last request of a
version has ended, no worker keeps its slot, merged copy, weights or prefix blocks, nor the adapter cache
its copies."""

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

import numaserve as ns
from benchmarks.ports import free_port
from tests.cluster.conftest import advance, collect, paused, queued, sim_config, wait_for
from tests.conftest import random_prompt
from tests.models.test_lora import peft_greedy, two_versions

NAME = "adapter-lifecycle"
FP32 = {"weight_dtype": "float32", "kv_dtype": "float32"}
MAX_TOKENS = 24
GREEDY = ns.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
PROMPTS = [random_prompt(21, seed=41), random_prompt(9, seed=42)]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def weights(llama_dir, tmp_path_factory):
    return two_versions(llama_dir, tmp_path_factory.mktemp("lifecycle"), seed=21)


@pytest.fixture(scope="module")
def expected(llama_dir, weights) -> dict[str, list[list[int]]]:
    """PEFT's greedy tokens over each version's weights, for each prompt."""
    return peft_greedy(llama_dir, weights, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=["never", "always"])
def client(request, ray_cluster, llama_dir, tmp_path_factory):
    # lora_merge "never": adapted rows run low-rank from the slots; "always": on merged copies, shared
    # through the adapter cache
    config = sim_config("two_numa_sim", engine=FP32 | {"max_num_seqs": 8, "max_loras": 2,
                                                       "lora_merge": request.param},
                        adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"),
                        http={"port": free_port(), "enable_lora_loading": True})
    client = ns.serve(config, model=llama_dir, name=NAME)
    yield client
    client.shutdown()


def kept(client, adapter_ids: set[str]) -> dict[str, set[str]]:
    """Where anything of these adapter ids is still kept: per worker and for the adapter cache."""
    stats = client.stats()
    where = {worker_id: {*w["lora_slots_held"], *w["lora_merged_held"], *w["adapters_loaded"],
                         *w["adapters_retired"]} & adapter_ids
             for worker_id, w in stats["workers"].items()}
    cache = stats["adapter_cache"]
    return where | {"adapter cache": {*cache["adapters_loaded"], *cache["merged_held"]} & adapter_ids}


def forgotten(client, adapter_ids: set[str]) -> bool:
    return not any(kept(client, adapter_ids).values())


def test_a_new_version_through_the_client_serves_new_requests_while_an_old_stream_finishes_on_the_old(
        client, weights, expected):
    client.register_adapter("t", weights["old"])
    with ThreadPoolExecutor(2) as pool:
        with paused(client):
            before = pool.submit(lambda: collect(client.stream(PROMPTS[0], GREEDY, adapter="t")))
            wait_for(lambda: queued(client) == 1, 60, "the first request to be queued")
            advance(client, 3)  # its prefill and two tokens: mid-stream by construction
            client.register_adapter("t", weights["new"])
            assert kept(client, {"t"})  # the old version's stream holds it
            after = pool.submit(lambda: client.generate(PROMPTS[1], GREEDY, adapter="t"))
            wait_for(lambda: queued(client) == 2, 60, "the second request to be queued")
        assert before.result(timeout=120)[0] == expected["old"][0]
        assert after.result(timeout=120).token_ids == expected["new"][1]
    assert client.generate(PROMPTS[0], GREEDY, adapter="t").token_ids == expected["new"][0]
    wait_for(lambda: forgotten(client, {"t"}), 60, "every worker and the cache to forget version 1")
    stats = client.stats()
    assert sum(w["num_adapters_forgotten"] for w in stats["workers"].values()) >= 1
    assert stats["adapter_cache"]["num_adapters_retired"] >= 1

    client.unload_adapter("t")
    with pytest.raises(ns.InvalidRequest, match="unknown adapter 't'"):
        client.generate(PROMPTS[0], GREEDY, adapter="t")
    with pytest.raises(ns.AdapterError, match="no adapter is named 't'"):
        client.unload_adapter("t")
    wait_for(lambda: forgotten(client, {"t", "t@2"}), 60, "every worker and the cache to forget version 2")
    client.register_adapter("t", weights["old"])  # back: a third version, with the first one's weights
    assert client.generate(PROMPTS[1], GREEDY, adapter="t").token_ids == expected["old"][1]
    client.unload_adapter("t")


def test_over_http_a_reloaded_name_is_a_new_version_and_an_unloaded_one_is_a_404(client, llama_dir, weights,
                                                                                   expected):
    url = client.http_url
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def load(which: str) -> requests.Response:
        return requests.post(f"{url}/v1/load_lora_adapter",
                             json={"lora_name": "h", "lora_path": str(weights[which])}, timeout=60)

    def complete(prompt: list[int]) -> str:
        return api.completions.create(model="h", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text

    texts = reference_texts(llama_dir, weights, expected)
    assert load("old").status_code == 200
    with ThreadPoolExecutor(2) as pool:
        with paused(client):
            before = pool.submit(lambda: "".join(
                c.choices[0].text for c in api.completions.create(
                    model="h", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})))
            wait_for(lambda: queued(client) == 1, 60, "the streamed request to be queued")
            advance(client, 3)
            r = load("new")
            assert r.status_code == 200 and "added successfully" in r.text
            after = pool.submit(complete, PROMPTS[1])
            wait_for(lambda: queued(client) == 2, 60, "the second request to be queued")
        assert before.result(timeout=120) == texts["old"][0]
        assert after.result(timeout=120) == texts["new"][1]
    assert {m.id for m in api.models.list().data} >= {"h"}

    r = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "h"}, timeout=60)
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError) as e:
        complete(PROMPTS[0])
    assert set(e.value.body) == ERROR_KEYS and e.value.body["code"] == "model_not_found"
    again = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "h"}, timeout=60)
    assert again.status_code == 404 and set(again.json()["error"]) == ERROR_KEYS
    assert again.json()["error"]["code"] == "lora_not_found" and "Traceback" not in again.text
    assert "h" not in {m.id for m in api.models.list().data}
    wait_for(lambda: forgotten(client, {"h", "h@2"}), 60, "the workers and the cache to forget both versions")
    assert requests.get(f"{url}/health", timeout=30).status_code == 200


def reference_texts(llama_dir, weights, expected) -> dict[str, list[str]]:
    """The text of each version's greedy tokens as the in-process engine detokenizes them (its tokens
    checked equal to PEFT's first)."""
    llm = ns.LLM(llama_dir, **FP32)
    texts = {}
    for which in ("old", "new"):
        llm.register_adapter("h", weights[which])
        outs = llm.generate(PROMPTS, GREEDY, adapter="h")
        assert [o.token_ids for o in outs] == expected[which]
        texts[which] = [o.text for o in outs]
    return texts

