"""GGML's K-quants from float32, bit-equal to llama.cpp's quantizers: the reference ones without an importance
matrix (quantize_row_q4_K_ref / _q5_K_ref / _q6_K_ref, what llama-quantize runs with no --imatrix) and the
importance-weighted ones (quantize_row_q4_K_impl / ..., with --imatrix): the same scale searches
(kernels/formats/quant_search.py), then the same rounding of the block's scales and requantization against
them. Block layouts: kernels/formats/dequant_blocks.py. tests/kernels/test_kquant_quantize.py and
tests/kernels/test_weighted_quantize.py hold the bytes to llama.cpp's.

q4_k / q5_k: each 32-value sub-block gets a scale and a min (fit_scale_min; weights |x| + rms(x), or with an
importance matrix its column's importance * sqrt(2 mean(x**2) + x**2) over a wider search); without one the
block's d and dmin put the largest of each on 63 and every sub-block's on a 6-bit integer, with one
fit_positive_scale fits both sets on 6 bits weighted by the sub-blocks' summed weights; the values are then
requantized to the rounded scales. q6_k: each 16-value sub-block a signed scale (fit_signed_scale, weights
x**2 or the importance), the block's d puts the largest in magnitude on -128 and each on an int8.
"""

import numpy as np
from numba import njit, prange

from kernels.formats.dequant_blocks import scale_min_k4
from kernels.formats.fp16 import put_f16
from kernels.formats.ggml_blocks import Q5_K, Q6_K, QK_K
from kernels.formats.quant_search import (
    GROUP_MAX_EPS,
    clamp,
    fit_positive_scale,
    fit_scale_min,
    fit_signed_scale,
    nearest_int,
)


@njit(cache=True, nogil=True, parallel=True)
def quantize_k(code, w, importance, out):
    # w: [N, K] f32, K % 256 == 0; importance: [G, K] f32, row n weighted by importance[n // (N // G)], or
    # [0, K] for none -> out: [N, K // 256 * type_size] uint8 in format code (q4_k, q5_k, q6_k)
    num_blocks = w.shape[1] // QK_K
    type_size = out.shape[1] // num_blocks
    weighted = importance.shape[0] > 0
    rows_per_group = w.shape[0] // max(1, importance.shape[0])
    for n in prange(w.shape[0]):
        L = np.empty(QK_K, np.uint8)
        trial = np.empty(32, np.uint8)
        weights = np.empty(32, np.float32)
        scales = np.empty(16, np.float32)
        mins = np.empty(8, np.float32)
        sums = np.empty(8, np.float32)
        levels = np.empty(16, np.uint8)
        signed = np.empty(QK_K, np.int8)
        qw = importance[n // rows_per_group] if weighted else w[n]
        for b in range(num_blocks):
            x, block = w[n, b * QK_K:(b + 1) * QK_K], out[n, b * type_size:(b + 1) * type_size]
            if code == Q6_K:
                _q6_k(x, qw[b * QK_K:(b + 1) * QK_K], weighted, block, signed, scales, weights)
            elif weighted:
                _q45_k_weighted(x, qw[b * QK_K:(b + 1) * QK_K], code == Q5_K, block, L, trial, weights,
                                scales, mins, sums, levels)
            else:
                _q45_k(x, code == Q5_K, block, L, trial, weights, scales, mins)


@njit(inline="always", nogil=True)
def _q45_k(x, fifth_bit, block, L, trial, weights, scales, mins):
    # x: [256] f32 -> block: q4_k [144] | q5_k (fifth_bit) [176] uint8
    nmax = 31 if fifth_bit else 15
    rmin, nstep = (np.float32(-0.5), 15) if fifth_bit else (np.float32(-1.0), 20)
    max_scale, max_min = np.float32(0.0), np.float32(0.0)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sum_x2 = np.float32(0.0)
        for i in range(32):
            sum_x2 += xs[i] * xs[i]
        rms = np.float32(np.sqrt(sum_x2 / np.float32(32.0)))
        for i in range(32):
            weights[i] = rms + abs(xs[i])
        scales[j], mins[j] = fit_scale_min(xs, weights, nmax, rmin, np.float32(0.1), nstep,
                                           L[32 * j:32 * j + 32], trial)
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
    inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
    for j in range(8):
        _pack_scale_min(block, j, min(63, nearest_int(inv_scale * scales[j]) & 255),  # ggml stores the int
                        min(63, nearest_int(inv_min * mins[j]) & 255))  # in a uint8 first
    _requantize_q45_k(x, fifth_bit, block, L, max_scale / np.float32(63.0), max_min / np.float32(63.0))


@njit(inline="always", nogil=True)
def _q45_k_weighted(x, qw, fifth_bit, block, L, trial, weights, scales, mins, sums, levels):
    # x, qw: [256] f32 -> block: q4_k [144] | q5_k (fifth_bit) [176] uint8 (quantize_row_q{4,5}_K_impl)
    nmax = 31 if fifth_bit else 15
    sum_x2 = np.float32(0.0)
    for i in range(QK_K):
        sum_x2 += x[i] * x[i]
    sigma2 = np.float32(2.0) * sum_x2 / np.float32(QK_K)
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sums[j] = np.float32(0.0)
        for i in range(32):
            weights[i] = qw[32 * j + i] * np.float32(np.sqrt(sigma2 + xs[i] * xs[i]))
            sums[j] += weights[i]
        scales[j], mins[j] = fit_scale_min(xs, weights, nmax, np.float32(-0.9), np.float32(0.05), 36,
                                           L[32 * j:32 * j + 32], trial)
    d = fit_positive_scale(scales[:8], sums, 63, levels[:8])
    dmin = fit_positive_scale(mins, sums, 63, levels[8:])
    for j in range(8):  # q4_k keeps the 8-bit levels as they are, q5_k caps them at 63
        ls, lm = (min(63, levels[j]), min(63, levels[8 + j])) if fifth_bit else (levels[j], levels[8 + j])
        _pack_scale_min(block, j, ls, lm)
    _requantize_q45_k(x, fifth_bit, block, L, d, dmin)


@njit(inline="always", nogil=True)
def _pack_scale_min(block, j, ls, lm):
    # sub-block j's 6-bit scale and min into bytes 4..15 (sub-blocks 4..7 keep their top 2 bits in 0..7's)
    packed = block[4:16]
    if j < 4:
        packed[j], packed[j + 4] = ls & 255, lm & 255
    else:
        packed[j + 4] = ((ls & 15) | ((lm & 15) << 4)) & 255
        packed[j - 4] |= ((ls >> 4) << 6) & 255
        packed[j] |= ((lm >> 4) << 6) & 255


@njit(inline="always", nogil=True)
def _requantize_q45_k(x, fifth_bit, block, L, d_block, dmin_block):
    # the block's d and dmin rounded to fp16, the values requantized against the rounded scales, packed
    nmax = 31 if fifth_bit else 15
    d = put_f16(block, 0, d_block)
    dmin = put_f16(block, 2, dmin_block)
    for j in range(8):
        sc, m = scale_min_k4(block, 4, j)
        dl = d * np.float32(sc)
        if dl == 0:  # ggml keeps the search's integers
            continue
        ml = dmin * np.float32(m)
        for i in range(32):
            L[32 * j + i] = clamp(nearest_int((x[32 * j + i] + ml) / dl), 0, nmax)
    qs = block[48:176] if fifth_bit else block[16:144]
    if fifth_bit:
        block[16:48] = 0
    for c in range(4):
        for i in range(32):
            lo, hi = L[64 * c + i], L[64 * c + 32 + i]
            qs[32 * c + i] = (lo & 15) | ((hi & 15) << 4)
            if fifth_bit:
                block[16 + i] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))


