from cluster_configs.cluster_config import ClusterConfig
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import AdapterError, CheckpointError, InvalidRequest, NumaserveError, Overloaded
from cluster_configs.sampling_params import SamplingParams

__all__ = [
    "AdapterError",
    "CheckpointError",
    "ClusterConfig",
    "EngineConfig",
    "InvalidRequest",
    "NumaserveError",
    "Overloaded",
    "SamplingParams",
]
