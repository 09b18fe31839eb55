"""Multi-LoRA through the deployment of two_numa_sim.yaml: adapters registered from a directory only the
adapter-cache actor reads (it is gone before any worker could), composed through the client, mixed in one
concurrent batch with base requests; each request gets the greedy tokens it gets alone in-process.
Registrations are kept per deployment name and base model: another model deployed under the name neither
offers nor loads them, the first model deployed again does."""

import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import requests
from ray.util.state import list_actors

import numaserve as ns
from benchmarks.ports import free_port
from tests.cluster.conftest import collect, paused, sim_config, wait_for, wait_for_restart, worker_pid
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter
from tests.support.model_factory import build_model

NAME = "lora-serving"
GREEDY = ns.SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ADAPTERS = {"a": {"seed": 1}, "b": {"seed": 2, "modules": ["q_proj", "v_proj"], "r": 8, "alpha": 4},
            "c": {"seed": 4, "modules": ["q_proj", "o_proj", "down_proj"], "alpha": 16},
            "rs": {"seed": 3, "rslora": True}}


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-serving")
    return {name: make_adapter(llama_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(params=["never", "always"])
def config(request, tmp_path_factory):
    # max_loras=2 per worker: the batch's four adapters and a composed one rotate through the slots; with
    # lora_merge "always" each step's most-used adapter runs on its merged copy, the others low-rank
    # adapter_roots: pytest's temporary directories (every adapter here), so paths that leave them are
    # refused; a registry per deployment (a repeated test registers its adapters from new directories)
    return sim_config("two_numa_sim", engine={"max_num_seqs": 16, "max_loras": 2, "lora_merge": request.param,
                                              "adapter_roots": [str(tmp_path_factory.getbasetemp())]},
                      adapter_registry=str(tmp_path_factory.mktemp("registry") / "adapters.json"))


@pytest.mark.load_sensitive
def test_mixed_adapters_through_the_client_equal_each_alone(ray_cluster, llama_dir, adapter_dirs, config,
                                                            tmp_path):
    prompts = [random_prompt(4 + 3 * i, seed=70 + i) for i in range(12)]
    names = ["a", None, "b", "c", "rs", "mix", "a", "b", None, "c", "rs", "mix"]
    reference = ns.LLM(llama_dir, **config.engine.model_dump(exclude={"num_threads"}))
    for name, path in adapter_dirs.items():
        reference.register_adapter(name, path)
    reference.compose_adapter("mix", {"a": 0.6, "b": 0.4}, combination="cat")
    expected = [reference.generate(p, GREEDY, adapter=n)[0].token_ids for p, n in zip(prompts, names)]
    assert len({tuple(e) for e in expected[:6]}) == 6  # every adapter changes the tokens

    private = tmp_path / "cache-only"  # registered from here, then moved away: no worker can read it
    shutil.copytree(adapter_dirs["a"].parent, private)
    deployment = f"{NAME}-{config.engine.lora_merge}"
    client = ns.serve(config, model=llama_dir, name=deployment)
    try:
        for name in ADAPTERS:
            client.register_adapter(name, private / name)
        client.compose_adapter("mix", {"a": 0.6, "b": 0.4}, combination="cat")
        with pytest.raises(ns.AdapterError, match="one rank"):
            client.compose_adapter("bad", {"a": 0.5, "b": 0.5}, combination="linear")
        assert_bad_adapters_are_refused_at_registration(client, private / "a", tmp_path)
        shutil.move(private, tmp_path / "moved")
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda a: collect(client.stream(a[0], GREEDY, adapter=a[1]))[0],
                                zip(prompts, names)))
        assert got == expected
        assert client.generate(prompts[0], GREEDY, adapter="a").token_ids == expected[0]  # again: cached
        stats = client.stats()
        cache = stats["adapter_cache"]
        assert cache["num_adapters"] == 5 and cache["adapter_hits"] >= 5 and cache["adapter_bytes"] > 0
        workers = [w for w in stats["workers"].values() if isinstance(w, dict) and "lora_slot_misses" in w]
        assert len(workers) == 2 and all(w["num_adapters_loaded"] <= 2 for w in workers)  # max_loras
        # all low-rank, the five adapters rotating through 2 slots each
        if config.engine.lora_merge == "never":
            assert sum(w["lora_slot_misses"] for w in workers) >= 5 and all(len(w["lora_slots_held"]) <= 2
                                                                            for w in workers)
            assert sum(w["num_lora_tokens"] for w in workers) > 0 == sum(w["num_merged_tokens"]
                                                                         for w in workers)
        else:  # every adapted row on its adapter's merged copy, built once per worker
            assert sum(w["num_merged_tokens"] for w in workers) > 0 == sum(w["num_lora_tokens"]
                                                                           for w in workers)
            assert sum(w["lora_merged_builds"] for w in workers) >= 5

        assert_a_session_switching_adapter_recomputes_and_switching_back_reuses(client)
        if config.engine.lora_merge == "always":
            builder = assert_a_merged_copy_is_built_once_and_shared(client)
            assert_a_shared_copy_lost_with_its_builder_is_built_again(client, deployment, builder)

        shutil.move(tmp_path / "moved", private)  # a restarted cache reloads from the registered directories
        cache_actor = ray.get_actor(f"{deployment}.adapters", namespace="numaserve")
        _, pid = cache_process(deployment)
        ray.kill(cache_actor, no_restart=False)
        wait_for(lambda: cache_process(deployment)[0] == "ALIVE" and cache_process(deployment)[1] != pid, 60,
                 "the adapter cache to restart")
        assert ray.get(cache_actor.adapters.remote())["mix"] == "compose({'a': 0.6, 'b': 0.4}, 'cat')"
        assert ray.get(cache_actor.stats.remote())["num_adapters_loaded"] == 0  # loaded when asked for
        fresh = random_prompt(9, seed=99)
        assert client.generate(fresh, GREEDY, adapter="mix").token_ids == \
            reference.generate(fresh, GREEDY, adapter="mix")[0].token_ids
    finally:
        client.shutdown()


