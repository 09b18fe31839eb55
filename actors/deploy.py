"""serve() / connect() / shutdown().

A deployment is a set of named detached actors in the "numaserve" namespace: `<name>.adapters`,
`<name>.scheduler` and its routers `<name>.router`, `<name>.router.1`, ... (router.replicas) on the head node;
its OpenAI-compatible HTTP servers when configured, `<name>.http` on the head node and `<name>.http.1`, ...
(http.replicas, by default one per machine) spread over the cluster's nodes by Ray's SPREAD strategy (best
effort: those that share a machine share the port through SO_REUSEPORT); and
`<name>.worker.<machine>-numa<node>-<replica>`, each placed on its NUMA node by the custom resource
`numa_<machine>_<node>` its machine declares (a tensor-parallel worker on its group's nodes: it holds each
one's resource, and starts its follower ranks pinned to their cores).
"""

import json
import logging
import math
import re
import time
from pathlib import Path

import ray

from actors.adapter_cache import AdapterCache
from actors.client import Client
from actors.deployment_actors import deployment_actor_names, replica_name, replica_names, shutdown
from actors.http_server import HttpServer, fingerprint, served_model_name
from actors.ray_instance import NAMESPACE, find_address, join, start_local
from actors.router import Router
from actors.scheduler import Scheduler
from actors.worker import NumaWorker
from cluster_configs.cluster_config import NAME_PATTERN, ClusterConfig, HttpConfig, WorkerPlacement
from cluster_configs.errors import CheckpointError, NumaserveError
from memory import numa
from models.loader import read_spec
from models.model_spec import load_spec
from scheduling.memory_fit import fitting_size, rank_memory
from scheduling.policy import PolicyLimits

# control actors live on the head node, which outlives worker machines
HEAD = {"node:__internal_head__": 0.001}
READY_TIMEOUT_S = 600.0
RELEASE_WAIT_S = 5.0
GIB = 1 << 30
log = logging.getLogger("numaserve")


class DeploymentError(NumaserveError):
    """A deployment that cannot be started, found or reached."""


def serve(config: ClusterConfig | str | Path | None = None, model: str | Path | None = None,
          name: str = "numaserve", http_port: int | None = None, http_host: str | None = None) -> Client:
    """Start a deployment (config: ClusterConfig, YAML path, or None = one machine, auto topology). With
    http_port (or `http:` in the config), it also serves the OpenAI-compatible API at http_host (default
    127.0.0.1): client.http_url."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise DeploymentError(f"deployment name {name!r} is not valid: use letters, digits, '_' and '-'")
    config = with_http(load_config(config, model), port=http_port, host=http_host)
    init_ray(config)
    if deployment_actor_names(name):
        raise DeploymentError(f"a deployment named {name!r} is already running; use "
                              f"numaserve.connect({name!r}) or shut it down first")
    placements = config.placements()
    check_memory(config, placements)
    check_resources(config, placements)
    try:
        return _start(config, placements, name)
    except BaseException:
        shutdown(name)
        raise


def connect(name: str = "numaserve", address: str | None = None) -> Client:
    """A Client of the running deployment `name`, from any driver (or a `ray job submit` entrypoint);
    address: the Ray cluster's (default: RAY_ADDRESS, else the one `ray start` recorded)."""
    if not ray.is_initialized():
        found = find_address(address)
        if found is None:
            raise DeploymentError("no Ray cluster is running here (RAY_ADDRESS is unset and `ray start` "
                                  "recorded none); start a deployment with `numaserve serve --detach`, or "
                                  "pass --address")
        join(found)
    try:
        routers = [ray.get_actor(n, namespace=NAMESPACE) for n in replica_names(name, "router")] or [
            ray.get_actor(f"{name}.router", namespace=NAMESPACE)]
        adapter_cache = ray.get_actor(f"{name}.adapters", namespace=NAMESPACE)
    except ValueError:
        raise DeploymentError(f"no numaserve deployment named {name!r} in this Ray cluster; start one with "
                              "numaserve.serve(...) or `numaserve serve --config ...`") from None
    return Client(name, routers, adapter_cache, _http_url(name))


# ---- configuration and the Ray cluster ---------------------------------------------------------------

def with_http(config: ClusterConfig, port: int | None = None, host: str | None = None,
              served_model_name: str | None = None) -> ClusterConfig:
    """The config with these HTTP server settings over its own (`http:`); a port turns the server on."""
    update = {k: v for k, v in (("port", port), ("host", host), ("served_model_name", served_model_name))
              if v is not None}
    if not update:
        return config
    if config.http is None and port is None:
        raise DeploymentError(f"{', '.join(update)} given without an HTTP port; pass the port too "
                              "(http_port=..., --http-port) or set `http: {port: ...}` in the config")
    http = (config.http or HttpConfig()).model_dump() | update
    # a bad value: names http.<field>
    return ClusterConfig.model_validate(config.model_dump() | {"http": http})


