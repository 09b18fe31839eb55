"""GGML q8_0 and q4_0: 32-value blocks with one fp16 scale each, quantized with GGML's rounding rules.

Layouts (ours; the values equal GGML's): q8_0 qs int8 [N, K]; q4_0 qs uint8 [N, K // 2] where byte j
of a block holds element j in its low nibble and element j + 16 in its high nibble (GGML's order).
Scales: uint16 fp16 bits [N, K // 32].
"""

import math

import numpy as np
from numba import njit, prange

from kernels.formats.fp16 import f32_to_f16

QK = 32  # values per block


@njit(inline="always", nogil=True)
def _roundf(v):
    # C roundf: half away from zero, computed exactly as ggml's reference does
    a = abs(v)
    floored = np.float32(math.floor(a))
    r = floored + np.float32(math.floor(np.float32(2.0) * (a - floored)))
    return -r if v < 0 else r


@njit(cache=True, nogil=True, parallel=True)
def quantize_q8_0(w, qs, scales):
    # w: [N, K] f32 -> qs: [N, K] int8, scales: [N, K // 32] uint16 (fp16)
    for n in prange(w.shape[0]):
        for b in range(w.shape[1] // QK):
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(w[n, b * QK + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(QK):
                qs[n, b * QK + j] = np.int8(_roundf(w[n, b * QK + j] * inv))
            scales[n, b] = f32_to_f16(d)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q4_0(w, qs, scales):
    # w: [N, K] f32 -> qs: [N, K // 2] uint8, scales: [N, K // 32] uint16 (fp16)
    for n in prange(w.shape[0]):
        for b in range(w.shape[1] // QK):
            base = b * QK
            vmax = np.float32(0.0)
            amax = np.float32(0.0)
            for j in range(QK):  # the first value of largest magnitude, with its sign
                v = w[n, base + j]
                if abs(v) > amax:
                    amax = abs(v)
                    vmax = v
            d = vmax / np.float32(-8.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            for j in range(QK // 2):
                lo = min(15, int(np.float32(w[n, base + j] * inv + np.float32(8.5))))
                hi = min(15, int(np.float32(w[n, base + j + 16] * inv + np.float32(8.5))))
                qs[n, b * 16 + j] = np.uint8(lo | (hi << 4))
            scales[n, b] = f32_to_f16(d)
