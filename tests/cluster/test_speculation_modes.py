"""The load-aware speculation modes through the deployment: the scheduler actor decides each worker's depths
(tests/cluster/test_speculation_serving.py's deployments run mode "on"), and greedy results stay those of no
speculation. A module of its own: each mode is one deployment, started after that module's have shut down."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

import numaserve as ns
from models.proposers.medusa_head import CONFIG_FILE as MEDUSA_CONFIG
from models.proposers.medusa_head import HEADS_FILE as MEDUSA_HEADS
from tests.cluster.conftest import collect, reference_outputs, sim_config, wait_for
from tests.cluster.test_speculation_serving import SPEC, TEXTS
from tests.conftest import random_prompt
from tests.support.eagle_factory import model_with_eagle
from tests.support.medusa_factory import model_with_heads


@pytest.mark.parametrize("mode", ["auto", "latency_first", "throughput_first"])
def test_load_aware_modes_through_the_client_equal_no_speculation(ray_cluster, llama_dir, mode):
    prompts = [TEXTS[i % len(TEXTS)] * 2 if i % 2 else random_prompt(3 + 5 * i, seed=i) for i in range(16)]
    params = [ns.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(16)]
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": SPEC | {"mode": mode}})
    expected = reference_outputs(llama_dir, sim_config("two_numa_sim", engine={"max_num_seqs": 16}),
                                 prompts, params)
    client = ns.serve(config, model=llama_dir, name=f"speculation-{mode}")
    try:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda a: collect(client.stream(*a)), zip(prompts, params)))
        assert [g[0] for g in got] == [e.token_ids for e in expected]
        # the mode ran: each worker speculates under the scheduler actor's policy for it. Whether that policy
        # drafts depends on this machine's measured step costs (a CI run once priced n-gram drafts out under
        # throughput_first, correctly for its costs); that the modes draft where drafts pay is
        # tests/scheduling/test_speculation.py's, under a fixed cost model
        workers = client.stats()["workers"].values()
        assert all(w["spec_policy_source"] == "scheduler" and w["spec_mode"] == mode
                   for w in workers), workers
    finally:
        client.shutdown()


def test_method_auto_through_the_client_equals_no_speculation_under_the_schedulers_policies(ray_cluster,
                                                                                            llama_dir,
                                                                                            tmp_path):
    """Method "auto" on a model with random Medusa heads and a random EAGLE head beside it: the worker reports
    one SpecTelemetry per method (n-gram, Medusa, EAGLE), the scheduler answers one policy for each, and the
    tokens are no speculation's whichever method drafts."""
    medusa = model_with_heads(llama_dir, tmp_path / "medusa", num_heads=2)
    model = model_with_eagle(llama_dir, tmp_path / "model")
    for file in (MEDUSA_HEADS, MEDUSA_CONFIG):
        shutil.copy(medusa / file, model / file)
    prompts = [TEXTS[i % len(TEXTS)] * 2 if i % 2 else random_prompt(3 + 5 * i, seed=i) for i in range(8)]
    params = [ns.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(8)]
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": {"method": "auto"}})
    expected = reference_outputs(llama_dir, sim_config("two_numa_sim", engine={"max_num_seqs": 16}),
                                 prompts, params)
    client = ns.serve(config, model=model, name="speculation-method-auto")
    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda a: collect(client.stream(*a)), zip(prompts, params)))
        assert [g[0] for g in got] == [e.token_ids for e in expected]

        def applied():
            stats = client.stats()
            return all(w["spec_method"] == "auto" and list(w["spec_methods"]) == ["ngram", "medusa", "eagle"]
                       and all(m["spec_policy_source"] == "scheduler" for m in w["spec_methods"].values())
                       for w in stats["workers"].values()) and stats
        stats = wait_for(applied, 30, "every worker to apply the scheduler's policies, one per method")
        for policy in stats["policies"].values():
            assert [t["method"] for t in policy["telemetry"]["speculation"]] == ["ngram", "medusa", "eagle"]
            assert len(policy["speculation"]) == 3
    finally:
        client.shutdown()
