"""GGML's 4-bit non-linear formats IQ4_NL and IQ4_XS from float32, bit-equal to llama.cpp's quantize_iq4_nl /
quantize_iq4_xs (quantize_row_iq4_nl_impl, what llama-quantize runs, with or without an importance matrix).

Each value is one of 16 levels, IQ4_VALUES, times its 32-value block's scale. Per block the scale is fit
over 15 grids (the largest value on level -127 + t, t = -7 .. 7) by weighted least squares, weights x**2
without an importance matrix or its column's importance * sqrt(2 mean(x**2) + x**2) with one; IQ4_NL keeps
it in fp16 and re-picks the levels against it; IQ4_XS puts the 8 blocks' scales of a 256-value super-block
on one fp16 d times a 6-bit signed integer each (the largest on -32) and picks the levels against d * l.

Blocks: iq4_nl 18 bytes (fp16 d, qs[16]); iq4_xs 136 bytes (fp16 d, uint16 scales_h: 2 high bits of block
b's scale at bit 2b, scales_l[4]: 4 low bits, block 2i's low nibble and 2i + 1's high nibble of byte i,
qs[128]); block b's qs byte j holds value j's level in its low nibble and value j + 16's in its high one;
a scale's integer is stored + 32.
"""

import numpy as np
from gguf import GGMLQuantizationType as GT
from numba import njit, prange

from kernels.formats.fp16 import put_f16
from kernels.formats.quant_search import GROUP_MAX_EPS, clamp, nearest_int

IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
IQ4_NL, IQ4_XS = int(GT.IQ4_NL), int(GT.IQ4_XS)
NTRY = 7  # grids either side of the first (quantize_iq4_nl / _xs pass 7)


@njit(cache=True, nogil=True, parallel=True)
def quantize_iq4(code, w, importance, out):
    # w: [N, K] f32 (K % 32 == 0, K % 256 == 0 for IQ4_XS); importance: [G, K] f32, row n weighted by
    # importance[n // (N // G)], or [0, K] for none -> out: [N, row bytes] uint8 in format code
    super_block = 256 if code == IQ4_XS else 32
    num_blocks = w.shape[1] // super_block
    type_size = out.shape[1] // num_blocks
    weighted = importance.shape[0] > 0
    rows_per_group = w.shape[0] // max(1, importance.shape[0])
    for n in prange(w.shape[0]):
        levels = np.empty(super_block, np.uint8)
        weights = np.empty(32, np.float32)
        scales = np.empty(super_block // 32, np.float32)
        qw = importance[n // rows_per_group] if weighted else w[n]
        for b in range(num_blocks):
            at = b * super_block
            _super_block(w[n, at:at + super_block], qw[at:at + super_block], weighted,
                         out[n, b * type_size:(b + 1) * type_size], levels, weights, scales)


@njit(inline="always", nogil=True)
def best_level(v):
    """The index of the IQ4 level nearest v (ggml's best_index_int8: a tie goes to the upper level)."""
    if v <= np.float32(IQ4_VALUES[0]):
        return 0
    if v >= np.float32(IQ4_VALUES[15]):
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if v < np.float32(IQ4_VALUES[mid]):
            hi = mid
        else:
            lo = mid
    return hi - 1 if v - np.float32(IQ4_VALUES[hi - 1]) < np.float32(IQ4_VALUES[hi]) - v else hi


@njit(inline="always", nogil=True)
def _fit_sums(x, weights, inverse):
    # the levels nearest inverse * x: (sum w q x, sum w q q)
    sumqx, sumq2 = np.float32(0.0), np.float32(0.0)
    for j in range(x.shape[0]):
        q = np.float32(IQ4_VALUES[best_level(inverse * x[j])])
        sumqx += weights[j] * q * x[j]
        sumq2 += weights[j] * q * q
    return sumqx, sumq2


@njit(inline="always", nogil=True)
def _super_block(x, qw, weighted, block, L, weights, scales):
    # x, qw: [32 | 256] f32 -> block: iq4_nl [18] | iq4_xs [136] uint8; L: [32 | 256] uint8 scratch
    n = x.shape[0]
    sigma2 = np.float32(0.0)
    for j in range(n):
        sigma2 += x[j] * x[j]
    sigma2 *= np.float32(2.0) / np.float32(n)
    max_scale, amax_scale = np.float32(0.0), np.float32(0.0)
    first = np.float32(IQ4_VALUES[0])
    for ib in range(n // 32):
        xb = x[32 * ib:32 * ib + 32]
        for j in range(32):
            weights[j] = (qw[32 * ib + j] * np.float32(np.sqrt(sigma2 + xb[j] * xb[j])) if weighted
                          else xb[j] * xb[j])
        amax, vmax = np.float32(0.0), np.float32(0.0)
        for j in range(32):
            if abs(xb[j]) > amax:
                amax, vmax = abs(xb[j]), xb[j]
        if amax < GROUP_MAX_EPS:
            scales[ib] = 0.0
            continue
        d = -vmax / first
        inverse = np.float32(1.0) / d
        sumqx, sumq2 = np.float32(0.0), np.float32(0.0)
        for j in range(32):
            level = best_level(inverse * xb[j])
            L[32 * ib + j] = level
            q = np.float32(IQ4_VALUES[level])
            sumqx += weights[j] * q * xb[j]
            sumq2 += weights[j] * q * q
        d = sumqx / sumq2 if sumq2 > 0 else np.float32(0.0)
        best = d * sumqx
        for t in range(-NTRY, NTRY + 1):
            sumqx, sumq2 = _fit_sums(xb, weights, (np.float32(t) + first) / vmax)
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                d = sumqx / sumq2
                best = d * sumqx
        scales[ib] = d
        if abs(d) > amax_scale:
            amax_scale, max_scale = abs(d), d
    if n == 32:  # iq4_nl: the scale in fp16, the levels picked again against it (unrounded)
        put_f16(block, 0, scales[0])
        inverse = np.float32(1.0) / scales[0] if scales[0] != 0 else np.float32(0.0)
        for j in range(32):
            L[j] = best_level(inverse * x[j])
        qs = block[2:18]
    else:  # iq4_xs: d * a 6-bit signed integer per block
        d = -max_scale / np.float32(32.0)
        put_f16(block, 0, d)
        inverse = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        block[2:8] = 0
        for ib in range(8):
            level = clamp(nearest_int(inverse * scales[ib]), -32, 31)
            dl = d * np.float32(level)
            inverse_l = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
            for j in range(32):
                L[32 * ib + j] = best_level(inverse_l * x[32 * ib + j])
            level += 32
            block[4 + ib // 2] |= (level & 15) << (4 * (ib % 2))
            block[2 + ib // 4] |= ((level >> 4) << (2 * (ib % 4))) & 255
        qs = block[8:136]
    for i in range(n // 32):
        for j in range(16):
            qs[16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)
