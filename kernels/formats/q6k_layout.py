"""GGUF Q6_K weights repacked for int8 activations in the quad order (kernels/formats/int8_layout.py).

A raw Q6_K block (the file's bytes) covers 256 values, one group of the quad order: ql 128 bytes, qh 64,
16 int8 scales, fp16 d; value = d * scale[i // 16] * (q - 32), q in 0..63 (ql's nibble | qh's 2 bits << 4).
In the quad order, vector j of a group holds values 4j..4j+3 of each 32-value block, so vectors 0-3 are
every block's first 16-value sub-block and 4-7 its second. The kernel (kernels/simd/q6k.py) works on
pairs f = 0..3, a 64-byte vector [vector f | vector f + 4]: byte i < 32 is the value of the first sub-block,
byte 32 + i the second's, so one vpdpbusd leaves block b's two half sums in int32 lanes b and 8 + b.

Per row and group, 192 bytes of values and 16 of scales (6.5 bits per value, with d 6.5625, as in the file):
  values: three 64-byte vectors A, B, C; pairs 0, 1, 2 in bits 0-5 of A, B, C, and pair 3's 2-bit parts in
      their bits 6-7 (bits 0-1 in A's, 2-3 in B's, 4-5 in C's): pair f < 3 is one mask, pair 3 three 16-bit
      shifts, two bit selects and a mask (faster than nibbles and high bits as in the file's two arrays,
      2 + 3 x 3 operations per row and group, where byte shifts become vgf2p8affineqb);
  scales: 16 int8, the first sub-blocks' (scale 2b at b), then the second ones' (scale 2b + 1 at 8 + b), in
      the lanes of the half sums they multiply.
Blocks of 4 rows are interleaved by group (one sequential stream per task): a block's group is 832 bytes,
the 4 rows' A, B, C, then their scales (every 64-byte vector aligned to the group's start). d: fp16 bits, 4
per block's group, in the same order.

  data: uint8 [N4, G * 208], d: uint16 [N4, G]; G = K // 256, N4 = N rounded up to 4, padding rows zero.
The activations need one more input: offsets [T, Kp // 16] int32, per group -32 x the sums of x over the 16
first sub-blocks (lanes 0-7), then the second ones (lanes 8-15), so that the half sums start at the -32 of
q - 32 (subblock_offsets).
"""

import numpy as np
from numba import njit, prange

from kernels.formats.int8_layout import GROUP

ROWS = 4  # rows per interleaved block
RAW_BYTES = 210  # one raw Q6_K block
ROW_BYTES = 208  # one row's packed group without d
VALUES, SCALES = 0, ROWS * 192  # a block's group: where the rows' value vectors and scales start
BLOCK_BYTES = SCALES + ROWS * 16


@njit(inline="always", nogil=True)
def _read_raw(raw, n, at, q):
    # the raw block raw[n, at:at + 210]'s values -> q: [256] uint8 (0..63) in column order
    for half in range(2):
        for lane in range(32):
            low, high = raw[n, at + 64 * half + lane], raw[n, at + 64 * half + 32 + lane]
            top = raw[n, at + 128 + 32 * half + lane]  # the 2 high bits of 4 values
            v = 128 * half + lane
            q[v] = low & 15 | (top & 3) << 4
            q[v + 32] = high & 15 | (top >> 2 & 3) << 4
            q[v + 64] = low >> 4 | (top >> 4 & 3) << 4
            q[v + 96] = high >> 4 | (top >> 6) << 4


@njit(inline="always", nogil=True)
def _write_raw(q, raw, n, at):
    # the inverse of _read_raw: q -> the values' bytes of raw[n, at:at + 192]
    for half in range(2):
        for lane in range(32):
            v = 128 * half + lane
            raw[n, at + 64 * half + lane] = q[v] & 15 | (q[v + 64] & 15) << 4
            raw[n, at + 64 * half + 32 + lane] = q[v + 32] & 15 | (q[v + 96] & 15) << 4
            top = 0
            for quarter in range(4):
                top |= (q[v + 32 * quarter] >> 4) << (2 * quarter)
            raw[n, at + 128 + 32 * half + lane] = top


