"""Linear layers y = x @ W.T over a flat token batch, for every served weight format.

W is [out_features, in_features] (the checkpoint's layout). Parallel tasks own groups of output rows;
a group's rows are dequantized in registers once per block of tokens (kernels/simd/block.py) and stay
in L1 while the blocks walk a chunk of tokens, so each weight byte comes from memory once per chunk
(once per step for any decode batch; a long prefill is cut into chunks whose activations fit L2).
Every block shape sums an output in the same order (kernels/simd/block.py), so a token's outputs do not
depend on its batch, its block or its place in the block.
"""

from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.bf16 import as_f32, bf16_to_f32
from kernels.linear.chunking import token_chunk
from kernels.simd.block import matmul_block

MATVEC_MAX_TOKENS = 3  # up to this many tokens: one row per task


@njit(cache=True, nogil=True, parallel=True)
def matmul(x, data, scales, out, x_chunk_bytes):
    # x: [T, K] f32; data/scales: one weight in any served format (kernels/formats/dequant.py; float16 as
    # int16 bits, kernels/formats/fp16.py); out: [T, N] f32; x_chunk_bytes: kernels/linear/chunking.py
    T, K = x.shape
    chunk = token_chunk(4 * K, 8, x_chunk_bytes)
    for c0 in range(0, T, chunk):  # a chunk of x stays in L2 while every row group passes over it
        _matmul_chunk(x, data, scales, out, c0, min(T, c0 + chunk))


def _matmul_chunk(x, data, scales, out, c0, c1):
    raise NotImplementedError("numba-only")


@overload(_matmul_chunk, inline="always")
def _matmul_chunk_impl(x, data, scales, out, c0, c1):
    # register block shape, measured per format: q4_0's unpacking costs more per weight than bf16's or
    # q8_0's, so it shares each unpacked row among 8 tokens (2 rows x 8 tokens); the others use 4 x 4
    rows, tokens = (2, 8) if data.dtype == types.uint8 else (4, 4)

    def impl(x, data, scales, out, c0, c1):
        N = out.shape[1]
        if c1 - c0 <= MATVEC_MAX_TOKENS:  # one row per task streams best (interleaved rows read slower)
            for n in prange(N):
                if c1 - c0 == 1:
                    matmul_block(x, data, scales, out, c0, n, 1, 1)
                elif c1 - c0 == 2:
                    matmul_block(x, data, scales, out, c0, n, 1, 2)
                else:
                    matmul_block(x, data, scales, out, c0, n, 1, 3)
                column_tail(x, data, out, c0, c1, n, n + 1)
            return
        for g in prange((N + rows - 1) // rows):
            n0 = g * rows
            if n0 + rows <= N:
                t0 = c0
                while t0 + tokens <= c1:
                    matmul_block(x, data, scales, out, t0, n0, rows, tokens)
                    t0 += tokens
                if tokens == 8 and t0 + 4 <= c1:
                    matmul_block(x, data, scales, out, t0, n0, rows, 4)
                    t0 += 4
                for t in range(t0, c1):
                    matmul_block(x, data, scales, out, t, n0, rows, 1)
            else:
                for n in range(n0, N):
                    for t in range(c0, c1):
                        matmul_block(x, data, scales, out, t, n, 1, 1)
            column_tail(x, data, out, c0, c1, n0, min(N, n0 + rows))

    return impl


@njit(inline="always", nogil=True)
def column_tail(x, data, out, c0, c1, n0, n1):
    # columns past the last whole 32-column block: float formats only (quantized rows are whole blocks)
    K = x.shape[1]
    tail = K - K % 32
    if tail < K:
        for n in range(n0, n1):
            for t in range(c0, c1):
                acc = out[t, n]
                for k in range(tail, K):
                    acc += x[t, k] * as_f32(data[n, k])
                out[t, n] = acc


@njit(cache=True, nogil=True, parallel=True)
def gather_rows_bf16(w, ids, out):
    # w: [V, H] uint16, ids: [T] -> out: [T, H] f32 (embedding lookup)
    for t in prange(ids.shape[0]):
        for h in range(w.shape[1]):
            out[t, h] = bf16_to_f32(w[ids[t], h])
