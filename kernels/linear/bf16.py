"""y = x @ W.T with x rounded to bf16 and bf16 weights packed in 4-row blocks (kernels/simd/bf16.py), through
AVX512-BF16's vdpbf16ps: activation_dtype "bfloat16".

Parallel tasks own a block of 4 output rows; each walks a chunk of tokens, BLOCK_TOKENS at a time, while the
chunk of x stays in L2. The activations are rounded to nearest even (as torch's .to(bfloat16)) into a buffer
padded to the weights' whole groups.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.bf16 import f32_to_bf16
from kernels.linear.chunking import token_chunk
from kernels.simd.bf16 import ROWS, bf16_block

PARALLEL_MIN_TOKENS = 16  # waking the thread pool costs more than rounding a few rows
# 4 rows x 6 tokens: 24 accumulators, 4 weight vectors and one of x in the 32 registers (the most that fit;
# faster than 4 tokens a block from 32 tokens up: HISTORY "bf16 on 512-bit vectors")
BLOCK_TOKENS = 6


@njit(cache=True, nogil=True, parallel=True)
def matmul_bf16(xb, w, out, x_chunk_bytes):
    # xb: [T, Kp] uint16 bf16, w: [N4, Kp] uint16 bf16 in 4-row blocks, out: [T, N] f32; x_chunk_bytes:
    # kernels/linear/chunking.py
    T, Kp = xb.shape
    chunk = token_chunk(2 * Kp, BLOCK_TOKENS, x_chunk_bytes)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        for task in prange(w.shape[0] // ROWS):
            _bf16_tokens(xb, w, out, task * ROWS, c0, c1)


def _bf16_tokens(xb, w, out, n, c0, c1):
    raise NotImplementedError("numba-only")


@overload(_bf16_tokens, inline="always")
def _bf16_tokens_impl(xb, w, out, n, c0, c1):
    if not isinstance(xb, types.Array):
        return None

    def impl(xb, w, out, n, c0, c1):
        t = c0
        while t + BLOCK_TOKENS <= c1:
            bf16_block(xb, w, out, t, n, BLOCK_TOKENS)
            t += BLOCK_TOKENS
        if c1 - t >= 4:
            bf16_block(xb, w, out, t, n, 4)
            t += 4
        if c1 - t >= 2:
            bf16_block(xb, w, out, t, n, 2)
            t += 2
        if c1 - t == 1:
            bf16_block(xb, w, out, t, n, 1)
    return impl


@njit(inline="always", nogil=True)
def _round_row(x, xb, t):
    K = x.shape[1]
    for k in range(K):
        xb[t, k] = f32_to_bf16(x[t, k])
    for k in range(K, xb.shape[1]):
        xb[t, k] = 0


@njit(cache=True, nogil=True)
def _round_serial(x, xb):
    for t in range(x.shape[0]):
        _round_row(x, xb, t)


@njit(cache=True, nogil=True, parallel=True)
def _round_parallel(x, xb):
    for t in prange(x.shape[0]):
        _round_row(x, xb, t)


def round_activations(x: np.ndarray, xb: np.ndarray) -> None:
    # x: [T, K] f32 -> xb: [T, Kp] uint16 bf16 (round to nearest even), zero-padded
    (_round_parallel if x.shape[0] >= PARALLEL_MIN_TOKENS else _round_serial)(x, xb)