@njit(inline="always", nogil=True)
def _q6_k(x, qw, weighted, block, L, scales, weights):
    # x, qw: [256] f32 (qw read if weighted) -> block: [210] uint8; L: [256] int8, scales: [16] f32,
    # weights: [>= 16] f32 scratch
    max_scale, max_abs = np.float32(0.0), np.float32(0.0)
    for j in range(16):
        xs = x[16 * j:16 * j + 16]
        for i in range(16):
            weights[i] = qw[16 * j + i] if weighted else xs[i] * xs[i]
        scales[j] = fit_signed_scale(xs, weights[:16], 32, L[16 * j:16 * j + 16])
        if abs(scales[j]) > max_abs:
            max_abs, max_scale = abs(scales[j]), scales[j]
    if max_abs < GROUP_MAX_EPS:
        block[:] = 0
        return
    iscale = np.float32(-128.0) / max_scale
    d = put_f16(block, 208, np.float32(1.0) / iscale)
    for j in range(16):
        sc = np.int8(min(127, nearest_int(iscale * scales[j])))
        block[192 + j] = np.uint8(sc)
        dl = d * np.float32(sc)
        if dl == 0:  # ggml keeps the search's integers
            continue
        for i in range(16):
            L[16 * j + i] = clamp(nearest_int(x[16 * j + i] / dl), -32, 31) + 32
    for h in range(2):
        for i in range(32):
            q0, q1, q2, q3 = (np.uint8(L[128 * h + i]), np.uint8(L[128 * h + 32 + i]),
                              np.uint8(L[128 * h + 64 + i]), np.uint8(L[128 * h + 96 + i]))
            block[64 * h + i] = (q0 & 15) | ((q2 & 15) << 4)
            block[64 * h + 32 + i] = (q1 & 15) | ((q3 & 15) << 4)
            block[128 + 32 * h + i] = (q0 >> 4) | ((q1 >> 4) << 2) | ((q2 >> 4) << 4) | ((q3 >> 4) << 6)
