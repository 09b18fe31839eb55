"""numaserve: CPU-native LLM serving. The public face: LLM, SamplingParams, EngineConfig, errors."""

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import AdapterError, CheckpointError, InvalidRequest, NumaserveError, Overloaded
from cluster_configs.sampling_params import SamplingParams
from numaserve.llm import LLM
from scheduling.outputs import Completion

__all__ = [
    "LLM",
    "AdapterError",
    "CheckpointError",
    "Completion",
    "EngineConfig",
    "InvalidRequest",
    "NumaserveError",
    "Overloaded",
    "SamplingParams",
]
