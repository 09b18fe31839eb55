"""ClusterConfig: what a deployment runs where. Machines, their NUMA nodes (or "auto"), workers per node,
the engine config every worker gets, the limits the routers, workers and scheduler enforce, the routers and
the HTTP servers.

Several routers (`router.replicas`) and HTTP actors (`http.replicas`, by default one per machine) serve one
deployment without a central counter: each caller (an HTTP actor, an ns.Client) admits through one router
and moves to another if it is lost; a session's requests go to the worker its key hashes to
(scheduling/session_hash.py), whichever router admits them; and each worker refuses a request past its own
admission bound, so the bound holds however many routers admit to it. HTTP actors on one machine share the
port through SO_REUSEPORT (the kernel spreads connections over them): an OS without it can run one.

A worker is placed on its NUMA node by a Ray custom resource, `numa_<machine>_<node>`, that the machine
declares when it joins (`ray start --resources`, see `ray_resources`); capacity 1, split between the
node's workers. With engine.tensor_parallel_size N > 1 a worker is a tensor-parallel group over N nodes of
one machine (its nodes in the config's order, N at a time): the worker actor is rank 0 on the first, its
follower processes each pinned to the next nodes' cores; it takes all N nodes' resources.
"""

import socket
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster_configs.engine_config import EngineConfig

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"


def numa_resource(machine: str, node_id: int) -> str:
    return f"numa_{machine}_{node_id}"


class NumaNodeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int = Field(ge=0)
    cpus: tuple[int, ...] = Field(min_length=1)  # core ids this node's workers are pinned to
    # the node's memory, to simulate a smaller one; None: /sys/devices/system/node/node<id>/meminfo on the
    # machine that starts the deployment (a one-machine config), unchecked on other machines
    memory_gib: float | None = Field(None, gt=0)

    @field_validator("cpus")
    @classmethod
    def _valid_cpus(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(c < 0 for c in v) or len(set(v)) != len(v):
            raise ValueError(f"cpus must be distinct core ids >= 0, got {list(v)}")
        return v


class MachineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("local", pattern=NAME_PATTERN)
    # "auto" = the NUMA nodes of the machine that runs serve() (from /sys/devices/system/node)
    numa_nodes: Literal["auto"] | tuple[NumaNodeConfig, ...] = "auto"

    @field_validator("numa_nodes")
    @classmethod
    def _distinct_nodes(cls, v):
        if v == "auto":
            return v
        if not v:
            raise ValueError('numa_nodes must list at least one node, or be "auto"')
        ids = [n.id for n in v]
        if len(set(ids)) != len(ids):
            raise ValueError(f"numa node ids must be distinct, got {ids}")
        cpus = [c for n in v for c in n.cpus]
        if len(set(cpus)) != len(cpus):
            raise ValueError("two numa nodes share a cpu; give each node its own cores")
        return v


class HttpConfig(BaseModel):
    """The deployment's OpenAI-compatible HTTP server (actors/http_server.py) and the limits it enforces."""

    # errors never echo a key
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", min_length=1)  # loopback only unless a host (e.g. 0.0.0.0) is given
    port: int = Field(8000, ge=1, le=65535)
    # HTTP actors serving this host:port (ClusterConfig.num_http_actors); None: one per machine
    replicas: int | None = Field(None, ge=1, le=64)
    # what `model` names; None: the model's folder name
    served_model_name: str | None = Field(None, min_length=1)
    # POST /v1/load_lora_adapter registers adapters; refused (403) otherwise
    enable_lora_loading: bool = False
    # bearer tokens the server accepts (401 otherwise; /health stays open); each key is a tenant. (): no check
    api_keys: tuple[str, ...] = ()
    # a longer prompt is a 400; None: only max_model_len bounds it
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_tokens_cap: int = Field(4096, ge=1)  # a request's max_tokens above this is a 400
    # a client (API key, else `user`, else its IP address) with this many requests open gets 429 for the next
    max_concurrent_per_client: int = Field(64, ge=1)
    # when a request sets none; None: no deadline
    default_deadline_s: float | None = Field(600.0, gt=0.0, le=86_400.0)
    # browser origins CORS lets call the API ("*": any); (): no CORS headers
    allowed_origins: tuple[str, ...] = ()
    # finds tool calls in the text under tool_choice "auto" (actors/tool_parsers); None: "auto" is a 400
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # /v1/embeddings: the final hidden states of an input pooled as its last token's or their mean
    pooling: Literal["last", "mean"] = "last"
    # the web console at / (http_api/console/): chat and a live view of the workers; its data behind the keys
    ui: bool = True

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_tuple(cls, v):
        return (v,) if isinstance(v, str) else v

    @field_validator("api_keys")
    @classmethod
    def _valid_keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # never echo a key in the message
        if any(not k or any(c.isspace() for c in k) for k in v):
            raise ValueError("api_keys must be non-empty strings without whitespace")
        if len(set(v)) != len(v):
            raise ValueError("api_keys must be distinct (each key is one tenant)")
        return v


class RouterConfig(BaseModel):
    """The deployment's routers (actors/router.py): each places the requests of the callers that chose it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(1, ge=1, le=64)
    # a request placed this long ago that its worker does not stream lost its caller before finish (a killed
    # client): released by the router's sweep. Far above the hop from admission to the worker's stream
    sweep_grace_s: float = Field(30.0, ge=5.0, description="seconds after which a placed request its worker "
                                                           "does not stream is released")


class WorkerPlacement(BaseModel):
    """One worker of a resolved config: where it runs and what it is called."""

    model_config = ConfigDict(frozen=True)

    machine: str
    node_id: int
    cpu_ids: tuple[int, ...]
    replica: int  # index among the workers of its node
    memory_gib: float | None = None  # its node's, when the config declares it
    # a tensor-parallel group's other ranks (1, 2, ...): their NUMA nodes and cores; () with one rank
    rank_node_ids: tuple[int, ...] = ()
    rank_cpu_ids: tuple[tuple[int, ...], ...] = ()
    rank_memory_gib: tuple[float | None, ...] = ()

    @property
    def worker_id(self) -> str:
        return f"{self.machine}-numa{self.node_id}-{self.replica}"

    @property
    def resource(self) -> str:
        return numa_resource(self.machine, self.node_id)

    @property
    def resources(self) -> tuple[str, ...]:
        """The NUMA resources of every node its ranks run on, rank 0's first."""
        return (self.resource, *(numa_resource(self.machine, n) for n in self.rank_node_ids))

    @property
    def nodes(self) -> tuple[tuple[int, float | None], ...]:
        """(NUMA node id, its declared memory_gib) of each rank, rank 0's first."""
        return ((self.node_id, self.memory_gib), *zip(self.rank_node_ids, self.rank_memory_gib))


def node_groups(machine: MachineConfig, size: int) -> list[tuple[NumaNodeConfig, ...]]:
    """The machine's NUMA nodes in groups of `size` (tensor_parallel_size), in the config's order: one
    worker's ranks each; ValueError where they do not divide (a group never spans machines)."""
    nodes = machine.numa_nodes
    if len(nodes) % size:
        raise ValueError(f"engine.tensor_parallel_size {size}: machine {machine.name!r} has {len(nodes)} "
                         f"NUMA node(s), and a tensor-parallel group runs one rank on each of {size} nodes "
                         "of one machine (a group never spans machines); give each machine a multiple of "
                         f"{size} nodes, or lower tensor_parallel_size")
    return [tuple(nodes[i:i + size]) for i in range(0, len(nodes), size)]


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None  # model directory, at the same path on every machine
    engine: EngineConfig = EngineConfig()
    machines: tuple[MachineConfig, ...] = Field((MachineConfig(),), min_length=1)
    workers_per_node: int = Field(1, ge=1, le=64)
    # a worker holds at most max_num_seqs running + this many queued requests; past that it refuses a new
    # one (its caller tries other workers), and past that on every worker the request is Overloaded
    max_queued_per_worker: int = Field(64, ge=0)
    telemetry_interval_s: float = Field(0.1, gt=0.0, le=10.0)  # worker -> scheduler -> policy period
    target_step_ms: float = Field(250.0, gt=0.0)  # the policy shrinks the token budget when steps run longer
    # a stream's first delta goes out at once, later ones at most this often (tokens ready meanwhile ride
    # together): fewer, larger chunks cost less per token through Ray; 0 = every step
    stream_interval_ms: float = Field(100.0, ge=0.0, le=10_000.0)
    adapter_registry: str | None = None  # JSON file of registered adapters; None = under ~/.cache/numaserve
    adapter_cache_bytes: int = Field(1 << 30, gt=0)  # adapter tensors the cache actor keeps loaded (LRU)
    http: HttpConfig | None = None  # None: no HTTP server (Python clients only)
    router: RouterConfig = RouterConfig()

    @field_validator("machines")
    @classmethod
    def _distinct_machines(cls, v: tuple[MachineConfig, ...]) -> tuple[MachineConfig, ...]:
        names = [m.name for m in v]
        if len(set(names)) != len(names):
            raise ValueError(f"machine names must be distinct, got {names}")
        return v

    @model_validator(mode="after")
    def _groups_fit_machines(self) -> "ClusterConfig":
        for m in self.machines:
            if m.numa_nodes != "auto":
                node_groups(m, self.engine.tensor_parallel_size)
        return self

    @model_validator(mode="after")
    def _port_can_be_shared(self) -> "ClusterConfig":
        if self.num_http_actors > 1 and not hasattr(socket, "SO_REUSEPORT"):
            raise ValueError(f"http.replicas: {self.num_http_actors} HTTP actors share one port, which needs "
                             "SO_REUSEPORT, and this OS has none; set http: {replicas: 1}")
        return self

    @property
    def num_http_actors(self) -> int:
        """HTTP actors to start: http.replicas, else one per machine (0 without `http:`)."""
        if self.http is None:
            return 0
        return self.http.replicas or len(self.machines)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ClusterConfig":
        """Load a YAML config; relative `model` and `adapter_registry` paths are taken from the file's
        folder."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: cannot read the config file ({e}); "
                             "pass the path of a YAML file") from None
        if isinstance(data, dict):
            for key in ("model", "adapter_registry"):
                if isinstance(data.get(key), str) and not Path(data[key]).expanduser().is_absolute():
                    data[key] = str((path.parent / data[key]).resolve())
        return cls.model_validate(data if data is not None else {})

    @property
    def has_auto_topology(self) -> bool:
        return any(m.numa_nodes == "auto" for m in self.machines)

    def with_topology(self, numa_nodes: list[tuple[int, tuple[int, ...]]]) -> "ClusterConfig":
        """A copy where every "auto" machine has these (node id, cpu ids) nodes."""
        nodes = tuple(NumaNodeConfig(id=i, cpus=c) for i, c in numa_nodes)
        machines = tuple(m.model_copy(update={"numa_nodes": nodes}) if m.numa_nodes == "auto" else m
                         for m in self.machines)
        return self.model_copy(update={"machines": machines})

    def placements(self) -> list[WorkerPlacement]:
        """One entry per worker; needs a resolved topology (see with_topology)."""
        if self.has_auto_topology:
            raise ValueError('resolve the "auto" machines first (ClusterConfig.with_topology)')
        return [WorkerPlacement(machine=m.name, node_id=first.id, cpu_ids=first.cpus, replica=r,
                                memory_gib=first.memory_gib, rank_node_ids=tuple(n.id for n in rest),
                                rank_cpu_ids=tuple(n.cpus for n in rest),
                                rank_memory_gib=tuple(n.memory_gib for n in rest))
                for m in self.machines for first, *rest in node_groups(m, self.engine.tensor_parallel_size)
                for r in range(self.workers_per_node)]

    def ray_resources(self, machine: str) -> dict[str, float]:
        """The custom resources `ray start --resources` must declare on this machine."""
        m = next((m for m in self.machines if m.name == machine), None)
        if m is None:
            raise ValueError(f"no machine named {machine!r}; the config has "
                             f"{[x.name for x in self.machines]}")
        if m.numa_nodes == "auto":
            raise ValueError(f'machine {machine!r} has numa_nodes "auto"; resolve it first (with_topology)')
        return {numa_resource(machine, n.id): 1.0 for n in m.numa_nodes}

    def worker_engine_config(self, placement: WorkerPlacement) -> EngineConfig:
        """The engine config of one worker: its thread count is its node's cores (or fewer, if asked)."""
        num_threads = len(placement.cpu_ids)
        if self.engine.num_threads is not None:
            num_threads = min(num_threads, self.engine.num_threads)
        return self.engine.model_copy(update={"num_threads": num_threads})
