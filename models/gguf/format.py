"""GGUF format facts shared by the reader and the writer: type maps, metadata keys, rope layout.

Quantized tensors map byte for byte: a GGUF Q8_0 block is (fp16 d, 32 x int8), a Q4_0 block (fp16 d, 16 bytes,
element j in the low nibble and j + 16 in the high nibble of byte j); a WeightMatrix holds the same values
split into `scales` and `data`. llama.cpp's "normal" rope (Llama, Granite, SmolLM3) rotates adjacent pairs
where Hugging Face's rotates i with i + head_dim / 2, so convert_hf_to_gguf.py interleaves the two halves of
every head of attn_q / attn_k for those families (models/gguf/families.py): we undo that on load and redo it
on export.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from cluster_configs.errors import CheckpointError
from models.model_spec import ModelSpec
from models.rope import Rope, inv_freq

GT = GGMLQuantizationType
# the global rope's Hugging Face rope_scaling as JSON, written by earlier exports (now part of SPEC_KEY)
ROPE_SCALING_KEY = "numaserve.rope_scaling"
# the ModelSpec fields llama.cpp's keys do not give back exactly, as JSON (models/gguf/model_spec.py)
SPEC_KEY = "numaserve.spec"
# rope tensors: llama3 frequency divisors; LongRoPE's long and short factors
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# GGML types numaserve serves as they are stored, by the WeightMatrix dtype that holds them:
# Q8_0 and Q4_0 split into values and scales, the K-quants and the legacy types llama.cpp's quantizer falls
# back to as their raw blocks (memory/matrices.py)
RAW_BLOCKS = {GT.Q4_K: "q4_k", GT.Q5_K: "q5_k", GT.Q6_K: "q6_k", GT.Q4_1: "q4_1", GT.Q5_0: "q5_0",
              GT.Q5_1: "q5_1", GT.IQ4_NL: "iq4_nl", GT.IQ4_XS: "iq4_xs"}
AUTO = {GT.F32: "float32", GT.F16: "float16", GT.BF16: "bfloat16", GT.Q8_0: "q8_0",
        GT.Q4_0: "q4_0"} | RAW_BLOCKS
GGML_TYPE = {dtype: kind for kind, dtype in AUTO.items()}
FILE_TYPE = {"float32": LlamaFileType.ALL_F32, "float16": LlamaFileType.MOSTLY_F16,
             "bfloat16": LlamaFileType.MOSTLY_BF16,
             "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0,
             "q4_1": LlamaFileType.MOSTLY_Q4_1, "q5_0": LlamaFileType.MOSTLY_Q5_0,
             "q5_1": LlamaFileType.MOSTLY_Q5_1, "q4_k": LlamaFileType.MOSTLY_Q4_K_S,
             "q5_k": LlamaFileType.MOSTLY_Q5_K_S, "q6_k": LlamaFileType.MOSTLY_Q6_K,
             "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "iq4_nl": LlamaFileType.MOSTLY_IQ4_NL,
             "iq4_xs": LlamaFileType.MOSTLY_IQ4_XS}
REQUIRED = object()


def metadata_key(path: Path, metadata: dict, key: str, default=REQUIRED):
    if key in metadata:
        return metadata[key]
    if default is REQUIRED:
        raise CheckpointError(f"{path}: metadata key {key!r} is missing; re-convert the model with a recent "
                              "convert_hf_to_gguf.py or numaserve's export_gguf")
    return default


def f32(value: float) -> float:
    """A float32 metadata value as the short decimal configs use: float32(1e-5) -> 1e-5."""
    return float(str(np.float32(value)))


# ---- rope ------------------------------------------------------------------------------------------------

def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """Hugging Face's llama3 rope scaling from llama.cpp's per-frequency divisors (rope_freqs.weight).

    With u = L * v (L the original context, v = 1 / wavelength) the divisor is `factor` where u < low, 1 where
    u > high, and 1 / ((1 - s) / factor + s) on the ramp between, s = (u - low) / (high - low). Only ratios
    are determined: low_freq_factor is taken as 1."""
    r = factors.astype(np.float64)
    factor = float(r.max())
    if factor <= 1.0:
        return None
    # ascending frequency order
    v = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
    low, high = np.isclose(r, factor), np.isclose(r, 1.0)
    ramp = ~low & ~high
    if not high.any() and not ramp.any():
        return {"rope_type": "linear", "factor": f32(factor)}
    s = (1 / r[ramp] - 1 / factor) / (1 - 1 / factor)
    if ramp.sum() >= 2:
        slope, intercept = np.polyfit(v[ramp], s, 1)  # s = (L v - 1) / (high - 1)
        original, high_factor = round(-slope / intercept), float(f"{1 - 1 / intercept:.6g}")
    else:
        original, high_factor = _llama3_bounds(v[low].max(), v[high].min() if high.any() else None,
                                               v[ramp], s)
    return {"rope_type": "llama3", "factor": f32(factor), "low_freq_factor": 1.0,
            "high_freq_factor": high_factor, "original_max_position_embeddings": original}


def _llama3_bounds(v_low: float, v_high: float | None, v_ramp: np.ndarray,
                   s: np.ndarray) -> tuple[float, float]:
    """(L, high) with at most one frequency on the ramp: every frequency on its side, the ramp one exact."""
    original = 1 / v_low  # the highest scaled frequency sits on the low boundary...
    if not len(v_ramp):
        return float(original), float(original * v_high)
    vm, sm = v_ramp[0], s[0]
    if v_high is not None and vm - sm * v_high > 0:  # ...unless that would put the high boundary above v_high
        original = min(original, (1 - sm) / (vm - sm * v_high))
    return float(original), float(1 + (original * vm - 1) / sm)


def rope_freq_factors(spec: ModelSpec) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for a llama3-scaled spec: [rotary_dim // 2] f32 divisors."""
    base, _ = inv_freq(replace(spec.rope, scaling=None))
    scaled, _ = inv_freq(spec.rope)
    return (base.astype(np.float64) / scaled).astype(np.float32)


