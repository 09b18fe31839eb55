"""RMSNorm, rotary position embedding, the gated MLP activations (SiLU, tanh-GELU). In place or into `out`.

Each kernel is a per-token body run by a serial and a parallel loop: waking the worker threads costs more than
the whole kernel takes for a decode step's handful of tokens.
"""

import math

import numpy as np
from numba import njit, prange

from kernels.exp32 import exp32, tanh32

PARALLEL_MIN_TOKENS = 16
# the serial and the parallel loop must give a token the same bits (batch invariance, models/linear.py):
# with fastmath's "arcp" / "afn" / "reassoc" LLVM computed SiLU differently in the two (85 of 768 values)
_FASTMATH = {"contract", "nnan", "ninf", "nsz"}


def rms_norm(x, weight, eps, out):
    # x: [T, H] f32, weight: [H] f32, out: [T, H] f32
    (_rms_norm_parallel if x.shape[0] >= PARALLEL_MIN_TOKENS else _rms_norm_serial)(x, weight, eps, out)


def rms_norm_heads(x, weight, eps):
    # x: [T, H, D] f32 (a strided view: q or k inside the fused qkv output), weight: [D] f32; each [D] row
    # normalised in place
    kernel = _rms_norm_heads_parallel if x.shape[0] >= PARALLEL_MIN_TOKENS else _rms_norm_heads_serial
    kernel(x, weight, eps)


def rope_inplace(x, positions, inv_freq, attention_scaling):
    # x: [T, n_heads, head_dim] f32, positions: [T], inv_freq: [R // 2] f32, R the rotary dims (<= head_dim;
    # 0: no rotation). Rotate-half convention (Hugging Face Llama) over the first R dims: pairs (i, i + R/2).
    if inv_freq.shape[0] == 0:
        return
    kernel = _rope_parallel if x.shape[0] >= PARALLEL_MIN_TOKENS else _rope_serial
    kernel(x, positions, inv_freq, attention_scaling)


# the gated activations are compiled too, so that compiled callers (kernels/moe/fused.py) run the same rule
@njit(cache=True, nogil=True)
def silu_mul(gate_up, out):
    # gate_up: [T, 2*I] f32 (gate | up), out: [T, I] f32 = silu(gate) * up
    if out.shape[0] >= PARALLEL_MIN_TOKENS:
        _silu_mul_parallel(gate_up, out)
    else:
        _silu_mul_serial(gate_up, out)


@njit(cache=True, nogil=True)
def gelu_tanh_mul(gate_up, out):
    # gate_up: [T, 2*I] f32 (gate | up), out: [T, I] f32 = gelu_tanh(gate) * up (PyTorch's approximate="tanh")
    if out.shape[0] >= PARALLEL_MIN_TOKENS:
        _gelu_mul_parallel(gate_up, out)
    else:
        _gelu_mul_serial(gate_up, out)


GATED_ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


@njit(inline="always", nogil=True)
def _rms_norm_row(x, weight, eps, out, t):
    H = x.shape[1]
    ss = np.float32(0.0)
    for h in range(H):
        ss += x[t, h] * x[t, h]
    inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(H) + np.float32(eps)))
    for h in range(H):
        out[t, h] = weight[h] * (x[t, h] * inv)


@njit(cache=True, nogil=True, parallel=True)
def _rms_norm_parallel(x, weight, eps, out):
    for t in prange(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@njit(cache=True, nogil=True)
def _rms_norm_serial(x, weight, eps, out):
    for t in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@njit(inline="always", nogil=True)
def _rms_norm_head_row(x, weight, eps, t, h):
    D = x.shape[2]
    ss = np.float32(0.0)
    for d in range(D):
        ss += x[t, h, d] * x[t, h, d]
    inv = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(D) + np.float32(eps)))
    for d in range(D):
        x[t, h, d] = weight[d] * (x[t, h, d] * inv)


@njit(cache=True, nogil=True, parallel=True)
def _rms_norm_heads_parallel(x, weight, eps):
    for t in prange(x.shape[0]):
        for h in range(x.shape[1]):
            _rms_norm_head_row(x, weight, eps, t, h)


@njit(cache=True, nogil=True)
def _rms_norm_heads_serial(x, weight, eps):
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            _rms_norm_head_row(x, weight, eps, t, h)


@njit(inline="always", nogil=True)
def _rope_row(x, positions, inv_freq, attention_scaling, t):
    n_heads = x.shape[1]
    half = inv_freq.shape[0]
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


@njit(cache=True, nogil=True, parallel=True)
def _rope_parallel(x, positions, inv_freq, attention_scaling):
    for t in prange(x.shape[0]):
        _rope_row(x, positions, inv_freq, attention_scaling, t)


@njit(cache=True, nogil=True)
def _rope_serial(x, positions, inv_freq, attention_scaling):
    for t in range(x.shape[0]):
        _rope_row(x, positions, inv_freq, attention_scaling, t)


# error_model "numpy": the division's ZeroDivisionError check (numba's default, Python's rule) kept LLVM from
# vectorizing the row (1 + exp(-g) >= 1 anyway)
@njit(inline="always", nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _silu_mul_row(gate_up, out, t):
    I = out.shape[1]
    for i in range(I):
        g = gate_up[t, i]
        out[t, i] = g / (np.float32(1.0) + exp32(-g)) * gate_up[t, I + i]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _silu_mul_parallel(gate_up, out):
    for t in prange(out.shape[0]):
        _silu_mul_row(gate_up, out, t)


@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _silu_mul_serial(gate_up, out):
    for t in range(out.shape[0]):
        _silu_mul_row(gate_up, out, t)


_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@njit(inline="always", nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _gelu_mul_row(gate_up, out, t):
    I = out.shape[1]
    for i in range(I):
        g = gate_up[t, i]
        inner = _GELU_C * (g + np.float32(0.044715) * g * g * g)
        out[t, i] = np.float32(0.5) * g * (np.float32(1.0) + tanh32(inner)) * gate_up[t, I + i]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _gelu_mul_parallel(gate_up, out):
    for t in prange(out.shape[0]):
        _gelu_mul_row(gate_up, out, t)


@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _gelu_mul_serial(gate_up, out):
    for t in range(out.shape[0]):
        _gelu_mul_row(gate_up, out, t)