def load_config(config: ClusterConfig | str | Path | None, model: str | Path | None = None) -> ClusterConfig:
    """The config with its model set and checked, and "auto" machines resolved to this machine's topology."""
    if config is None:
        config = ClusterConfig()
    elif isinstance(config, (str, Path)):
        config = ClusterConfig.from_yaml(config)
    elif not isinstance(config, ClusterConfig):
        raise DeploymentError("config must be a ClusterConfig, a YAML path or None, got "
                              f"{type(config).__name__}")
    if model is not None:
        config = config.model_copy(update={"model": str(Path(model).expanduser().resolve())})
    if config.model is None:
        raise DeploymentError("no model to serve: pass serve(model=...) or set `model:` in the config")
    _check_model(Path(config.model))
    if config.has_auto_topology:
        config = config.with_topology([(n.node_id, n.cpu_ids) for n in numa.read_topology()])
    return config


def _check_model(path: Path) -> None:
    """CheckpointError now rather than from every worker."""
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"{path}: no such GGUF file")
    else:
        load_spec(path)


def init_ray(config: ClusterConfig, persistent: bool = False, address: str | None = None) -> bool:
    """Join the live Ray cluster (address, else RAY_ADDRESS, else the one `ray start` recorded: never a hang
    on a dead one, actors/ray_instance.py); without one, start a single-machine one declaring its NUMA
    nodes, bound to loopback: in this process (it ends with it), or with `ray start --head` when persistent.
    -> whether it started one."""
    if ray.is_initialized():
        return False
    found = find_address(address)
    if found is not None:
        join(found)
        return False
    if len(config.machines) != 1:
        raise DeploymentError(f"no Ray cluster is running and the config spans {len(config.machines)} "
                              "machines; start Ray on each with its resources: " + _start_hints(config))
    if not persistent:
        log.warning("numaserve: started Ray in this process; the deployment ends when it exits")
    start_local(config.ray_resources(config.machines[0].name), persistent)
    return True


def check_resources(config: ClusterConfig, placements: list[WorkerPlacement]) -> None:
    total = ray.cluster_resources()
    resources = {r for p in placements for r in p.resources}
    missing = sorted(r for r in resources if total.get(r, 0) <= 0)
    if missing:
        raise DeploymentError(f"no Ray node offers {', '.join(missing)}: each machine must declare its NUMA "
                              "nodes when it joins; " + _start_hints(config))
    deadline = time.monotonic() + RELEASE_WAIT_S
    while busy := sorted(r for r in resources
                         if ray.available_resources().get(r, 0) < _worker_share(config) - 1e-9):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)  # a deployment that was just shut down releases them in a moment
    if busy:
        raise DeploymentError(f"{', '.join(busy)} are taken by another deployment; shut it down first "
                              "(numaserve shutdown --name NAME)")