def rope_tensors(spec: ModelSpec) -> dict[str, np.ndarray]:
    """llama.cpp's rope tensors for the global rope's scaling: llama3's divisors, LongRoPE's factors."""
    rope = spec.rope
    if rope.kind == "llama3":
        return {"rope_freqs.weight": rope_freq_factors(spec)}
    if rope.kind == "longrope":
        return {f"rope_factors_{k}.weight": np.asarray(rope.scaling[f"{k}_factor"], np.float32)
                for k in ("long", "short")}
    return {}


def rope_scaling(path: Path, metadata: dict, key, vector, theta: float, rotary_dim: int,
                 context: int) -> dict | None:
    """The global rope's Hugging Face scaling from llama.cpp's keys (key(name, default) reads {arch}.name) and
    rope tensors (vector(name) -> f32 values or None): linear, llama3 (rope_freqs) or LongRoPE
    (rope_factors_long / _short, Phi-3)."""
    if ROPE_SCALING_KEY in metadata:  # earlier exports
        return json.loads(metadata[ROPE_SCALING_KEY])
    freqs = vector("rope_freqs.weight")
    long, short = vector("rope_factors_long.weight"), vector("rope_factors_short.weight")
    kind = key("rope.scaling.type", "linear")  # llama.cpp's default
    factor = f32(key("rope.scaling.factor", 0.0))
    if kind not in ("none", "linear", "longrope"):
        raise CheckpointError(f"{path}: rope.scaling.type={kind!r} is not supported; numaserve applies "
                              "linear, llama3 (rope_freqs.weight) and LongRoPE (rope_factors_*) scaling")
    linear = kind == "linear" and factor not in (0.0, 1.0)
    if sum((freqs is not None, long is not None or short is not None, linear)) > 1:
        raise CheckpointError(f"{path}: more than one of rope_freqs.weight, rope_factors_* and linear rope "
                              "scaling; expected one of them")
    half = (rotary_dim // 2,)
    for name, t in (("rope_freqs", freqs), ("rope_factors_long", long), ("rope_factors_short", short)):
        if t is not None and t.shape != half:
            raise CheckpointError(f"{path}: tensor '{name}.weight' has shape {t.shape}, expected {half}: one "
                                  "value per rotary frequency")
    if linear:
        return {"rope_type": "linear", "factor": factor}
    if freqs is not None:
        return llama3_scaling_from_factors(freqs, theta, rotary_dim)
    if long is None and short is None:
        return None
    if long is None or short is None:
        raise CheckpointError(f"{path}: LongRoPE needs both rope_factors_long.weight and "
                              "rope_factors_short.weight")
    original = int(key("rope.scaling.original_context_length"))
    scaling = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist(),
               "original_max_position_embeddings": original, "factor": context / original}
    attn_factor = key("rope.scaling.attn_factor", None)
    if attn_factor is not None and np.float32(attn_factor) != np.float32(_attention_factor(scaling)):
        scaling["attention_factor"] = f32(attn_factor)
    return scaling


def _attention_factor(scaling: dict) -> float:
    return inv_freq(Rope(10000.0, scaling, 2 * len(scaling["long_factor"])))[1]


def rope_row_order(num_heads: int, head_dim: int) -> np.ndarray:
    """GGUF row i of attn_q / attn_k is Hugging Face row order[i] (convert_hf_to_gguf's permute)."""
    return np.arange(num_heads * head_dim).reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
