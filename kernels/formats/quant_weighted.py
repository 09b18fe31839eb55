"""GGML's legacy 32-value formats (q4_0, q4_1, q5_0, q5_1) quantized with an importance matrix, bit-equal to
llama.cpp's quantize_row_q4_0_impl / _q4_1_impl / _q5_0_impl / _q5_1_impl (what llama-quantize runs with
--imatrix). Without one they are the reference rounding of kernels/formats/quant.py and the gguf package.

Each value's weight is its column's importance * sqrt(mean(row**2) + x**2); q4_0 / q5_0 fit one signed scale
per block (fit_signed_scale over 8 / 16 levels each side), q4_1 / q5_1 a scale and a min (fit_scale_min over
15 / 31 levels, ggml's wider search of 37 grids). Output: GGML's blocks, uint8 [N, row_bytes]:
q4_0 (d, qs[16]), q4_1 (d, m, qs[16]), q5_0 (d, qh[4], qs[16]), q5_1 (d, m, qh[4], qs[16]); qs byte j holds
element j in its low nibble and j + 16 in its high one, qh bit j element j's fifth bit.
"""

import numpy as np
from gguf import GGMLQuantizationType as GT
from numba import njit, prange

from kernels.formats.fp16 import put_f16
from kernels.formats.quant_search import fit_scale_min, fit_signed_scale

QK = 32
Q4_0, Q4_1, Q5_0, Q5_1 = int(GT.Q4_0), int(GT.Q4_1), int(GT.Q5_0), int(GT.Q5_1)


@njit(cache=True, nogil=True, parallel=True)
def quantize_weighted_32(code, w, importance, out):
    # w: [N, K] f32, K % 32 == 0; importance: [G, K] f32, row n weighted by importance[n // (N // G)]
    # -> out: [N, K // 32 * type_size] uint8 GGML blocks of format code (Q4_0, Q4_1, Q5_0, Q5_1)
    num_blocks = w.shape[1] // QK
    type_size = out.shape[1] // num_blocks
    rows_per_group = w.shape[0] // importance.shape[0]
    with_min = code == Q4_1 or code == Q5_1
    fifth_bit = code == Q5_0 or code == Q5_1
    for n in prange(w.shape[0]):
        x, qw = w[n], importance[n // rows_per_group]
        weights = np.empty(QK, np.float32)
        signed = np.empty(QK, np.int8)
        levels = np.empty(QK, np.uint8)
        trial = np.empty(QK, np.uint8)
        sum_x2 = np.float32(0.0)
        for i in range(x.shape[0]):
            sum_x2 += x[i] * x[i]
        sigma2 = sum_x2 / np.float32(x.shape[0])
        for b in range(num_blocks):
            xb, block = x[b * QK:(b + 1) * QK], out[n, b * type_size:(b + 1) * type_size]
            for i in range(QK):
                weights[i] = qw[b * QK + i] * np.float32(np.sqrt(sigma2 + xb[i] * xb[i]))
            if with_min:
                d, the_min = fit_scale_min(xb, weights, 31 if fifth_bit else 15, np.float32(-0.9),
                                           np.float32(0.05), 36, levels, trial)
                put_f16(block, 0, d)
                put_f16(block, 2, -the_min)
                _pack(levels, fifth_bit, block, 4)
            else:
                d = fit_signed_scale(xb, weights, 16 if fifth_bit else 8, signed)
                put_f16(block, 0, d)
                for i in range(QK):
                    levels[i] = signed[i]
                _pack(levels, fifth_bit, block, 2)


@njit(inline="always", nogil=True)
def _pack(L, fifth_bit, block, at):
    # L: [32] levels (< 16, or < 32 with fifth_bit) into block[at:]: (qh: 4 bytes,) qs: 16 bytes
    qs = block[at + 4:] if fifth_bit else block[at:]
    qh = np.uint32(0)
    for j in range(16):
        lo, hi = L[j], L[j + 16]
        qs[j] = (lo & 15) | ((hi & 15) << 4)
        qh |= np.uint32((lo >> 4) & 1) << np.uint32(j)
        qh |= np.uint32((hi >> 4) & 1) << np.uint32(j + 16)
    if fifth_bit:
        for i in range(4):
            block[at + i] = (qh >> np.uint32(8 * i)) & np.uint32(255)
