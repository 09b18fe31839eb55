"""SimConfig: one simulated deployment and its load, validated at construction."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster_configs.cluster_config import ClusterConfig
from cluster_configs.engine_config import EngineConfig
from numaserve.simulate.step_cost import DeploymentCost, StepCostModel, default_step_cost
from numaserve.simulate.tensor_parallel import AllReduceCost, TensorParallelStepCost, fit_all_reduce
from numaserve.simulate.traces import TRACES

_CLUSTER = ClusterConfig()  # the deployment's defaults: queue bound, telemetry period, target step, chunking


class SimConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = Field(1, ge=1)  # each a group of tensor_parallel ranks (nodes)
    tensor_parallel: int = Field(1, ge=1)  # ranks a worker, each on its own NUMA node
    machines: int = Field(1, ge=1)  # one caller (HTTP actor) per machine; workers spread evenly over them
    rate: float = Field(2.0, ge=0.0)  # requests/s offered (sessions: turns/s, about)
    duration_s: float = Field(10.0, gt=0.0)  # arrivals in [0, duration_s)
    warmup_s: float = Field(2.0, ge=0.0)  # throughput counts the tokens delivered in [warmup_s, duration_s)
    trace: Literal["poisson", "bursty", "sessions", "adapters"] = "poisson"
    seed: int = 0
    # relay: every chunk crosses the router (today); placement: the router is called twice per request (#27)
    routing: Literal["relay", "placement"] = "placement"
    admission: bool = True  # the router's admission bound, from the scheduler's policy
    stickiness: bool = True  # a session's turns go back to its worker
    prefix_affinity: bool = True  # a prompt goes to the worker that last took its prefix
    speculation: Literal["off", "auto"] = "off"  # "auto": the modelled n-gram proposer, mode auto
    accept_rate: float = Field(0.6, ge=0.0, le=1.0)  # the modelled proposer's per-position acceptance
    prompt_len: int = Field(128, ge=1)  # poisson, bursty, adapters
    max_tokens: int = Field(64, ge=1)
    adapter_load_s: float = Field(0.05, ge=0.0)  # a cold adapter's fetch (rank 16, TinyLlama: 50 MB)
    engine: EngineConfig = EngineConfig(max_model_len=2048)
    max_queued_per_worker: int = Field(_CLUSTER.max_queued_per_worker, ge=0)
    telemetry_interval_s: float = Field(_CLUSTER.telemetry_interval_s, gt=0.0)
    target_step_s: float = Field(_CLUSTER.target_step_ms / 1000, gt=0.0)
    stream_interval_s: float = Field(_CLUSTER.stream_interval_ms / 1000, ge=0.0)
    step_cost: StepCostModel = Field(default_factory=default_step_cost)  # one node's whole model
    all_reduce: AllReduceCost = Field(default_factory=fit_all_reduce)  # between a group's ranks
    deployment_cost: DeploymentCost = DeploymentCost()

    @model_validator(mode="after")
    def _consistent(self) -> "SimConfig":
        if self.warmup_s >= self.duration_s:
            raise ValueError(f"warmup_s ({self.warmup_s}) must be < duration_s ({self.duration_s})")
        if self.machines > self.workers:
            raise ValueError(f"machines ({self.machines}) must be <= workers ({self.workers})")
        if self.engine.max_model_len is None:
            raise ValueError("engine.max_model_len must be set (the modelled model has no config of its own)")
        if self.trace not in TRACES:
            raise ValueError(f"trace must be one of {TRACES}")
        return self

    def worker_cost(self) -> StepCostModel | TensorParallelStepCost:
        """A worker's step cost: one node's, or its group's (numaserve/simulate/tensor_parallel.py)."""
        if self.tensor_parallel == 1:
            return self.step_cost
        return TensorParallelStepCost(self.step_cost, self.tensor_parallel, self.all_reduce)

    def engine_config(self) -> EngineConfig:
        """The workers' EngineConfig: speculation as asked."""
        if self.speculation == "off":
            return self.engine
        return EngineConfig.model_validate(self.engine.model_dump() | {
            "speculation": {"method": "ngram", "mode": self.speculation}})
