"""RMSNorm, rotary position embedding, SiLU-gated MLP activation. In place or into `out`."""

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, parallel=True)
def rms_norm(x, weight, eps, out):
    # x: [T, H] f32, weight: [H] f32, out: [T, H] f32
    T, H = x.shape
    for t in prange(T):
        ss = np.float32(0.0)
        for h in range(H):
            ss += x[t, h] * x[t, h]
        inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(H) + np.float32(eps)))
        for h in range(H):
            out[t, h] = weight[h] * (x[t, h] * inv)


@njit(cache=True, nogil=True, parallel=True)
def rope_inplace(x, positions, inv_freq, attention_scaling):
    # x: [T, n_heads, head_dim] f32, positions: [T], inv_freq: [head_dim // 2] f32.
    # Rotate-half convention (Hugging Face Llama): pairs (i, i + head_dim/2).
    T, n_heads, D = x.shape
    half = D // 2
    for t in prange(T):
        pos = np.float32(positions[t])
        for i in range(half):
            angle = pos * inv_freq[i]  # float32 product, as HF computes it
            c = np.float32(math.cos(angle)) * np.float32(attention_scaling)
            s = np.float32(math.sin(angle)) * np.float32(attention_scaling)
            for h in range(n_heads):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * c - b * s
                x[t, h, i + half] = b * c + a * s


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def silu_mul(gate_up, out):
    # gate_up: [T, 2*I] f32 (gate | up), out: [T, I] f32 = silu(gate) * up
    T, I = out.shape
    for t in prange(T):
        for i in range(I):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * gate_up[t, I + i]
