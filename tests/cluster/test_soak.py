"""A 60 s soak of the two_numa_sim deployment (benchmarks/bench_soak.py's driver): Poisson arrivals, mixed
lengths, clients disconnecting, deadlines expiring, an adapter. Every request ends the way its kind should,
none hangs, no KV block stays in use after the drain, and worker RSS grows by less than RSS_GROWTH_BOUND.
At the same time the same through the OpenAI API and the openai client (benchmarks/soak_http.py): chat and
completions, streamed and not, 10% of the streams closed by their client, 10% of the requests past their
deadline_s."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import numaserve as ns
from benchmarks.bench_soak import run_soak
from benchmarks.ports import free_port
from benchmarks.soak_http import run_http_soak
from tests.cluster.conftest import sim_config
from tests.models.test_lora import make_adapter

RSS_GROWTH_BOUND = 64 << 20  # bytes per worker over the soak (the 10-minute run: docs/performance.md "Soak")


@pytest.fixture(scope="module")
def client(ray_cluster, llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16}, max_queued_per_worker=16,
                        adapter_registry=str(root / "adapters.json"), http={"port": free_port()})
    client = ns.serve(config, model=llama_dir, name="soak-test")
    client.register_adapter("a", make_adapter(llama_dir, root / "a", seed=1))
    yield client
    client.shutdown()


def test_a_60_s_soak_through_the_client_and_over_http_at_once_ends_every_request_as_expected(client):
    """Both drivers on the deployment side by side (their arrivals start together), each drain waiting for
    the whole deployment: after it no KV block is in use and no request is left."""
    start = threading.Barrier(2, timeout=120)  # a driver failing before its arrivals: the other's wait ends
    with ThreadPoolExecutor(2) as pool:
        direct = pool.submit(run_soak, client, duration_s=60, rate_per_s=8, adapter="a", seed=0, start=start)
        http = pool.submit(run_http_soak, client, duration_s=60, rate_per_s=4, adapter="a", seed=0,
                           start=start)
        direct, http = direct.result(), http.result()
    check_client_soak(direct)
    check_http_soak(http)


def check_client_soak(result: dict) -> None:
    summary = {k: v for k, v in result.items() if k != "outcomes"}
    assert result["num_hung"] == 0 and result["num_errors"] == 0, summary
    by_kind = result["by_kind"]
    assert min(by_kind.values()) > 0, summary  # every kind of request took part
    assert result["num_completed"] >= by_kind["plain"] + by_kind["adapter"], summary
    assert result["num_deadline_aborted"] > 0 and result["num_disconnected"] > 0, summary
    assert result["num_blocks_leaked"] == 0 and result["num_requests_left"] == 0, summary
    for worker, before in result["rss_before_bytes"].items():
        assert result["rss_after_bytes"][worker] - before < RSS_GROWTH_BOUND, summary


def check_http_soak(result: dict) -> None:
    summary = {k: v for k, v in result.items() if k != "outcomes"}
    assert result["num_hung"] == 0 and result["num_errors"] == 0, summary
    assert min(result["by_kind"].values()) > 0 and min(result["by_api"].values()) > 0, summary
    assert result["num_disconnected"] > 0, summary  # how many finish first depends on the machine's speed
    assert result["num_deadline_408"] + result["num_deadline_aborted_mid_stream"] > 0, summary
    assert result["num_blocks_leaked"] == 0 and result["num_requests_left"] == 0, summary
    assert max(result["rss_growth_bytes"].values()) < RSS_GROWTH_BOUND, summary
