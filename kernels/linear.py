"""Linear layers y = x @ W.T over a flat token batch, for every served weight format.

W is [out_features, in_features] (the checkpoint's layout). Parallel tasks own groups of 4 output
rows; a group's rows are dequantized in registers once per 4-token block (kernels/simd_block.py) and
stay in L1 while the block walks the batch, so each weight byte comes from memory once per step.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kernels.bf16 import bf16_to_f32
from kernels.simd_block import matmul_block

_ROWS = 4  # weight rows per register block
_TOKENS = 4  # tokens per register block (4 x 4 accumulators of 16 lanes)
_X_CHUNK_BYTES = 1 << 19  # tokens of x per pass over the weights: half of a core's L2


@njit(cache=True, nogil=True, parallel=True)
def matmul(x, data, scales, out):
    # x: [T, K] f32; data/scales: one weight in any served format (kernels/dequant.py); out: [T, N] f32
    T, K = x.shape
    chunk = max(_TOKENS, _X_CHUNK_BYTES // (4 * K) // _TOKENS * _TOKENS)
    for c0 in range(0, T, chunk):  # a chunk of x stays in L2 while every row group passes over it
        _matmul_chunk(x, data, scales, out, c0, min(T, c0 + chunk))


@njit(inline="always", nogil=True, parallel=True)
def _matmul_chunk(x, data, scales, out, c0, c1):
    N = out.shape[1]
    if c1 - c0 < _TOKENS:  # matvec: one row per task streams best (interleaved row streams read slower)
        for n in prange(N):
            if c1 - c0 == 1:
                matmul_block(x, data, scales, out, c0, n, 1, 1)
            elif c1 - c0 == 2:
                matmul_block(x, data, scales, out, c0, n, 1, 2)
            else:
                matmul_block(x, data, scales, out, c0, n, 1, 3)
            _column_tail(x, data, out, c0, c1, n, n + 1)
        return
    for g in prange((N + _ROWS - 1) // _ROWS):
        n0 = g * _ROWS
        if n0 + _ROWS <= N:
            t0 = c0
            while t0 + _TOKENS <= c1:
                matmul_block(x, data, scales, out, t0, n0, 4, 4)
                t0 += _TOKENS
            for t in range(t0, c1):
                matmul_block(x, data, scales, out, t, n0, 4, 1)
        else:
            for n in range(n0, N):
                for t in range(c0, c1):
                    matmul_block(x, data, scales, out, t, n, 1, 1)
        _column_tail(x, data, out, c0, c1, n0, min(N, n0 + _ROWS))


@njit(inline="always", nogil=True)
def _column_tail(x, data, out, c0, c1, n0, n1):
    # columns past the last whole 32-column block: float formats only (quantized rows are whole blocks)
    K = x.shape[1]
    tail = K - K % 32
    if tail < K:
        for n in range(n0, n1):
            for t in range(c0, c1):
                acc = out[t, n]
                for k in range(tail, K):
                    acc += x[t, k] * _float_weight(data, n, k)
                out[t, n] = acc


def _float_weight(data, n, k):
    raise NotImplementedError("numba-only")


@overload(_float_weight, inline="always")
def _float_weight_impl(data, n, k):
    if data.dtype == types.float32:
        return lambda data, n, k: data[n, k]
    if data.dtype == types.uint16:
        return lambda data, n, k: bf16_to_f32(data[n, k])
    return lambda data, n, k: np.float32(0.0)  # quantized formats never have a tail


@njit(cache=True, nogil=True, parallel=True)
def gather_rows_bf16(w, ids, out):
    # w: [V, H] uint16, ids: [T] -> out: [T, H] f32 (embedding lookup)
    for t in prange(ids.shape[0]):
        for h in range(w.shape[1]):
            out[t, h] = bf16_to_f32(w[ids[t], h])
