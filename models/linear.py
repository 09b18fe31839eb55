"""y = x @ W.T for every served weight format, over a flat token batch.

Batch invariant: a token's outputs do not depend on the other tokens of the batch (kernels/simd/block.py,
kernels/simd/int8.py sum each output in one order for every block shape), so a request's tokens are the same
alone, batched, verified with drafts or recomputed after a failover. That is why float32 weights do not go
through BLAS for prefill, though OpenBLAS's sgemm runs several times faster than our kernel there: its sums
change with the number of rows (the same rows' outputs differ in their last bits when fewer of them go at
once). Dequantizing in registers beats dequantized tiles through BLAS for the other formats at every batch
size anyway."""

import numpy as np

from kernels.formats.dequant import dequantize_rows
from kernels.formats.dequant_blocks import dequantize_block_rows
from kernels.formats.fp16 import f16_kernel_bits
from kernels.formats.ggml_blocks import BLOCK_DTYPES, CODE
from kernels.formats.int8_layout import QK, padded_k, quantize_activations
from kernels.linear.bf16 import matmul_bf16, round_activations
from kernels.linear.blocks import matmul_blocks
from kernels.linear.chunking import linear_tiles
from kernels.linear.dispatch import gather_rows_bf16, matmul
from kernels.linear.int8 import matmul_int8, matmul_vnni
from kernels.linear.kquant import matmul_kquant, matmul_kquant_avx2
from kernels.linear.q6k import matmul_q6k, matmul_q6k_avx2
from memory.matrices import Bf16Matrix, BlockInt8Matrix, Int8Matrix, Matrix, StackedMatrix, WeightMatrix

_NO_SCALES = np.zeros((1, 1), np.uint16)


def linear(x: np.ndarray, w: Matrix, out: np.ndarray | None = None) -> np.ndarray:
    # x: [T, K] f32 -> out [T, N] f32 (C-contiguous; None: a new array)
    if isinstance(w, StackedMatrix):  # each part's outputs, side by side
        return np.concatenate([linear(x, p) for p in w.parts], axis=1, out=out)
    T, N = x.shape[0], w.shape[0]
    out = np.empty((T, N), np.float32) if out is None else out
    chunk = linear_tiles().x_chunk_bytes
    if isinstance(w, Bf16Matrix):
        xb = np.empty((T, w.data.shape[1]), np.uint16)
        round_activations(np.ascontiguousarray(x), xb)
        matmul_bf16(xb, w.data, out, chunk)
    elif isinstance(w, Int8Matrix):
        xq, xd, xsum = quantized_activations(x, w)
        if w.vnni:
            matmul_vnni(xq, xd, xsum, w.data, w.scales, out, 4 if w.dtype == "q4_0" else 8, chunk)
        else:
            matmul_int8(xq, xd, xsum, w.data, w.scales, out, chunk)
    elif isinstance(w, BlockInt8Matrix):
        xq, xd, xsum = quantized_activations(x, w)
        p = w.packed
        if w.dtype == "q6_k":
            (matmul_q6k if w.vnni else matmul_q6k_avx2)(xq, xd, xsum, p.data, p.d, out, chunk)
        elif w.vnni:
            matmul_kquant(xq, xd, xsum, p.data, out, p.qtype, chunk)
        else:
            matmul_kquant_avx2(xq, xd, xsum, p.data, out, p.qtype, chunk)
    elif w.dtype in BLOCK_DTYPES:  # dequantized by groups of rows into the float32 kernel: the same bits
        matmul_blocks(np.ascontiguousarray(x), w.data, CODE[w.dtype], out, chunk)
    else:  # one kernel at every batch size: see the module docstring
        data = f16_kernel_bits(w.data) if w.dtype == "float16" else w.data
        matmul(np.ascontiguousarray(x), data, _scales(w), out, chunk)
    return out


def quantized_activations(x: np.ndarray,
                          w: Int8Matrix | BlockInt8Matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, K] f32 quantized for w's int8 kernels: (xq [T, Kp], xd and xsum [T, Kp // 32])."""
    T, kp = x.shape[0], padded_k(w.shape[1])
    xq = np.empty((T, kp), w.activation_int_dtype)
    xd = np.empty((T, kp // QK), np.float32)
    xsum = np.empty((T, kp // QK), np.int32)
    quantize_activations(np.ascontiguousarray(x), xq, xd, xsum, w.activation_scale)
    return xq, xd, xsum


def embed(w: WeightMatrix, token_ids: np.ndarray) -> np.ndarray:
    # token_ids: [T] -> [T, H] f32
    if w.dtype in ("float32", "float16"):  # float16 -> float32 is exact
        return w.data[token_ids].astype(np.float32, copy=False)
    out = np.empty((token_ids.shape[0], w.shape[1]), np.float32)
    if w.dtype == "bfloat16":
        gather_rows_bf16(w.data, token_ids, out)
    else:
        for t, token in enumerate(token_ids):
            _dequantize_rows(w, token, out[t:t + 1])
    return out


def dequantize(w: Matrix) -> np.ndarray:
    """The whole matrix as float32 [N, K] (tests, export, LoRA merges)."""
    if isinstance(w, StackedMatrix):
        return np.concatenate([dequantize(p) for p in w.parts])
    if isinstance(w, (Int8Matrix, Bf16Matrix, BlockInt8Matrix)):
        w = w.unpack()
    if w.dtype in ("float32", "float16"):
        return w.data.astype(np.float32, copy=False)
    out = np.empty(w.shape, np.float32)
    _dequantize_rows(w, 0, out)
    return out


def _dequantize_rows(w: WeightMatrix, row_start: int, out: np.ndarray) -> None:
    # rows row_start .. row_start + R of w -> out: [R, K] f32
    if w.dtype in BLOCK_DTYPES:  # uint8 like q4_0's nibbles: told apart by the format's code
        dequantize_block_rows(CODE[w.dtype], w.data, row_start, out)
    else:
        dequantize_rows(w.data, _scales(w), row_start, out)


def _scales(w: WeightMatrix) -> np.ndarray:
    return _NO_SCALES if w.scales is None else w.scales
