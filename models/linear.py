"""y = x @ W.T for every served weight format, over a flat token batch."""

import numpy as np

from kernels.dequant import dequantize_rows
from kernels.linear import (
    gather_rows_bf16,
    matmul_bf16,
    matmul_f32,
    matmul_q4_0,
    matmul_q8_0,
)
from kernels.matmul_blocked import matmul_blocked
from memory.weights import WeightMatrix

BLOCKED_MIN_ROWS = 4  # from this many tokens, 4-token register blocks beat streaming each token
BLAS_MIN_ROWS = 128  # from this many tokens (prefill), dequantized tiles through BLAS win
_NO_SCALES = np.zeros((1, 1), np.uint16)
_TILE_BYTES = 1 << 20  # float32 tile of dequantized rows (stays in L2 between dequantize and matmul)

_STREAMING = {"float32": matmul_f32, "bfloat16": matmul_bf16, "q8_0": matmul_q8_0, "q4_0": matmul_q4_0}


def linear(x: np.ndarray, w: WeightMatrix) -> np.ndarray:
    # x: [T, K] f32 -> [T, N] f32
    T = x.shape[0]
    N, K = w.shape
    out = np.empty((T, N), np.float32)
    if T < BLOCKED_MIN_ROWS:
        _STREAMING[w.dtype](x, *w.arrays, out)  # reads each weight once for the whole batch
    elif T < BLAS_MIN_ROWS:
        matmul_blocked(x, w.data, _scales(w), out)
    elif w.dtype == "float32":
        np.matmul(x, w.data.T, out=out)
    else:
        rows = max(1, _TILE_BYTES // (4 * K))
        tile = np.empty((rows, K), np.float32)
        for start in range(0, N, rows):
            r = min(rows, N - start)
            dequantize_rows(w.data, _scales(w), start, tile[:r])
            out[:, start:start + r] = x @ tile[:r].T  # BLAS needs a contiguous result: copy after
    return out


def embed(w: WeightMatrix, token_ids: np.ndarray) -> np.ndarray:
    # token_ids: [T] -> [T, H] f32
    if w.dtype == "float32":
        return w.data[token_ids]
    out = np.empty((token_ids.shape[0], w.shape[1]), np.float32)
    if w.dtype == "bfloat16":
        gather_rows_bf16(w.data, token_ids, out)
    else:
        for t, token in enumerate(token_ids):
            dequantize_rows(w.data, _scales(w), token, out[t:t + 1])
    return out


def dequantize(w: WeightMatrix) -> np.ndarray:
    """The whole matrix as float32 [N, K] (tests, export)."""
    if w.dtype == "float32":
        return w.data
    out = np.empty(w.shape, np.float32)
    dequantize_rows(w.data, _scales(w), 0, out)
    return out


def _scales(w: WeightMatrix) -> np.ndarray:
    return _NO_SCALES if w.scales is None else w.scales