def test_an_adapter_registered_over_one_model_is_neither_offered_nor_loaded_over_another(
        ray_cluster, llama_dir, adapter_dirs, tmp_path):
    other = tmp_path / "other-llama"  # the same shapes (an adapter of the first would load), another model
    build_model(other, "llama", seed=5)
    config = sim_config("two_numa_sim", adapter_registry=str(tmp_path / "adapters.json"),
                        http={"port": free_port()})
    name = f"{NAME}-models"

    def offered(client) -> tuple[set[str], set[str]]:
        """(the adapter cache's adapters, the adapters /v1/models lists)"""
        cache = ray.get_actor(f"{name}.adapters", namespace="numaserve")
        models = requests.get(f"{client.http_url}/v1/models", timeout=30).json()["data"]
        return set(ray.get(cache.adapters.remote())), {m["id"] for m in models if m.get("parent")}

    client = ns.serve(config, model=llama_dir, name=name)
    try:
        client.register_adapter("a", adapter_dirs["a"])
        assert offered(client) == ({"a"}, {"a"})
        expected = client.generate([5, 6, 7], GREEDY, adapter="a").token_ids
    finally:
        client.shutdown()
    client = ns.serve(config, model=other, name=name)
    try:
        assert offered(client) == (set(), set())
        with pytest.raises(ns.InvalidRequest, match="unknown adapter 'a'"):
            client.generate([5, 6, 7], GREEDY, adapter="a")
        assert client.stats()["adapter_cache"]["adapter_misses"] == 0  # never loaded
    finally:
        client.shutdown()
    client = ns.serve(config, model=llama_dir, name=name)
    try:
        assert offered(client) == ({"a"}, {"a"})
        assert client.generate([5, 6, 7], GREEDY, adapter="a").token_ids == expected
    finally:
        client.shutdown()


def assert_bad_adapters_are_refused_at_registration(client, good, tmp_path):
    """The cache actor runs every check at registration (scheduling/lora/adapter_store.py): each bad adapter
    gets an AdapterError naming it, and the deployment serves on."""
    config = json.loads((good / "adapter_config.json").read_text())
    for breakage, change, match in [("dora", {"use_dora": True}, "use_dora"),
                                    ("too-big", {"r": 128, "lora_alpha": 128}, "above max_lora_rank"),
                                    ("foreign", {"peft_type": "IA3"}, "only LORA")]:
        bad = tmp_path / breakage
        shutil.copytree(good, bad)
        (bad / "adapter_config.json").write_text(json.dumps(config | change))
        with pytest.raises(ns.AdapterError, match=match):
            client.register_adapter(breakage, bad)
    with pytest.raises(ns.AdapterError, match="use_dora"):  # a served name's next version is checked too
        client.register_adapter("a", tmp_path / "dora")
    outside = Path(tempfile.mkdtemp(prefix="outside-roots-")) / "a"  # a good adapter, outside adapter_roots
    shutil.copytree(good, outside)
    try:
        # up past / and down
        climb = tmp_path.joinpath(*[".."] * len(tmp_path.parts)) / outside.relative_to("/")
        (tmp_path / "link").symlink_to(outside)
        for name, path in (("climb", climb), ("link", tmp_path / "link")):
            with pytest.raises(ns.AdapterError, match="outside adapter_roots"):
                client.register_adapter(name, path)
    finally:
        shutil.rmtree(outside.parent)
    assert client.generate([5, 6, 7], GREEDY, adapter="a").finish_reason == "length"


