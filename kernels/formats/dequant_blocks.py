"""Dequantize rows of GGML block bytes (kernels/formats/ggml_blocks.py) into float32: the K-quants, q4_1 /
q5_0 / q5_1 and iq4_nl / iq4_xs, bit-equal to the gguf package's dequantize
(tests/kernels/test_kquant_dequant.py).

Each value is computed in gguf's (and ggml's reference dequantizer's) order in float32: a sub-block's scale
d * sc and min dmin * m first, then scale * q - min (K-quants), d * q + m (q4_1, q5_1), d * (q - 16) (q5_0).

Block layouts (byte offsets in a block; fp16 little-endian; "q[i]" is value i of the block):
  q4_k  144: d 0, dmin 2, scales 4..15 (8 pairs of 6-bit scale and min, packed), qs 16..143: byte 32c + l
        holds q[64c + l] low, q[64c + 32 + l] high
  q5_k  176: d 0, dmin 2, scales 4..15, qh 16..47, qs 48..175 as q4_k's; bit 2c of qh[l] is the 5th bit
        of q[64c + l], bit 2c + 1 that of q[64c + 32 + l]
  q6_k  210: ql 0..127, qh 128..191, int8 scales 192..207 (one per 16 values), d 208; half h (128 values)
        uses ql[64h..], qh[32h..]: q[128h + 32s + l] takes ql[64h + l + 32 (s % 2)] low (s < 2) / high
        nibble and bits 2s, 2s + 1 of qh[32h + l], minus 32
  q4_1   20: d 0, m 2, qs 4..19 (q[j] low, q[j + 16] high nibble of byte j)
  q5_0   22: d 0, qh 2..5 (uint32: bit j is q[j]'s 5th bit), qs 6..21 as q4_1's; q - 16
  q5_1   24: d 0, m 2, qh 4..7, qs 8..23
  iq4_nl 18: d 0, qs 2..17 as q4_1's, each nibble an index into IQ4_VALUES: d * IQ4_VALUES[q]
  iq4_xs 136: d 0, scales_h 2..3, scales_l 4..7, qs 8..135 (block b: 16 bytes as iq4_nl's); block b's scale
        l_b = (scales_l[b // 2] >> 4 (b % 2)) & 15 | ((scales_h >> 2b) & 3) << 4, value (d * (l_b - 32)) *
        IQ4_VALUES[q] (kernels/formats/quant_iq4.py)
"""

import numpy as np
from numba import njit

from kernels.formats import ggml_blocks as gb
from kernels.formats.fp16 import f16_to_f32
from kernels.formats.quant_iq4 import IQ4_VALUES


@njit(inline="always", nogil=True)
def fp16_at(row, i):
    """The fp16 at bytes i, i + 1 of a uint8 row, as float32."""
    return f16_to_f32(np.uint16(row[i]) | (np.uint16(row[i + 1]) << np.uint16(8)))


@njit(inline="always", nogil=True)
def scale_min_k4(row, at, j):
    """Sub-block j's 6-bit scale and min from a q4_k / q5_k block's 12 packed scale bytes at row[at:]."""
    if j < 4:
        return row[at + j] & 63, row[at + j + 4] & 63
    return ((row[at + j + 4] & 15) | ((row[at + j - 4] >> 6) << 4),
            (row[at + j + 4] >> 4) | ((row[at + j] >> 6) << 4))


