"""One Ray cluster (ray.cluster_utils.Cluster) for the whole session. Its head node is machine `local` of
two_numa_sim.yaml and machine `sim0` of two_node_sim.yaml at once (it declares both sets of NUMA
resources); the multi-machine test adds machine `sim1` and removes it again."""

import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families
from ray.cluster_utils import Cluster

import numaserve as ns

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "cluster_configs"


def sim_config(name: str, **fields) -> ns.ClusterConfig:
    """A shipped config with some fields replaced (and validated again)."""
    base = ns.ClusterConfig.from_yaml(CONFIGS / f"{name}.yaml").model_dump()
    engine = base.pop("engine") | fields.pop("engine", {})
    return ns.ClusterConfig.model_validate(base | fields | {"engine": engine})


def reference_outputs(model_dir, config: ns.ClusterConfig, prompts: list,
                      params: ns.SamplingParams | list[ns.SamplingParams],
                      adapters: dict | None = None) -> list[ns.Completion]:
    """The same prompts through the in-process engine with the workers' engine config."""
    llm = ns.LLM(model_dir, **config.engine.model_dump(exclude={"num_threads"}))
    for name, path in (adapters or {}).items():
        llm.register_adapter(name, path)
    return llm.generate(prompts, params, adapter=next(iter(adapters), None) if adapters else None)


def wait_for(condition, timeout_s: float, what: str):
    """condition()'s first truthy value, polled every 0.1 s; fails naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@contextmanager
def paused(client, worker_ids: list[str] | None = None):
    """Inside the block the workers (all, or worker_ids) take no step: a request in flight stays in flight
    whatever this machine's speed, so what the test does to it happens mid-request by construction."""
    every = list(worker_ids or client.stats()["workers"])
    try:
        assert sorted(client.pause_generation(worker_ids)) == sorted(every), (
            "a worker to pause did not answer")
        yield
    finally:
        client.resume_generation(worker_ids)


def queued(client) -> int:
    """Requests in the workers' engines (-1 while a worker does not answer)."""
    workers = client.stats()["workers"].values()
    return sum(w["num_waiting"] + w["num_running"] if "num_waiting" in w else -1 for w in workers)


def idle(client) -> bool:
    """Every worker answered, and holds nothing (a worker busy past the router's stats timeout is not idle
    yet)."""
    keys = ("num_running", "num_waiting", "kv_usage", "num_streams", "num_outstanding_requests")
    return all(w.get(k) == 0 for w in client.stats()["workers"].values() for k in keys)


def scrape(url: str) -> list:
    """The samples of GET /metrics, parsed as Prometheus text."""
    r = requests.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return [sample for family in text_string_to_metric_families(r.text) for sample in family.samples]


def advance(client, num_steps: int = 1) -> None:
    """Every worker of a paused deployment takes num_steps steps (fewer if it runs out of requests), then
    stays paused."""
    for worker_id in client.stats()["workers"]:
        ray.get(ray.get_actor(f"{client.name}.worker.{worker_id}",
                              namespace="numaserve").advance.remote(num_steps))


def worker_pid(client, worker_id: str) -> int | None:
    """The worker's process id, None while the router has it down or it does not answer."""
    stats = client.stats()["workers"][worker_id]
    return stats["info"]["pid"] if stats.get("alive") and "info" in stats else None


def wait_for_restart(client, worker_id: str, old_pid: int, timeout_s: float = 120) -> None:
    """A killed worker is back: a new process, warmed up and taken back by the router."""
    wait_for(lambda: worker_pid(client, worker_id) not in (None, old_pid), timeout_s,
             f"worker {worker_id} to restart and rejoin")


def collect(stream) -> tuple[list[int], str, str | None, int]:
    """token ids, text, finish reason and number of chunks of one client stream."""
    token_ids, text, reason, num_chunks = [], "", None, 0
    for chunk in stream:
        token_ids += chunk.token_ids
        text += chunk.text
        reason = chunk.finish_reason
        num_chunks += 1
    return token_ids, text, reason, num_chunks


@pytest.fixture(scope="session")
def ray_cluster():
    resources = (sim_config("two_numa_sim").ray_resources("local")
                 | sim_config("two_node_sim").ray_resources("sim0"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": resources, "include_dashboard": True, "dashboard_port": 0})
    ray.init(address=cluster.address, namespace="numaserve", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
