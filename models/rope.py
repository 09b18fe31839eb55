"""Rotary inverse frequencies with the Llama-3 and linear scalings, as Hugging Face computes them."""

import math

import numpy as np

from models.spec import ModelSpec


def rope_inv_freq(spec: ModelSpec) -> tuple[np.ndarray, float]:
    """-> (inv_freq [head_dim // 2] float32, attention_scaling)."""
    d = spec.head_dim
    # HF: 1 / base ** (arange(0, d, 2, int64).float() / d), evaluated in float32
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (1.0 / np.power(np.float32(spec.rope_theta), exponents, dtype=np.float32)).astype(np.float32)
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0


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
