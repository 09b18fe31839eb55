"""Rotary position embeddings as Hugging Face computes them: the plain, linear, Llama-3 and LongRoPE (Phi-3's
"su") frequencies, partial rotary dims, and layers without rotation (SmolLM3)."""

import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding."""

    theta: float
    scaling: dict | None  # HF's rope parameters beyond theta (rope_type and its fields); None: plain
    rotary_dim: int  # leading dims of each head that rotate (Phi-4-mini: 3/4 of them); 0: no rotation

    @property
    def kind(self) -> str:
        s = self.scaling or {}
        return s.get("rope_type", s.get("type", "default"))


@dataclass(frozen=True, eq=False)
class RopeTable:
    """What the rope kernel reads (kernels/norms.py rope_inplace)."""

    inv_freq: np.ndarray  # [rotary_dim // 2] f32
    attention_scaling: float  # cos and sin scaled by it (LongRoPE's attention factor)


def inv_freq(rope: Rope, long: bool = False) -> tuple[np.ndarray, float]:
    """-> (inv_freq [rotary_dim // 2] float32, attention_scaling); long: LongRoPE's long factors."""
    d = rope.rotary_dim
    # HF: 1 / base ** (arange(0, d, 2, int64).float() / d), evaluated in float32
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    powers = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    s = rope.scaling or {}
    kind = rope.kind
    if kind == "longrope":
        factors = np.asarray(s["long_factor" if long else "short_factor"], np.float32)
        return (1.0 / (factors * powers)).astype(np.float32), _longrope_attention_factor(s)
    base = (1.0 / powers).astype(np.float32)
    if kind == "linear":
        return (base / np.float32(s["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(base, s), 1.0
    return base, 1.0


def rope_table(rope: Rope, max_model_len: int) -> RopeTable:
    """The frequencies an engine serving sequences of up to max_model_len tokens rotates by. LongRoPE's long
    factors when that passes the original context, else its short ones: one set for every token (a key's
    rotation must not change with the sequence's length). That is vLLM's and llama.cpp's choice (the
    latter by its context size); Hugging Face switches a whole sequence to the long factors once it passes
    the original context (its generate recomputes the cache at that point), so the two agree for every
    sequence on the chosen side of that length."""
    long = rope.kind == "longrope" and max_model_len > rope.scaling["original_max_position_embeddings"]
    return RopeTable(*inv_freq(rope, long))


def _longrope_attention_factor(s: dict) -> float:
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor, original = s["factor"], s["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)
