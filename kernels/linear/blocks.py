"""y = x @ W.T for W in GGML block bytes (kernels/formats/ggml_blocks.py) with float32 activations.

Each parallel part owns a range of 4-row groups. For a group it dequantizes the 4 rows into its own float32
scratch (kernels/formats/dequant_blocks.py) and runs the float32 register block (kernels/simd/block.py) over
them for every token of the chunk. The register block sums every output in one order whatever its shape, so
the outputs are bit-equal to the float32 kernel's over the dequantized matrix (kernels/linear/dispatch.py) at
every batch size, and a token's outputs do not depend on its batch. Memory holds only the quantized bytes;
each group is dequantized once per chunk of tokens (one chunk for any decode batch).

The scratch is allocated once per call, one slice per part (PARTS_PER_THREAD per thread), not in the parallel
loop. Groups of 4 rows, not 1: one-row groups (1 x 4 register blocks) ran slower, most of all at many tokens
(at 1 token the time is mostly the dequantization).
"""

import numpy as np
from numba import get_num_threads, njit, prange

from kernels.formats.dequant_blocks import dequantize_block_row
from kernels.linear.chunking import token_chunk
from kernels.simd.block import matmul_block

ROWS = 4  # rows per register block and per dequantized group
TOKENS = 4  # tokens per register block
PARTS_PER_THREAD = 4  # parts per thread: work can move off a core another process holds


def matmul_blocks(x: np.ndarray, data: np.ndarray, code: int, out: np.ndarray, x_chunk_bytes: int) -> None:
    # x: [T, K] f32; data: uint8 [N, row_bytes] in format code; out: [T, N] f32
    _matmul_parts(x, data, code, out, PARTS_PER_THREAD * get_num_threads(), x_chunk_bytes)


@njit(cache=True, nogil=True, parallel=True)
def _matmul_parts(x, data, code, out, num_parts, x_chunk_bytes):
    T, K = x.shape
    N = out.shape[1]
    chunk = token_chunk(4 * K, TOKENS, x_chunk_bytes)
    num_groups = (N + ROWS - 1) // ROWS
    num_parts = min(num_groups, num_parts)
    w = np.empty((num_parts, ROWS, K), np.float32)  # each part's dequantized group
    y = np.empty((num_parts, min(T, chunk), ROWS), np.float32)  # each part's outputs for its group
    no_scales = np.zeros((1, 1), np.uint16)  # float32 rows have none
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        xc = x[c0:c1]
        for p in prange(num_parts):
            for g in range(p * num_groups // num_parts, (p + 1) * num_groups // num_parts):
                _group(xc, data, code, g * ROWS, min(ROWS, N - g * ROWS), w[p], no_scales, y[p, :c1 - c0])
                out[c0:c1, g * ROWS:g * ROWS + ROWS] = y[p, :c1 - c0, :min(ROWS, N - g * ROWS)]


@njit(inline="always", nogil=True)
def _group(xc, data, code, n0, rows, w, no_scales, y):
    # rows n0 .. n0 + rows of data dequantized into w: [ROWS, K]; y: [Tc, ROWS] = xc @ w.T (rows past `rows`
    # zero, their outputs unused)
    for r in range(rows):
        dequantize_block_row(code, data[n0 + r], w[r])
    w[rows:] = 0
    t = 0
    while t + TOKENS <= xc.shape[0]:
        matmul_block(xc, w, no_scales, y, t, 0, ROWS, TOKENS)
        t += TOKENS
    while t < xc.shape[0]:
        matmul_block(xc, w, no_scales, y, t, 0, ROWS, 1)
        t += 1
