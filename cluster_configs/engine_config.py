"""EngineConfig: the one frozen config of an engine. Its field names are public API."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster_configs.speculation_config import SpeculationConfig

WeightDtype = Literal["auto", "float32", "bfloat16", "q8_0", "q4_0"]
KVDtype = Literal["auto", "float32", "bfloat16", "int8"]
ActivationDtype = Literal["auto", "float32", "bfloat16", "int8"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    weight_dtype: WeightDtype = "auto"  # "auto" = bfloat16 (a GGUF file keeps the types it stores)
    kv_dtype: KVDtype = "auto"  # "auto" = bfloat16
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_bytes: int = Field(1 << 30, gt=0)  # upper bound; never more than max_num_seqs full contexts
    max_num_batched_tokens: int = Field(512, ge=1)  # token budget of one step
    max_num_seqs: int = Field(64, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_threads: int | None = Field(None, ge=1)  # None = every core this process may run on
    # what activations are rounded to before the linear layers' dot products: "float32" is exact (within
    # 1e-4 of transformers); "bfloat16" (vdpbf16ps) and "int8" (VNNI, 32-value blocks) trade a stated
    # perplexity bound for speed; "auto" picks per weight dtype (see models/activation_plan.py)
    activation_dtype: ActivationDtype = "auto"
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)  # also accepted as a dict

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (got {v}); use e.g. 16")
        return v

    @property
    def resolved_kv_dtype(self) -> str:
        return "bfloat16" if self.kv_dtype == "auto" else self.kv_dtype
