"""A 90-second chaos soak (`python -m benchmarks.bench_soak --http --chaos`, shortened): the HTTP soak's mix
(chat and completions, streamed or not, an adapter, deadlines, client disconnects) while a worker, the router,
the scheduler, the adapter cache and one of the two HTTP actors are killed in turn, each once recovered from
before the next (the soak goes on until every kind has been). No request hangs; none is answered a 5xx other
than a typed 503 while an actor restarted; a connection breaks only when its HTTP actor is killed; every
greedy request that completed answers as it does undisturbed; no KV block is leaked."""

import pytest

import numaserve as ns
from benchmarks.chaos import KINDS, Chaos
from benchmarks.ports import free_port
from benchmarks.soak_http import run_http_soak
from tests.cluster.conftest import sim_config
from tests.models.test_lora import make_adapter


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    # two HTTP actors share the port (SO_REUSEPORT), as bench_soak --chaos deploys: one killed, the other
    # serves while it restarts
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16}, max_queued_per_worker=16,
                        adapter_registry=str(root / "adapters.json"),
                        http={"port": free_port(), "replicas": 2})
    client = ns.serve(config, model=llama_dir, name="chaos-test")
    client.register_adapter("a", make_adapter(llama_dir, root / "a", seed=1))
    yield client
    client.shutdown()


@pytest.mark.load_sensitive
def test_a_90_s_chaos_soak_kills_every_kind_of_actor_and_loses_no_request(client):
    chaos = Chaos(client, "a", seed=0, interval_s=(3.0, 6.0))
    result = run_http_soak(client, duration_s=90, rate_per_s=4, adapter="a", seed=1, chaos=chaos)
    summary = {k: v for k, v in result.items() if k != "outcomes"}
    print({k: v for k, v in summary.items() if k != "chaos"}, {k: v for k, v in result["chaos"].items()
                                                                if k != "kills"})
    killed = result["chaos"]["kills_by_kind"]
    assert all(killed[kind] >= 1 for kind in KINDS), summary
    assert result["chaos"]["num_not_recovered"] == 0, summary
    assert result["num_hung"] == 0 and result["num_errors"] == 0, summary
    assert result["num_5xx"] == result["num_503_during_restart"], summary  # typed 503s only
    assert result["num_greedy_checked"] > 0 and result["num_greedy_mismatched"] == 0, summary
    assert result["num_blocks_leaked"] == 0 and result["num_requests_left"] == 0, summary
    assert min(result["by_kind"].values()) > 0, summary