def check_memory(config: ClusterConfig, placements: list[WorkerPlacement]) -> None:
    """DeploymentError where a worker's ranks (workers_per_node of them on a node) would not fit a node's
    memory: its declared memory_gib, else /sys's for the one machine of a config that has one (others
    unchecked); it names the tensor_parallel_size that would fit (scheduling/memory_fit.py's estimate)."""
    spec = read_spec(config.model)
    need = rank_memory(spec, config.engine)
    workers = config.workers_per_node
    for p in placements:
        for node_id, gib in p.nodes:
            have = (gib * GIB if gib is not None else
                    numa.node_memory_bytes(node_id) if len(config.machines) == 1 else None)
            if have is None or need.total * workers <= have:
                continue
            n = len(next(m for m in config.machines if m.name == p.machine).numa_nodes)
            sizes = [s for s in range(1, n + 1) if n % s == 0]
            fit = fitting_size(spec, config.engine, have // workers, sizes)
            advice = (f"set engine.tensor_parallel_size: {fit[0]} (about {fit[1].total / GIB:.3g} GiB a rank)"
                      if fit is not None else f"no tensor_parallel_size up to its {n} nodes fits; lower "
                      "engine.kv_cache_bytes or pick a smaller engine.weight_dtype")
            raise DeploymentError(
                f"{Path(config.model).name} needs about {need.total * workers / GIB:.3g} GiB on NUMA node "
                f"{node_id} of machine {p.machine!r} at tensor_parallel_size "
                f"{config.engine.tensor_parallel_size} (a rank's weights {need.weight_bytes / GIB:.3g} GiB + "
                f"KV {need.kv_cache_bytes / GIB:.3g} GiB, {workers} worker(s) a node), and the node has "
                f"{have / GIB:.3g} GiB: {advice}")


def _start_hints(config: ClusterConfig) -> str:
    return "; ".join(f"on {m.name}: ray start ... --resources='{json.dumps(config.ray_resources(m.name))}'"
                     for m in config.machines)


def _worker_share(config: ClusterConfig) -> float:
    return math.floor(1e4 / config.workers_per_node) / 1e4  # Ray keeps 4 decimals of a resource


# ---- starting the actors -----------------------------------------------------------------------------

# Ray runs a worker process's Python threads at nice 15 (RAY_worker_niceness), below its own threads, raylet,
# drivers and any process it is starting: with every core decoding, a restarting adapter cache's new process
# then took a core from a worker's streams, and a large body's POST was slowed. These actors are the service,
# so they run at 0, as Ray's own job supervisor does (benchmarks/results/HISTORY.md)
SERVING_ENV = {"RAY_worker_niceness": "0"}

def _start(config: ClusterConfig, placements: list[WorkerPlacement], name: str) -> Client:
    detached = {"namespace": NAMESPACE, "lifetime": "detached", "max_restarts": -1,
                "runtime_env": {"env_vars": SERVING_ENV}}
    registry = config.adapter_registry or str(Path.home() / ".cache" / "numaserve" / f"adapters-{name}.json")
    adapter_cache = AdapterCache.options(name=f"{name}.adapters", resources=HEAD, **detached).remote(
        registry, name, config.model, config.engine.max_lora_rank, config.engine.adapter_roots,
        config.adapter_cache_bytes, config.engine.lora_merged_bytes)
    limits = PolicyLimits(config.engine.max_num_batched_tokens, config.engine.max_num_seqs,
                          config.max_queued_per_worker, config.target_step_ms / 1000)
    scheduler = Scheduler.options(name=f"{name}.scheduler", resources=HEAD, **detached).remote(limits)
    workers = {}
    for p in placements:
        engine_config = config.worker_engine_config(p)
        num_threads = str(engine_config.num_threads)  # numba sizes its pool once, when it loads
        env = SERVING_ENV | {"NUMBA_NUM_THREADS": num_threads, "OMP_NUM_THREADS": num_threads}
        workers[p.worker_id] = NumaWorker.options(
            name=f"{name}.worker.{p.worker_id}", resources=dict.fromkeys(p.resources, _worker_share(config)),
            **detached | {"runtime_env": {"env_vars": env}}).remote(
                p, config.model, engine_config, scheduler, adapter_cache, config.telemetry_interval_s,
                config.stream_interval_ms / 1000, model_name=served_model_name(config))
    deadline = time.monotonic() + READY_TIMEOUT_S
    _wait_ready({f"worker {w}": h.info.remote() for w, h in workers.items()}, deadline)
    routers = [Router.options(name=replica_name(name, "router", i), resources=HEAD, **detached).remote(
        config, workers, scheduler, adapter_cache) for i in range(config.router.replicas)]
    _wait_ready({f"router {i}": r.ping.remote() for i, r in enumerate(routers)}, deadline)
    http_url = None
    share_port = config.num_http_actors > 1
    https = []
    for i in range(config.num_http_actors):
        where = {"resources": HEAD} if i == 0 else {"scheduling_strategy": "SPREAD"}
        https.append(HttpServer.options(name=replica_name(name, "http", i), **where, **detached).remote(
            config.http, served_model_name(config), config.model, fingerprint(config), routers, adapter_cache,
            i, share_port))
    if https:
        where = f"{config.http.host}:{config.http.port}"
        http_url = _wait_ready({f"HTTP server {i} on {where}": h.ready.remote() for i, h in enumerate(https)},
                               deadline)
    return Client(name, routers, adapter_cache, http_url)


def _http_url(name: str) -> str | None:
    try:
        return ray.get(ray.get_actor(f"{name}.http", namespace=NAMESPACE).ready.remote(),
                       timeout=READY_TIMEOUT_S)
    except ValueError:
        return None  # no HTTP server in this deployment


def _wait_ready(waits: dict, deadline: float):
    """ray.get of each ref in turn (-> the last one's value), or DeploymentError naming what did not start."""
    value = None
    for what, ref in waits.items():
        try:
            value = ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.GetTimeoutError:
            raise DeploymentError(f"{what} did not start within {READY_TIMEOUT_S:.0f} s; `ray status` shows "
                                  "whether its machine's resources are there") from None
        except ray.exceptions.RayError as e:
            raise DeploymentError(f"{what} failed to start: {e}") from None
    return value
