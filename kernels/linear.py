"""Linear layers y = x @ W.T over a flat token batch; each weight row is read once per step.

W is [out_features, in_features] (the checkpoint's layout). The outer loop runs over output rows so
one row is streamed from memory once and reused from L1 for every token of the batch.
"""

import numpy as np
from numba import njit, prange

from kernels.bf16 import bf16_to_f32


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
def dequantize_bf16_rows(w, row_start, dst):
    # w: [N, K] uint16; dst: [R, K] f32 <- rows row_start .. row_start+R of w
    for r in prange(dst.shape[0]):
        for k in range(w.shape[1]):
            dst[r, k] = bf16_to_f32(w[row_start + r, k])


@njit(cache=True, nogil=True, parallel=True)
def gather_rows_bf16(w, ids, out):
    # w: [V, H] uint16, ids: [T] -> out: [T, H] f32 (embedding lookup)
    for t in prange(ids.shape[0]):
        for h in range(w.shape[1]):
            out[t, h] = bf16_to_f32(w[ids[t], h])
