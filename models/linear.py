"""y = x @ W.T for every served weight format, over a flat token batch."""

import numpy as np

from kernels.linear import dequantize_bf16_rows, gather_rows_bf16, matmul_bf16, matmul_f32
from memory.weights import WeightMatrix

BLAS_MIN_ROWS = 16  # from this many tokens a step is compute-bound: numpy's BLAS beats a streaming kernel
_TILE_BYTES = 4 << 20  # float32 tile of dequantized rows handed to BLAS


def linear(x: np.ndarray, w: WeightMatrix) -> np.ndarray:
    # x: [T, K] f32 -> [T, N] f32
    T = x.shape[0]
    N, K = w.shape
    out = np.empty((T, N), np.float32)
    if w.dtype == "float32":
        if T >= BLAS_MIN_ROWS:
            np.matmul(x, w.data.T, out=out)
        else:
            matmul_f32(x, w.data, out)
    elif T < BLAS_MIN_ROWS:
        matmul_bf16(x, w.data, out)
    else:
        rows = max(1, _TILE_BYTES // (4 * K))
        tile = np.empty((rows, K), np.float32)
        for start in range(0, N, rows):
            r = min(rows, N - start)
            dequantize_bf16_rows(w.data, start, tile[:r])
            out[:, start:start + r] = x @ tile[:r].T  # BLAS needs a contiguous result: copy after
    return out


def embed(w: WeightMatrix, token_ids: np.ndarray) -> np.ndarray:
    # token_ids: [T] -> [T, H] f32
    if w.dtype == "float32":
        return w.data[token_ids]
    out = np.empty((token_ids.shape[0], w.shape[1]), np.float32)
    gather_rows_bf16(w.data, token_ids, out)
    return out
