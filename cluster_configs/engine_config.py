"""EngineConfig: the one frozen config of an engine. Its field names are public API."""

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster_configs.speculation_config import SpeculationConfig

WeightDtype = Literal["auto", "float32", "float16", "bfloat16", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k",
                      "q4_k_m", "q5_k_m", "iq4_nl", "iq4_xs"]
KVStorage = Literal["float32", "bfloat16", "int8", "int8_hadamard", "fp8_e4m3", "fp8_e5m2", "int4",
                    "int4_hadamard"]  # memory/kv_formats.py
KVDtype = Literal["auto", KVStorage]
ActivationDtype = Literal["auto", "float32", "bfloat16", "int8"]


def default_packed_cache_dir() -> str:
    """$NUMASERVE_CACHE_DIR ("off": no cache; the test suite sets it), else ~/.cache/numaserve/packed ("~"
    is expanded where the engine runs)."""
    return os.environ.get("NUMASERVE_CACHE_DIR", "~/.cache/numaserve/packed")


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    weight_dtype: WeightDtype = Field("auto", description='weight storage; "auto" = bfloat16 (a GGUF file '
                                                          'keeps the types it stores); "q4_k_m" / "q5_k_m" = '
                                                          "llama.cpp's mixes (models/quantization/"
                                                          "quant_mix.py)")
    imatrix: str | None = Field(None, description="an importance matrix file (llama.cpp's format: `numaserve "
                                                  "calibrate MODEL --imatrix OUT` or llama-imatrix) that "
                                                  "weight_dtype's 4- to 6-bit formats are quantized with, as "
                                                  "llama-quantize --imatrix; None = without")
    kv_dtype: KVDtype = Field("auto", description='KV cache storage; "auto" = int8 (every attention kernel '
                                                  "reads it; perplexity within 0.01 percent of bfloat16 "
                                                  "KV's at 1k tokens, benchmarks/results/kv_quality.json, "
                                                  'and half its bytes); "float32" / "bfloat16"; "fp8_e4m3" / '
                                                  '"fp8_e5m2" / "int8" / "int4": one float32 scale per '
                                                  '(token, kv head); "*_hadamard": heads rotated by a '
                                                  "Hadamard transform before rounding (head_dim a power "
                                                  "of two)")
    kv_dtype_overrides: dict[int, KVStorage] = Field(
        default_factory=dict, description="{layer index: KV dtype} for the layers stored otherwise than "
                                          "kv_dtype (e.g. {0: 'bfloat16'} keeps the first layer wide); "
                                          "indices are checked against the model's layers when it loads")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block (a power of two)")
    kv_cache_bytes: int = Field(1 << 30, gt=0, description="KV cache size, an upper bound: never more than "
                                                          "max_num_seqs full contexts")
    max_num_batched_tokens: int = Field(512, ge=1, description="token budget of one step")
    max_prefill_stretch: float | None = Field(
        None, ge=1.0, description="while requests decode, a step's prompt tokens are as many as keep it "
                                  "within this times a decode-only step, from measured costs (scheduling/"
                                  "prefill_pacing.py): a long prompt arriving slows running streams by at "
                                  "most this much, and prompts take longer; None = the token budget alone")
    max_num_seqs: int = Field(64, ge=1, description="requests in one step's batch at most")
    max_model_len: int | None = Field(None, ge=1, description="prompt + output tokens at most; None = the "
                                                              "model's max_position_embeddings")
    jump_forward: bool = Field(True, description="structured outputs: append the tokens a grammar forces "
                               "(each the only one it allows) without sampling them")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of earlier requests' equal "
                                                          "prompt prefixes")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description='the order of admission, scheduling and preemption: "fcfs" by arrival, '
                            '"priority" by (SamplingParams.priority, arrival), lower first')
    session_kv_bytes: int = Field(256 << 20, ge=0, description="KV that idle session sequences keep pinned "
                                                              "between turns at most (least recently used "
                                                              "evicted to the prefix cache past it)")
    num_threads: int | None = Field(None, ge=1, description="kernel threads; None = every core this process "
                                                            "may run on")
    tensor_parallel_size: int = Field(1, ge=1, description="ranks one model is sharded over (vLLM's name): "
                                                           "rank 0 in this process, each other a process "
                                                           "of its own, the allowed cores split evenly")
    enable_expert_parallel: bool = Field(False, description="with tensor_parallel_size > 1, a MoE layer's "
                                                            "experts whole on ranks (E / N each; vLLM's "
                                                            "name) rather than each expert's matrices "
                                                            "split; no effect on a dense model")
    # "float32" is exact (within 1e-4 of transformers); "bfloat16" (vdpbf16ps) and "int8" (VNNI, 32-value
    # blocks) trade a stated perplexity bound for speed; see models/quantization/activation_plan.py
    activation_dtype: ActivationDtype = Field(
        "auto", description="what activations are rounded to before the "
                            'linear layers\' dot products; "auto" picks per '
                            "weight dtype")
    activation_scales: Literal["dynamic", "static"] = Field(
        "dynamic", description='int8 activations\' scales: "dynamic" per 32-value block, or "static" per '
                               "matrix from the model's calibration file (numaserve calibrate; its method); "
                               "dynamic measured more accurate and as fast (README, Calibration)")
    max_loras: int = Field(4, ge=1, description="adapters held ready for the kernels (least recently used "
                                                "out) and so the most distinct adapters in one step's batch")
    max_lora_rank: int = Field(64, ge=1, description="the largest LoRA rank an adapter may have (any "
                                                     "module); a higher one is refused at registration")
    lora_merge: Literal["auto", "never", "always"] = Field(
        "never", description='run an adapter\'s rows on a merged copy of the weights: "auto" when the '
                             'measured cost model says it pays (scheduling/lora/merge_policy.py), "always" '
                             '(every adapter whose copy fits), "never"; merged rows round differently, so '
                             'under "auto" a request\'s tokens may depend on what it is batched with')
    lora_merged_bytes: int = Field(2 << 30, ge=0, description="merged weight copies an engine keeps (least "
                                                              "recently used out); 0 = never merge")
    adapter_roots: tuple[str, ...] | None = Field(
        None, description="folders adapters may be registered from ('..' and symlinks resolved); "
                          "None = anywhere")
    packed_cache_dir: str | None = Field(
        default_factory=default_packed_cache_dir, validate_default=True,
        description="where weights packed for this host are kept, so that a second start of the same model "
                    "skips loading and repacking them (models/packed/planned_load.py); None or 'off' = "
                    "repack at "
                    "every start; $NUMASERVE_CACHE_DIR sets the default")
    packed_cache_bytes: int = Field(
        32 << 30, ge=0, description="the packed cache's size at most, in bytes: the least recently used "
                                    "entries go after a write")
    map_packed_weights: bool | Literal["auto"] = Field(
        "auto", description="a packed-cache hit maps its entry (zero-copy: a faster start, the weights "
                            "the page cache's) rather than reading it into memory of its own; 'auto' maps "
                            "where the mapping comes mostly on huge pages (a kernel whose page cache keeps "
                            "large folios: ext4 or XFS on recent Linux) and reads elsewhere (on 4 KB pages "
                            "batch-1 decode measured 0.93x a buffer's huge pages); on a machine of several "
                            "NUMA nodes 'auto' reads and True maps, each mapping bound to its worker's node "
                            "(one worker per entry: a tensor-parallel group's ranks; models/packed/file.py, "
                            "planned_load.py)")
    prefix_cache_dir: str | None = Field(
        None, description="a disk tier for the prefix cache: full KV blocks are also written here (in the "
                          "background) and read back, not recomputed, for a prompt whose prefix left the "
                          "pool or was computed by an earlier start or another worker of this machine "
                          "(scheduling/disk_tier.py); None = off")
    prefix_cache_disk_bytes: int = Field(
        16 << 30, ge=0, description="the disk tier's size at most, in bytes, over every model sharing "
                                    "prefix_cache_dir: the least recently used blocks go first")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig,
                                           description="speculative decoding (a SpeculationConfig or a dict "
                                                       "of its fields); off by default")

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two (got {v}); use e.g. 16")
        return v

    @field_validator("kv_dtype_overrides")
    @classmethod
    def _layer_indices(cls, v: dict[int, str]) -> dict[int, str]:
        if any(i < 0 for i in v):
            raise ValueError(f"kv_dtype_overrides: layer indices count from 0 (got {sorted(v)})")
        return v

    @field_validator("packed_cache_dir")
    @classmethod
    def _off(cls, v: str | None) -> str | None:
        return None if v == "off" else v

    @model_validator(mode="after")
    def _disk_tier(self) -> "EngineConfig":
        if self.prefix_cache_dir is None:
            return self
        if not self.enable_prefix_caching:
            raise ValueError("prefix_cache_dir is a tier of the prefix cache, but enable_prefix_caching="
                             "False; enable prefix caching or leave prefix_cache_dir unset")
        if self.tensor_parallel_size > 1:
            raise ValueError("prefix_cache_dir is not supported with tensor_parallel_size > 1 yet (each rank "
                             "holds its own part of every KV block); leave one of them unset")
        return self

    @property
    def resolved_kv_dtype(self) -> str:
        return "int8" if self.kv_dtype == "auto" else self.kv_dtype
