"""Linear layers y = x @ W.T over a flat token batch; each weight row is read once per step.

W is [out_features, in_features] (the checkpoint's layout). The outer loop runs over output rows so
one row is streamed from memory once and reused from L1 for every token of the batch.
"""

import numpy as np
from numba import njit, prange

from kernels.bf16 import bf16_to_f32
from kernels.fp16 import f16_to_f32


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def matmul_f32(x, w, out):
    # x: [T, K] f32, w: [N, K] f32, out: [T, N] f32
    T, K = x.shape
    for n in prange(w.shape[0]):
        for t in range(T):
            acc = np.float32(0.0)
            for k in range(K):
                acc += x[t, k] * w[n, k]
            out[t, n] = acc


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def matmul_bf16(x, w, out):
    # x: [T, K] f32, w: [N, K] uint16 (bf16 bits), out: [T, N] f32
    T, K = x.shape
    for n in prange(w.shape[0]):
        for t in range(T):
            acc = np.float32(0.0)
            for k in range(K):
                acc += x[t, k] * bf16_to_f32(w[n, k])
            out[t, n] = acc


@njit(cache=True, nogil=True, parallel=True)
def gather_rows_bf16(w, ids, out):
    # w: [V, H] uint16, ids: [T] -> out: [T, H] f32 (embedding lookup)
    for t in prange(ids.shape[0]):
        for h in range(w.shape[1]):
            out[t, h] = bf16_to_f32(w[ids[t], h])


_ROWS = 16  # output rows per parallel task: one accumulator allocation per task


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def matmul_q8_0(x, qs, scales, out):
    # x: [T, K] f32, qs: [N, K] int8, scales: [N, K // 32] uint16 fp16 -> out: [T, N] f32
    # A 32-wide accumulator carried across blocks keeps the loop vectorized (a per-block scalar
    # reduction runs ~9x slower); the block scale is applied per element.
    T, K = x.shape
    N = qs.shape[0]
    for g in prange((N + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for n in range(g * _ROWS, min(N, (g + 1) * _ROWS)):
            for t in range(T):
                acc[:] = 0.0
                for b in range(K // 32):
                    d = f16_to_f32(scales[n, b])
                    for j in range(32):
                        acc[j] += x[t, b * 32 + j] * (d * np.float32(qs[n, b * 32 + j]))
                out[t, n] = acc.sum()


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def matmul_q4_0(x, qs, scales, out):
    # x: [T, K] f32, qs: [N, K // 2] uint8 (GGML nibble order), scales: [N, K // 32] uint16 fp16
    T, K = x.shape
    N = qs.shape[0]
    for g in prange((N + _ROWS - 1) // _ROWS):
        acc = np.empty(32, np.float32)
        for n in range(g * _ROWS, min(N, (g + 1) * _ROWS)):
            for t in range(T):
                acc[:] = 0.0
                for b in range(K // 32):
                    d = f16_to_f32(scales[n, b])
                    for j in range(16):
                        byte = qs[n, b * 16 + j]
                        acc[j] += x[t, b * 32 + j] * (d * np.float32(np.int32(byte & 15) - 8))
                        acc[j + 16] += x[t, b * 32 + j + 16] * (d * np.float32(np.int32(byte >> 4) - 8))
                out[t, n] = acc.sum()
