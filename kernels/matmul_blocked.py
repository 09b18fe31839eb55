"""Batched linear for tens of tokens: each weight row is dequantized once into a per-task buffer, then
a 4-row x 4-token block keeps 16 accumulators in vector registers (one weight load feeds 4 FMAs).
"""

import numpy as np
from numba import njit, prange

from kernels.dequant import dequantize_row

_ROW_BLOCK = 4
_TOK_BLOCK = 4
_ROWS_PER_TASK = 32


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def matmul_blocked(x, data, scales, out):
    # x: [T, K] f32; data/scales: a weight in any served format ([N, ...]); out: [T, N] f32
    T, K = x.shape
    N = out.shape[1]
    for task in prange((N + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty((_ROW_BLOCK, K), np.float32)
        for n0 in range(task * _ROWS_PER_TASK, min(N, (task + 1) * _ROWS_PER_TASK), _ROW_BLOCK):
            nr = min(_ROW_BLOCK, N - n0)
            for r in range(nr):
                dequantize_row(data, scales, n0 + r, w[r])
            if nr < _ROW_BLOCK:
                w[nr:] = 0.0
            t0 = 0
            while t0 + _TOK_BLOCK <= T:
                _block_4x4(x, w, t0, n0, nr, out)
                t0 += _TOK_BLOCK
            for t in range(t0, T):
                for r in range(nr):
                    acc = np.float32(0.0)
                    for k in range(K):
                        acc += x[t, k] * w[r, k]
                    out[t, n0 + r] = acc


@njit(inline="always", nogil=True, fastmath=True)
def _block_4x4(x, w, t0, n0, nr, out):
    a00 = a01 = a02 = a03 = np.float32(0.0)
    a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = np.float32(0.0)
    a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0, w1, w2, w3 = w[0, k], w[1, k], w[2, k], w[3, k]
        x0, x1, x2, x3 = x[t0, k], x[t0 + 1, k], x[t0 + 2, k], x[t0 + 3, k]
        a00 += x0 * w0
        a01 += x0 * w1
        a02 += x0 * w2
        a03 += x0 * w3
        a10 += x1 * w0
        a11 += x1 * w1
        a12 += x1 * w2
        a13 += x1 * w3
        a20 += x2 * w0
        a21 += x2 * w1
        a22 += x2 * w2
        a23 += x2 * w3
        a30 += x3 * w0
        a31 += x3 * w1
        a32 += x3 * w2
        a33 += x3 * w3
    acc = ((a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33))
    for i in range(4):
        row = acc[i]
        for r in range(nr):
            out[t0 + i, n0 + r] = row[r]
