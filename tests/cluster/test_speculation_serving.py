"""Speculative decoding through the deployment (two_numa_sim.yaml): greedy results equal the in-process engine
without speculation under concurrent streams (n-gram drafts, then a draft model, both in mode "on"), each
worker reports its figures, and a worker killed mid-stream loses no request and changes no token (greedy and
seeded sampling). The scheduler actor decides each worker's speculation policy from its telemetry: the workers
apply what it pushes (a worker with a stub scheduler drafts at the pushed depth, not its configured one) and
keep the last push once the scheduler is dead."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

import numaserve as ns
from actors.messages import GenerateRequest
from actors.worker import NumaWorker
from scheduling.policy import Policy
from scheduling.speculation.depth_policy import SpeculationPolicy
from tests.cluster.conftest import (
    collect,
    paused,
    reference_outputs,
    sim_config,
    wait_for,
    wait_for_restart,
    worker_pid,
)
from tests.conftest import random_prompt
from tests.scheduling.test_speculation import perturbed_copy
from tests.support.worker_stream import worker_outputs

NAME = "speculation"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "mode": "on", "prompt_lookup_min": 1}
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
         "def add(a, b):\n    return a + b\n",
         "numaserve serves language models. numaserve", "In the beginning was the word, and the word"]


@pytest.fixture(scope="module")
def plain_config():
    return sim_config("two_numa_sim", engine={"max_num_seqs": 16})


@pytest.fixture(scope="module", params=["ngram", "draft"])
def client(request, ray_cluster, llama_dir, tmp_path_factory):
    """One deployment at a time: n-gram drafts, then a draft model, both in mode "on". The draft model is a
    perturbed copy of the target, as dear per pass as a target step: `auto` rightly never drafts with it (it
    cannot pay even at full acceptance), so these tests, which need drafting, force it. A worker configured
    `auto` is tested below with a stub scheduler, and `auto` in-process in
    tests/scheduling/test_speculation.py."""
    spec = SPEC
    if request.param == "draft":
        draft = perturbed_copy(llama_dir, tmp_path_factory.mktemp("draft"), scale=0.3)
        spec = {"method": "draft", "draft_model": str(draft), "mode": "on"}
    client = ns.serve(sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": spec}),
                      model=llama_dir, name=NAME)
    client.method, client.mode = request.param, spec["mode"]
    yield client
    client.shutdown()


def num_speculated(client, key: str = "spec_num_accepted_tokens") -> dict[str, int]:
    return {w: s.get(key, 0) for w, s in client.stats()["workers"].items()}  # 0: down


def num_accepted(client) -> dict[str, int]:
    return num_speculated(client)


POLICY_FIELDS = {"max_depth": "spec_max_depth", "accept_rates": "spec_accept_rate_ema",
                 "fixed_s": "spec_step_fixed_s",
                 "per_token_s": "spec_step_per_token_s", "draft_s_per_position": "spec_draft_s_per_position",
                 "draft_s_per_token": "spec_draft_s_per_token", "draft_cost_factor": "spec_draft_cost_factor"}


def in_force(worker_stats: dict) -> dict:
    """The speculation policy a worker applies (its stats), in the scheduler's terms."""
    return {field: tuple(worker_stats[key]) if field == "accept_rates" else worker_stats[key]
            for field, key in POLICY_FIELDS.items()}


def pushed(policy: dict) -> dict:
    """The same fields of a policy in Scheduler.stats()."""
    return {field: tuple(policy[field]) if field == "accept_rates" else policy[field]
            for field in POLICY_FIELDS}



def wait_for_both_workers(client) -> None:
    """A worker an earlier test killed is back (restarted, warmed up, probed alive by the router)."""
    wait_for(lambda: all(s.get("alive") and "spec_depth" in s for s in client.stats()["workers"].values()),
             120, "both workers to serve")