@njit(inline="always", nogil=True)
def _q4_k(row, dst):
    # dst: [K] f32; contiguous loops over 32 bytes, so that they vectorize
    for b in range(dst.shape[0] // gb.QK_K):
        o, y = b * gb.Q4_K_BYTES, b * gb.QK_K
        d, dmin = fp16_at(row, o), fp16_at(row, o + 2)
        for c in range(4):
            sc, m = scale_min_k4(row, o + 4, 2 * c)
            d0, m0 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = scale_min_k4(row, o + 4, 2 * c + 1)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                q = row[o + 16 + 32 * c + l]
                dst[y + 64 * c + l] = d0 * np.float32(q & 15) - m0
                dst[y + 64 * c + 32 + l] = d1 * np.float32(q >> 4) - m1


@njit(inline="always", nogil=True)
def _q5_k(row, dst):
    for b in range(dst.shape[0] // gb.QK_K):
        o, y = b * gb.Q5_K_BYTES, b * gb.QK_K
        d, dmin = fp16_at(row, o), fp16_at(row, o + 2)
        for c in range(4):
            sc, m = scale_min_k4(row, o + 4, 2 * c)
            d0, m0 = d * np.float32(sc), dmin * np.float32(m)
            sc, m = scale_min_k4(row, o + 4, 2 * c + 1)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            for l in range(32):
                q, h = row[o + 48 + 32 * c + l], row[o + 16 + l] >> (2 * c)
                dst[y + 64 * c + l] = d0 * np.float32((q & 15) | ((h & 1) << 4)) - m0
                dst[y + 64 * c + 32 + l] = d1 * np.float32((q >> 4) | ((h & 2) << 3)) - m1


@njit(inline="always", nogil=True)
def _q6_k(row, dst):
    for b in range(dst.shape[0] // gb.QK_K):
        o = b * gb.Q6_K_BYTES
        d = fp16_at(row, o + 208)
        for h in range(2):
            y = b * gb.QK_K + 128 * h
            for half in range(2):  # values l of 0..15 and of 16..31 of each 32 have their own scales
                sc = o + 192 + 8 * h + half
                d0 = d * np.float32(np.int8(row[sc]))
                d1 = d * np.float32(np.int8(row[sc + 2]))
                d2 = d * np.float32(np.int8(row[sc + 4]))
                d3 = d * np.float32(np.int8(row[sc + 6]))
                for l in range(16 * half, 16 * half + 16):
                    a, c = row[o + 64 * h + l], row[o + 64 * h + 32 + l]
                    hi = np.int32(row[o + 128 + 32 * h + l])
                    dst[y + l] = d0 * np.float32((np.int32(a & 15) | ((hi & 3) << 4)) - 32)
                    dst[y + 32 + l] = d1 * np.float32((np.int32(c & 15) | ((hi & 12) << 2)) - 32)
                    dst[y + 64 + l] = d2 * np.float32((np.int32(a >> 4) | (hi & 48)) - 32)
                    dst[y + 96 + l] = d3 * np.float32((np.int32(c >> 4) | ((hi & 192) >> 2)) - 32)


@njit(inline="always", nogil=True)
def _q5_high_bits(row, at):
    # the uint32 of 5th bits at row[at:at + 4]
    qh = np.uint32(0)
    for i in range(4):
        qh |= np.uint32(row[at + i]) << np.uint32(8 * i)
    return qh


@njit(inline="always", nogil=True)
def _legacy(row, fifth_bit, has_min, dst):
    # q4_1 (has_min), q5_0 (fifth_bit), q5_1 (both) rows; the flags are compile-time constants per caller,
    # so each format's loop is branch-free and vectorizes
    type_size = gb.Q4_1_BYTES if not fifth_bit else gb.Q5_1_BYTES if has_min else gb.Q5_0_BYTES
    for b in range(dst.shape[0] // 32):
        o, y = b * type_size, b * 32
        d = fp16_at(row, o)
        m = fp16_at(row, o + 2) if has_min else np.float32(0.0)
        qh = _q5_high_bits(row, o + (4 if has_min else 2)) if fifth_bit else np.uint32(0)
        qs = o + type_size - 16
        for j in range(16):
            lo, hi = np.int32(row[qs + j] & 15), np.int32(row[qs + j] >> 4)
            if fifth_bit:
                lo |= np.int32((qh >> np.uint32(j)) & np.uint32(1)) << 4
                hi |= np.int32((qh >> np.uint32(j + 16)) & np.uint32(1)) << 4
            if has_min:
                dst[y + j] = d * np.float32(lo) + m
                dst[y + 16 + j] = d * np.float32(hi) + m
            else:
                dst[y + j] = d * np.float32(lo - 16)
                dst[y + 16 + j] = d * np.float32(hi - 16)


@njit(inline="always", nogil=True)
def _iq4(row, super_block, dst):
    # iq4_nl (32-value blocks) or iq4_xs (super_block: 256-value ones with 6-bit block scales) rows
    type_size = gb.IQ4_XS_BYTES if super_block else gb.IQ4_NL_BYTES
    per_block = 256 if super_block else 32
    for s in range(dst.shape[0] // per_block):
        o = s * type_size
        d = fp16_at(row, o)
        for b in range(per_block // 32):
            dl = d
            if super_block:
                low = (np.int32(row[o + 4 + b // 2]) >> (4 * (b % 2))) & 15
                high = (np.int32(row[o + 2 + b // 4]) >> (2 * (b % 4))) & 3
                dl = d * np.float32((low | (high << 4)) - 32)
            qs, y = o + (8 if super_block else 2) + 16 * b, s * per_block + 32 * b
            for j in range(16):
                dst[y + j] = dl * np.float32(IQ4_VALUES[row[qs + j] & 15])
                dst[y + 16 + j] = dl * np.float32(IQ4_VALUES[row[qs + j] >> 4])


@njit(inline="always", nogil=True)
def dequantize_block_row(code, row, dst):
    """One row of GGML blocks of format code, uint8 [row_bytes] -> dst: [K] f32."""
    if code == gb.Q4_K:
        _q4_k(row, dst)
    elif code == gb.Q5_K:
        _q5_k(row, dst)
    elif code == gb.Q6_K:
        _q6_k(row, dst)
    elif code == gb.Q4_1:
        _legacy(row, False, True, dst)
    elif code == gb.Q5_0:
        _legacy(row, True, False, dst)
    elif code == gb.Q5_1:
        _legacy(row, True, True, dst)
    else:
        _iq4(row, code == gb.IQ4_XS, dst)


@njit(cache=True, nogil=True)
def dequantize_block_rows(code, data, row_start, dst):
    # rows row_start .. row_start + R of data: uint8 [N, row_bytes] -> dst: [R, K] f32
    for r in range(dst.shape[0]):
        dequantize_block_row(code, data[row_start + r], dst[r])
