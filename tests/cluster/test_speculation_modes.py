"""The load-aware speculation modes through the deployment: the scheduler actor decides each worker's depths
(tests/cluster/test_speculation_serving.py's deployments run mode "on"), and greedy results stay those of no
speculation. A module of its own: each mode is one deployment, started after that module's have shut down."""

from concurrent.futures import ThreadPoolExecutor

import pytest

import numaserve as ns
from tests.cluster.conftest import collect, reference_outputs, sim_config
from tests.cluster.test_speculation_serving import SPEC, TEXTS
from tests.conftest import random_prompt


@pytest.mark.parametrize("mode", ["auto", "latency_first", "throughput_first"])
def test_load_aware_modes_through_the_client_equal_no_speculation(ray_cluster, llama_dir, mode):
    prompts = [TEXTS[i % len(TEXTS)] * 2 if i % 2 else random_prompt(3 + 5 * i, seed=i) for i in range(16)]
    params = [ns.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(16)]
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16, "speculation": SPEC | {"mode": mode}})
    expected = reference_outputs(llama_dir, sim_config("two_numa_sim", engine={"max_num_seqs": 16}), prompts, params)
    client = ns.serve(config, model=llama_dir, name=f"speculation-{mode}")
    try:
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda a: collect(client.stream(*a)), zip(prompts, params)))
        assert [g[0] for g in got] == [e.token_ids for e in expected]
        # the mode ran: each worker speculates under the scheduler actor's policy for it. Whether that policy
        # drafts depends on this machine's measured step costs (a CI run once priced n-gram drafts out under
        # throughput_first, correctly for its costs); that the modes draft where drafts pay is
        # tests/test_speculation.py's, under a fixed cost model
        workers = client.stats()["workers"].values()
        assert all(w["spec_policy_source"] == "scheduler" and w["spec_mode"] == mode for w in workers), workers
    finally:
        client.shutdown()
