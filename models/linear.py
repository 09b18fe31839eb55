"""y = x @ W.T for every served weight format, over a flat token batch."""

import numpy as np

from kernels.dequant import dequantize_rows
from kernels.int8_layout import QK, quantize_activations
from kernels.linear import gather_rows_bf16, matmul
from kernels.linear_int8 import matmul_int8
from memory.weights import Int8Matrix, WeightMatrix

BLAS_MIN_ROWS = 128  # float32 weights from this many tokens (prefill): numpy's matmul
_NO_SCALES = np.zeros((1, 1), np.uint16)


def linear(x: np.ndarray, w: WeightMatrix | Int8Matrix) -> np.ndarray:
    # x: [T, K] f32 -> [T, N] f32
    T, N = x.shape[0], w.shape[0]
    out = np.empty((T, N), np.float32)
    if isinstance(w, Int8Matrix):
        kp = w.scales.shape[1] * QK
        xq = np.empty((T, kp), np.int16)
        xd = np.empty((T, kp // QK), np.float32)
        xsum = np.empty((T, kp // QK), np.int32)
        quantize_activations(np.ascontiguousarray(x), xq, xd, xsum, w.activation_scale)
        matmul_int8(xq, xd, xsum, w.data, w.scales, out)
    elif w.dtype == "float32" and T >= BLAS_MIN_ROWS:
        np.matmul(x, w.data.T, out=out)
    else:  # dequantizing in registers beats dequantized tiles through BLAS at every batch size
        matmul(np.ascontiguousarray(x), w.data, _scales(w), out)
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


def dequantize(w: WeightMatrix | Int8Matrix) -> np.ndarray:
    """The whole matrix as float32 [N, K] (tests, export)."""
    if isinstance(w, Int8Matrix):
        w = w.unpack()
    if w.dtype == "float32":
        return w.data
    out = np.empty(w.shape, np.float32)
    dequantize_rows(w.data, _scales(w), 0, out)
    return out


def _scales(w: WeightMatrix) -> np.ndarray:
    return _NO_SCALES if w.scales is None else w.scales