@njit(inline="always", nogil=True)
def _write_vectors(q, flat, at):
    # q: [256] values in column order -> A, B, C at flat[at:at + 192]: byte i = 32 sub + 4 b + e of pair f
    # is value 32 b + 16 sub + 4 f + e (the quad order's vector f + 4 sub, lane 4 b + e)
    for sub in range(2):
        for b in range(8):
            for e in range(4):
                i, v = 32 * sub + 4 * b + e, 32 * b + 16 * sub + e
                top = q[v + 12]  # pair 3's value, 2 bits in each of A, B, C
                for f in range(3):
                    flat[at + 64 * f + i] = q[v + 4 * f] | (top >> (2 * f) & 3) << 6


@njit(inline="always", nogil=True)
def _read_vectors(flat, at, q):
    # the inverse of _write_vectors: A, B, C at flat[at:at + 192] -> q
    for sub in range(2):
        for b in range(8):
            for e in range(4):
                i, v = 32 * sub + 4 * b + e, 32 * b + 16 * sub + e
                top = 0
                for f in range(3):
                    byte = flat[at + 64 * f + i]
                    q[v + 4 * f] = byte & 63
                    top |= (byte >> 6) << (2 * f)
                q[v + 12] = top


@njit(inline="always", nogil=True)
def _scale_position(s):
    # sub-block s of a group -> its byte in a row's scales
    b, sub = divmod(s, 2)
    return 8 * sub + b


@njit(inline="always", nogil=True)
def _block_base(n, g, num_groups):
    # row n, group g -> (the first byte of its block's group in data, the row within the block)
    blk, r = divmod(np.int64(n), ROWS)
    return (blk * num_groups + g) * BLOCK_BYTES, r


@njit(cache=True, nogil=True, parallel=True)
def pack_q6k(raw, data, d):
    # raw: uint8 [N, G * 210] -> data: uint8 [N4, G * 208], d: uint16 [N4, G] (padding rows zeroed by the
    # caller)
    num_groups = raw.shape[1] // RAW_BYTES
    flat, flat_d = data.reshape(data.size), d.reshape(d.size)
    for n in prange(raw.shape[0]):
        q = np.empty(GROUP, np.uint8)
        for g in range(num_groups):
            src = g * RAW_BYTES
            base, r = _block_base(n, g, num_groups)
            _read_raw(raw, n, src, q)
            _write_vectors(q, flat, base + VALUES + 192 * r)
            for s in range(16):
                flat[base + SCALES + 16 * r + _scale_position(s)] = raw[n, src + 192 + s]
            flat_d[(base // BLOCK_BYTES) * ROWS + r] = raw[n, src + 208] | np.uint16(raw[n, src + 209]) << 8


@njit(cache=True, nogil=True, parallel=True)
def unpack_q6k(data, d, raw):
    # the inverse of pack_q6k: data, d -> raw: uint8 [N, G * 210]
    num_groups = raw.shape[1] // RAW_BYTES
    flat, flat_d = data.reshape(data.size), d.reshape(d.size)
    for n in prange(raw.shape[0]):
        q = np.empty(GROUP, np.uint8)
        for g in range(num_groups):
            dst = g * RAW_BYTES
            base, r = _block_base(n, g, num_groups)
            _read_vectors(flat, base + VALUES + 192 * r, q)
            _write_raw(q, raw, n, dst)
            for s in range(16):
                raw[n, dst + 192 + s] = flat[base + SCALES + 16 * r + _scale_position(s)]
            bits = flat_d[(base // BLOCK_BYTES) * ROWS + r]
            raw[n, dst + 208], raw[n, dst + 209] = bits & 255, bits >> 8


@njit(cache=True, nogil=True)
def subblock_offsets(xq, xsum, offsets):
    # xq: [T, Kp] int8 (quad order), xsum: [T, Kp // 32] -> offsets: [T, Kp // 16] int32, per group -32 x
    # the first sub-blocks' sums of x (lanes 0-7: vectors 0-3), then the second ones' (xsum minus the first)
    for t in range(xq.shape[0]):
        for g in range(xq.shape[1] // GROUP):
            for b in range(8):
                first = 0
                for j in range(4):
                    for e in range(4):
                        first += xq[t, g * GROUP + 32 * j + 4 * b + e]
                offsets[t, 16 * g + b] = -32 * first
                offsets[t, 16 * g + 8 + b] = -32 * (xsum[t, 8 * g + b] - first)