def test_greedy_results_through_the_client_equal_no_speculation(client, llama_dir, plain_config):
    prompts = [TEXTS[i % len(TEXTS)] if i % 2 else random_prompt(3 + 5 * i, seed=i) for i in range(16)]
    params = [ns.SamplingParams(max_tokens=10 + i, temperature=0, ignore_eos=True,
                                stop=["lazy"] if i == 1 else ())
              for i in range(16)]
    expected = reference_outputs(llama_dir, plain_config, prompts, params)
    # speculation did run: n-gram drafts on these prompts are accepted; the perturbed draft model's first
    # drafts mostly are not (0 of 25 accepted in one run), so there the test counts verifications
    key = "spec_num_accepted_tokens" if client.method == "ngram" else "spec_num_drafts"
    before = num_speculated(client, key)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda a: collect(client.stream(*a)), zip(prompts, params)))
    assert [g[:3] for g in got] == [(e.token_ids, e.text, e.finish_reason) for e in expected]
    after = num_speculated(client, key)
    assert sum(after.values()) > sum(before.values()), after
    for stats in client.stats()["workers"].values():
        assert {"spec_num_drafts", "spec_accepted_per_position", "spec_depth",
                "spec_accept_rate_ema"} <= set(stats)


@pytest.mark.load_sensitive
def test_killing_a_speculating_worker_mid_stream_changes_no_token(client, llama_dir, plain_config):
    # seeded sampling gives the tokens of no speculation whatever drafted them
    # (scheduling/sampling/step_sampler.py)
    params = [ns.SamplingParams(max_tokens=200, temperature=0, ignore_eos=True) if i % 2
              else
              ns.SamplingParams(max_tokens=200, temperature=0.9, top_p=0.95, seed=i, frequency_penalty=0.5,
                                ignore_eos=True) for i in range(8)]
    prompts = [random_prompt(20, seed=700 + i) + random_prompt(6, seed=i) * 3 for i in range(8)]
    expected = reference_outputs(llama_dir, plain_config, prompts, params)  # no speculation: same tokens
    wait_for_both_workers(client)
    rerouted_before = client.stats()["routed"]["reroute"]
    survivor, before = "local-numa1-0", num_accepted(client)
    victim_pid = worker_pid(client, "local-numa0-0")
    streams = [client.stream(p, sp) for p, sp in zip(prompts, params)]
    firsts = [next(s) for s in streams]
    with paused(client):  # the victim's streams are in flight when it dies, whatever this machine's speed
        ray.kill(ray.get_actor(f"{NAME}.worker.local-numa0-0", namespace="numaserve"), no_restart=False)
    rests = [collect(s) for s in streams]
    wait_for_restart(client, "local-numa0-0", victim_pid)
    assert [f.token_ids + r[0] for f, r in zip(firsts, rests)] == [e.token_ids for e in expected]
    assert [f.text + r[1] for f, r in zip(firsts, rests)] == [e.text for e in expected]
    assert client.stats()["routed"]["reroute"] > rerouted_before
    assert num_accepted(client)[survivor] > before[survivor]  # it speculated, on the moved requests too


@pytest.mark.load_sensitive
def test_workers_apply_the_speculation_policy_the_scheduler_pushes(client):
    wait_for_both_workers(client)
    params = ns.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    streams = [client.stream(random_prompt(12, seed=31 + i) * 4, params) for i in range(8)]  # copy-heavy
    for stream in streams:
        next(stream)
        next(stream)  # a decode step ran for it (mode "on": it drafted)

    def live():  # a worker in the middle of the streams (mode "on": drafting)
        stats = client.stats()
        return next(((w, s, stats["policies"][w]["speculation"][0]) for w, s in stats["workers"].items()
                     if s.get("num_running") and (s["spec_depth"] or client.mode != "on")), None)
    with paused(client):  # the streams stay in the middle while the test looks
        worker_id, stats, policy = wait_for(live, 30, "a worker serving the streams")
    if client.mode == "on":  # forced: the pushed depth is the configured one, and the worker drafts that deep
        assert stats["spec_depth"] == policy["max_depth"] == stats["spec_max_depth"] == 4
    else:
        assert stats["spec_depth"] <= policy["max_depth"]
    for stream in streams:
        collect(stream)

    def same_policy():  # once idle, the worker's telemetry no longer changes: the last push is in force
        stats = client.stats()
        return all(s["spec_policy_source"] == "scheduler"
                   and in_force(s) == pushed(stats["policies"][w]["speculation"][0])
                   for w, s in stats["workers"].items()) and stats
    stats = wait_for(same_policy, 20, "every worker to apply the scheduler's last policy")
    for worker_id, policy in stats["policies"].items():
        # forced "on" stays on; auto decides
        assert [p["mode"] for p in policy["speculation"]] == [client.mode]
        [telemetry] = policy["telemetry"]["speculation"]  # one method, one policy
        assert telemetry["method"] == client.method and telemetry["num_step_costs"] > 0
        assert tuple(telemetry["accept_rates"]) == tuple(stats["workers"][worker_id]["spec_accept_rate_ema"])


