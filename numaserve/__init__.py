"""numaserve: CPU-native LLM serving. The public face: LLM, SamplingParams, StructuredOutputs, EngineConfig,
SpeculationConfig, errors, convert_to_gguf / export_gguf; serve, connect, Client, ClusterConfig for the Ray
deployment."""

from cluster_configs.cluster_config import ClusterConfig
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import (
    AdapterError,
    CheckpointError,
    EngineClosed,
    InvalidRequest,
    NumaserveError,
    Overloaded,
    RankLost,
    Unavailable,
)
from cluster_configs.sampling_params import SamplingParams
from cluster_configs.speculation_config import SpeculationConfig
from cluster_configs.structured_outputs import StructuredOutputs
from models.gguf.writer import convert_to_gguf, export_gguf
from numaserve.llm import LLM
from scheduling.outputs import Completion

__all__ = [
    "LLM",
    "AdapterError",
    "CheckpointError",
    "Client",
    "ClusterConfig",
    "Completion",
    "EngineClosed",
    "EngineConfig",
    "InvalidRequest",
    "NumaserveError",
    "Overloaded",
    "RankLost",
    "SamplingParams",
    "SpeculationConfig",
    "StructuredOutputs",
    "Unavailable",
    "connect",
    "convert_to_gguf",
    "export_gguf",
    "serve",
]


def __getattr__(name: str):
    # the Ray side loads on first use, so `import numaserve` stays light for in-process LLM users
    if name in ("serve", "connect"):
        from actors import deploy

        return getattr(deploy, name)
    if name == "Client":
        from actors.client import Client

        return Client
    raise AttributeError(f"module 'numaserve' has no attribute {name!r}")
