"""Whether a worker's ranks fit their NUMA nodes: each rank's weights (its shard, in the served format) and KV
pool, estimated from the model's spec before anything loads, so a deployment that cannot fit is refused at
once with the tensor_parallel_size that would fit, not by an out-of-memory kill minutes later.

The weights are each tensor of the rank's shard at the weight dtype's bytes per value (GGML's block sizes;
a llama.cpp mix at its base type, norms and biases float32): within a few percent of what loads (a mix's
upgraded matrices and the int8 kernels' padding add a little). The KV pool is what the engine allocates
(scheduling/kv_cache_manager.num_kv_blocks on the rank's heads); the process itself (Python, numba, Ray) is
not counted."""

from dataclasses import dataclass

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import CheckpointError
from memory.kv_cache import kv_bytes_per_token
from models.checkpoint import expected_shapes
from models.model_spec import ModelSpec
from models.tensor_parallel.shard import TensorShard
from scheduling.kv_cache_manager import num_kv_blocks

# bytes per weight value of each served format (GGML's (block bytes, block values) for the quantized ones)
BYTES_PER_VALUE = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32,
                   "q4_k": 144 / 256, "q5_k": 176 / 256, "q6_k": 210 / 256, "q4_k_m": 144 / 256,
                   "q5_k_m": 176 / 256, "iq4_nl": 18 / 32, "iq4_xs": 136 / 256}


@dataclass(frozen=True)
class RankMemory:
    """One rank's estimated resident bytes."""

    weight_bytes: int
    kv_cache_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes


def rank_memory(spec: ModelSpec, config: EngineConfig) -> RankMemory:
    """Rank 0's estimate at config.tensor_parallel_size (every rank holds about as much); CheckpointError
    where the model's heads or sizes do not split into that many ranks."""
    shard = TensorShard(0, config.tensor_parallel_size, config.enable_expert_parallel)
    local = shard.local_spec(spec)
    per_value = BYTES_PER_VALUE["bfloat16" if config.weight_dtype == "auto" else config.weight_dtype]
    weights = 0.0
    for name, shape in expected_shapes(local).items():
        n = 1
        for d in shape:
            n *= d
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vocabulary rows: the rank's share
            n = n * (shard.span(spec.vocab_size)[1] - shard.span(spec.vocab_size)[0]) // spec.vocab_size
        weights += n * (per_value if len(shape) == 2 and not name.endswith(".gate.weight") else 4.0)
    max_model_len = config.max_model_len or spec.max_position_embeddings
    block_bytes = config.block_size * kv_bytes_per_token(local.num_layers, local.num_kv_heads, local.head_dim,
                                                         config.resolved_kv_dtype, config.kv_dtype_overrides)
    return RankMemory(int(weights), num_kv_blocks(local, config, max_model_len) * block_bytes)


def fitting_size(spec: ModelSpec, config: EngineConfig, node_bytes: int,
                 sizes: list[int]) -> tuple[int, RankMemory] | None:
    """The smallest tensor_parallel_size of `sizes` whose ranks each fit node_bytes, with a rank's estimate;
    None if none does."""
    for size in sorted(sizes):
        try:
            need = rank_memory(spec, config.model_copy(update={"tensor_parallel_size": size}))
        except CheckpointError:
            continue  # the heads do not split so
        if need.total <= node_bytes:
            return size, need
    return None