@ray.remote(num_cpus=0)
class PushingScheduler:
    """Answers every report with one fixed Policy; keeps the last telemetry it got."""

    def __init__(self, policy: Policy):
        self.policy, self.last = policy, None

    def report(self, telemetry):
        self.last = telemetry
        return self.policy

    def last_telemetry(self):
        return self.last


def test_a_worker_drafts_at_the_depth_its_scheduler_pushes_not_its_configured_one(ray_cluster, llama_dir,
                                                                                   plain_config):
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": SPEC | {"mode": "auto"}})
    forced = SpeculationPolicy("on", 2, (0.6,) * 4, 1.0, 1 / 16, 0.0, 1.0, 1.0)
    scheduler = PushingScheduler.remote(Policy(256, 16, 32, (forced,)))
    placement = config.placements()[1]
    worker = NumaWorker.options(runtime_env={"env_vars": {"NUMBA_NUM_THREADS": "1",
                                                          "OMP_NUM_THREADS": "1"}}).remote(
        placement, str(llama_dir), config.worker_engine_config(placement), scheduler, None, 0.05)
    try:
        ray.get(worker.info.remote(), timeout=120)
        wait_for(lambda: ray.get(scheduler.last_telemetry.remote()) is not None, 10, "the first report")
        prompt = random_prompt(12, seed=32) * 4
        params = ns.SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        token_ids = [t for out in worker_outputs(worker, GenerateRequest("r0", prompt, params))
                     for t in out.token_ids]
        assert token_ids == reference_outputs(llama_dir, plain_config, [prompt], params)[0].token_ids
        stats = ray.get(worker.stats.remote())
        assert stats["spec_policy_source"] == "scheduler" and stats["spec_max_depth"] == 2
        # forced on at depth 2: two drafts per run (its own controller would decide from acceptance up to 4)
        assert stats["spec_num_drafts"] < stats["spec_num_draft_tokens"] <= 2 * stats["spec_num_drafts"]
        assert stats["spec_verified_per_position"][2:] == [0, 0]
        [telemetry] = ray.get(scheduler.last_telemetry.remote()).speculation
        assert telemetry.config == config.engine.speculation and len(telemetry.accept_rates) == 4
        assert telemetry.step_costs and telemetry.cost_prior == (0.0, 0.0) and not telemetry.catches_up
    finally:
        ray.kill(worker)
        ray.kill(scheduler)


def test_workers_keep_the_last_policy_and_serve_exactly_when_the_scheduler_is_gone(client, llama_dir,
                                                                                   plain_config):
    # last in the module: the scheduler does not come back in this deployment
    wait_for_both_workers(client)
    def settled():
        stats = client.stats()
        return all(in_force(s) == pushed(stats["policies"][w]["speculation"][0])
                   for w, s in stats["workers"].items()) \
            and {w: pushed(p["speculation"][0]) for w, p in stats["policies"].items()}
    wait_for(settled, 20, "every worker to apply the scheduler's last policy")
    ray.kill(ray.get_actor(f"{NAME}.scheduler", namespace="numaserve"), no_restart=True)
    # a report answered just before the kill may still be applied: the policy to keep is the one in force
    # once each worker has had a report go unanswered (one report in flight at a time; no answer after it)
    def unanswered():
        workers = client.stats()["workers"]
        return all(s.get("scheduler_error") for s in workers.values()) and workers
    gone = wait_for(unanswered, 30, "each worker to see the scheduler gone")
    last = {w: in_force(s) for w, s in gone.items()}
    before = num_speculated(client, "spec_num_drafts")
    prompts = [random_prompt(10, seed=800 + i) * 3 for i in range(8)]
    params = ns.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = reference_outputs(llama_dir, plain_config, prompts, params)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: collect(client.stream(p, params)), prompts))
    assert [g[:3] for g in got] == [(e.token_ids, e.text, e.finish_reason) for e in expected]
    stats = client.stats()  # still answers, saying the scheduler is gone
    assert "ActorDiedError" in stats["policies"]["error"]
    for worker_id, policy in last.items():
        assert stats["workers"][worker_id]["spec_policy_source"] == "scheduler"
        assert in_force(stats["workers"][worker_id]) == policy  # not re-decided locally
    assert sum(num_speculated(client, "spec_num_drafts").values()) > sum(before.values())  # it speculated