def assert_a_session_switching_adapter_recomputes_and_switching_back_reuses(client):
    """A session's turns stay on one worker; its KV is keyed by adapter (the prefix cache's blocks are)."""
    def hits() -> int:
        workers = client.stats()["workers"].values()
        return sum(w["metrics"]["values"]["prefix_cache_hits"] for w in workers if "metrics" in w)

    history = random_prompt(48, seed=123)  # three full blocks of 16
    turns = []
    for adapter in ("a", "b", "a"):
        before = hits()
        done = client.generate(history, GREEDY, adapter=adapter, session="chat")
        turns.append(hits() - before)
        history = history + done.token_ids + random_prompt(5, seed=len(history))
    assert turns[0] == 0 and turns[1] == 0  # the first turn, then the switch: all computed anew
    assert turns[2] >= 48  # back on "a": the first turn's blocks are still cached


def assert_a_merged_copy_is_built_once_and_shared(client) -> str:
    """The worker that builds a merged copy shares it through the AdapterCache: the other takes it. -> the
    builder's id."""
    def per_worker() -> dict[str, tuple[int, int]]:
        return {w: (s["lora_merged_builds"], s["lora_merged_shared"])
                for w, s in client.stats()["workers"].items() if "lora_merged_builds" in s}

    client.compose_adapter("fresh", {"a": 1.0, "c": 0.5}, combination="cat")  # no worker holds a copy of it
    before = per_worker()
    long = client.stream(random_prompt(8, seed=200), ns.SamplingParams(max_tokens=300, ignore_eos=True),
                         adapter="fresh")
    next(long)  # running on one worker, which built the copy and shares it
    [builder] = [w for w, (builds, _) in per_worker().items() if builds > before[w][0]]
    wait_for(lambda: "fresh" in client.stats()["adapter_cache"]["merged_held"], 30, "the copy to be shared")
    # the builder, paused, carries the long request's outstanding tokens: the router sends the next to the
    # other
    with ThreadPoolExecutor(1) as pool, paused(client, [builder]):
        pool.submit(client.generate, random_prompt(8, seed=201), GREEDY, adapter="fresh").result(timeout=60)
    long.close()
    after = per_worker()
    assert sum(a[0] - before[w][0] for w, a in after.items()) == 1  # built once
    # and shared
    assert [w for w, a in after.items() if a[1] > before[w][1]] == [w for w in after if w != builder]
    return builder


def assert_a_shared_copy_lost_with_its_builder_is_built_again(client, deployment: str, builder: str):
    """The builder of a shared merged copy dies: the object store loses the copy with it (its owner). A worker
    that fetches it for a request builds it again, and the request stays there: the loss is not its worker's
    (taken as one, each worker the request moved to was marked down in turn)."""
    pid = worker_pid(client, builder)
    ray.kill(ray.get_actor(f"{deployment}.worker.{builder}", namespace="numaserve"), no_restart=False)
    wait_for_restart(client, builder, pid)
    rerouted = client.stats()["routed"]["reroute"]
    prompts = [random_prompt(8, seed=seed) for seed in range(202, 206)]
    with ThreadPoolExecutor(4) as pool:  # on both workers, neither holding the copy in use
        done = list(pool.map(lambda prompt: client.generate(prompt, GREEDY, adapter="fresh"), prompts))
    assert [d.finish_reason for d in done] == ["length"] * 4
    assert client.stats()["routed"]["reroute"] == rerouted


def cache_process(name: str) -> tuple[str, int]:
    # not an earlier run's
    [state] = list_actors(filters=[("name", "=", f"{name}.adapters"), ("state", "!=", "DEAD")])
    return state.state, state.pid
