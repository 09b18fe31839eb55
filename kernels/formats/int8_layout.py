"""The int8-activation layout: activations quantized per 32-value block, weights repacked to match.

Columns are taken in groups of 8 blocks (GROUP = 256 values; K is zero-padded to a whole number of
groups). Inside a group, a vector holds W consecutive values of each of the 8 blocks: value e of run j
of block b (original column 32 b + W j + e) moves to position 8 W j + W b + e. A multiply-add over
runs then leaves block b's partial sums in its own lanes, with no shuffle:
  pair order (W = 2, q8_0): 16-value int16 vectors, vpmaddwd leaves block b in int32 lane b
      (kernels/simd/int8.py);
  quad order (W = 4, q4_0; q8_0 under VNNI): 32-value int8 vectors, vpmaddubsw leaves block b in int16
      lanes 2b, 2b + 1 (kernels/simd/u8s8.py), vpdpbusd in int32 lane b (kernels/simd/vnni.py).

  activations: xq [T, Kp] (values -127..127) int16 in pair order or int8 in quad order, xd f32
               [T, Kp // 32] block scales, xsum int32 [T, Kp // 32] block sums of xq (the unsigned
               weights' offsets of 8 and 128 are corrected with them)
  q8_0 weights: int8 [N, Kp] in pair order, or (VNNI) uint8 value + 128 [N, Kp] in quad order; q4_0
               weights: uint8 [N, Kp // 2] in quad order, per group 4 chunks of 32 bytes, chunk c holding
               vector 2c in its low nibbles and vector 2c + 1 in its high nibbles (the GGML nibble 0..15 =
               value + 8); scales: fp16 bits uint16 [N, Kp // 32].
Dynamic quantization (per block): d = max|x| / 127, q = rint(x * (1 / d)); static (calibrated,
per tensor): d = s, q = clip(rint(x * (1 / s)), -127, 127).
"""

import numpy as np
from numba import njit, prange

QK = 32
BLOCKS_PER_GROUP = 8
GROUP = QK * BLOCKS_PER_GROUP
PAIRS, QUADS = 2, 4  # values of a block side by side in a vector: q8_0's order, q4_0's
PARALLEL_MIN_TOKENS = 16  # waking the thread pool costs more than quantizing a few rows


def padded_k(k: int) -> int:
    return -(-k // GROUP) * GROUP


@njit(inline="always", nogil=True)
def _packed_index(k, width):
    # original column k (within the padded row) -> its position in the packed row
    g, r = divmod(k, GROUP)
    b, within = divmod(r, QK)
    j, e = divmod(within, width)
    return g * GROUP + j * BLOCKS_PER_GROUP * width + b * width + e


@njit(inline="always", nogil=True)
def _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale, width):
    # one token row, a group of 8 blocks at a time: quantize in column order (vectorizes), then move
    # the 256 values to the packed order
    K = x.shape[1]
    q = np.empty(GROUP, np.int16)
    for g in range(xq.shape[1] // GROUP):
        for b in range(BLOCKS_PER_GROUP):
            blk = g * BLOCKS_PER_GROUP + b
            c0 = blk * QK
            if c0 + QK <= K:  # a whole block: fixed trip counts, which LLVM unrolls and vectorizes
                xd[t, blk], xsum[t, blk] = _quantize_block(x, t, c0, QK, q, b * QK, inv_static, static_scale)
            else:  # the last block of a row that is not whole blocks, or padding
                n = max(0, K - c0)
                xd[t, blk], xsum[t, blk] = _quantize_block(x, t, c0, n, q, b * QK, inv_static, static_scale)
                for k in range(n, QK):
                    q[b * QK + k] = 0
        base = g * GROUP
        if width == QUADS:
            _reorder(q, xq, t, base, QUADS)
        else:
            _reorder(q, xq, t, base, PAIRS)


@njit(inline="always", nogil=True)
def _quantize_block(x, t, c0, n, q, q0, inv_static, static_scale):
    # x[t, c0:c0+n] -> q[q0:q0+n]; -> (the block's scale, the sum of its values)
    if static_scale > 0:
        d = np.float32(static_scale)
        inv = np.float32(inv_static)
    else:
        amax = np.float32(0.0)
        for k in range(n):
            a = abs(x[t, c0 + k])
            amax = max(amax, a)
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    total = 0
    for k in range(n):
        v = min(max(np.rint(x[t, c0 + k] * inv), np.float32(-127.0)), np.float32(127.0))
        q[q0 + k] = np.int16(v)
        total += np.int32(v)
    return d, total


@njit(inline="always", nogil=True)
def _reorder(q, xq, t, base, width):
    # q: one group's 256 values in column order -> xq[t, base:base+256] in runs of `width` (a constant)
    for j in range(QK // width):
        for b in range(BLOCKS_PER_GROUP):
            for e in range(width):
                xq[t, base + (j * BLOCKS_PER_GROUP + b) * width + e] = q[b * QK + width * j + e]


@njit(cache=True, nogil=True)
def _quantize_serial(x, xq, xd, xsum, inv_static, static_scale, width):
    for t in range(x.shape[0]):
        _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale, width)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_parallel(x, xq, xd, xsum, inv_static, static_scale, width):
    for t in prange(x.shape[0]):
        _quantize_row(x, t, xq, xd, xsum, inv_static, static_scale, width)


@njit(cache=True, nogil=True)  # compiled, so that compiled callers (kernels/moe/fused.py) run the same rule
def quantize_activations(x, xq, xd, xsum, static_scale=0.0):
    # x: [T, K] f32 -> xq: [T, Kp] int16 (pair order) | int8 (quad order), xd: [T, Kp // 32] f32,
    # xsum: [T, Kp // 32] int32; static_scale > 0: every block uses that scale (calibrated); 0: per-block
    # dynamic scales
    inv = np.float32(1.0) / np.float32(static_scale) if static_scale > 0 else np.float32(0.0)
    width = QUADS if xq.itemsize == 1 else PAIRS
    if x.shape[0] >= PARALLEL_MIN_TOKENS:
        _quantize_parallel(x, xq, xd, xsum, inv, np.float32(static_scale), width)
    else:
        _quantize_serial(x, xq, xd, xsum, inv, np.float32(static_scale), width)


@njit(cache=True, nogil=True, parallel=True)
def pack_q8_0(qs, out):
    # qs: [N, K] int8 (GGML q8_0 values) -> out: [N, Kp] int8 in the packed order, zero-padded
    K = qs.shape[1]
    for n in prange(qs.shape[0]):
        for k in range(out.shape[1]):
            out[n, _packed_index(k, PAIRS)] = qs[n, k] if k < K else 0


@njit(cache=True, nogil=True, parallel=True)
def pack_q8_0_quads(qs, out, rows):
    # qs: [N, K] int8 (GGML q8_0 values) -> out: [N4, Kp] uint8 value + 128 in quad order (the VNNI kernel's
    # unsigned side), padding 128 (value 0), in blocks of `rows` rows interleaved by group (1: row by row);
    # out zeroed, N4 = N rounded up to rows
    K, Kp = qs.shape[1], out.shape[1]
    for n in prange(qs.shape[0]):
        for k in range(Kp):
            i, j = interleaved_position(n, _packed_index(k, QUADS), Kp, rows, GROUP)
            out[i, j] = np.uint8(np.int64(qs[n, k]) + 128) if k < K else np.uint8(128)


@njit(cache=True, nogil=True, parallel=True)
def pack_q4_0(qs, out, rows):
    # qs: [N, K // 2] uint8 (GGML nibbles: byte i of a block = element i | element i + 16 << 4)
    # -> out: [N4, Kp // 2] uint8 in quad order, per group chunk c = vector 2c (low nibbles) | 2c + 1 (high),
    # in blocks of `rows` rows interleaved by group (1: row by row); out zeroed, N4 = N rounded up to rows
    K = qs.shape[1] * 2
    row_bytes = out.shape[1]
    for n in prange(qs.shape[0]):
        for k in range(row_bytes * 2):
            nibble = np.int64(8)  # padding: value 0 (its block scale is 0 too)
            if k < K:
                blk, i = divmod(k, QK)
                byte = np.int64(qs[n, blk * 16 + i % 16])
                nibble = byte & 15 if i < 16 else byte >> 4
            p = _packed_index(k, QUADS)
            g, r = divmod(p, GROUP)
            j, m = divmod(r, 32)  # vector j of the group, lane m
            row, col = interleaved_position(n, g * (GROUP // 2) + (j // 2) * 32 + m, row_bytes, rows,
                                            GROUP // 2)
            out[row, col] |= nibble << (4 * (j % 2))


@njit(inline="always", nogil=True)
def interleaved_position(n, pos, row_bytes, rows, group_bytes):
    # byte pos of row n in row-major order -> (row, column) where blocks of `rows` rows are stored group by
    # group, the group's bytes of the block's rows one after another (the VNNI kernel reads a block as one
    # stream); rows = 1: (n, pos)
    # signed throughout: a parfor index may be unsigned, and numba's divmod of mixed signs gives floats
    rows, group_bytes, row_bytes = np.int64(rows), np.int64(group_bytes), np.int64(row_bytes)
    block, r = divmod(np.int64(n), rows)
    g, offset = divmod(np.int64(pos), group_bytes)
    return divmod(((block * (row_bytes // group_bytes) + g) * rows + r) * group_bytes + offset, row_bytes)


def deinterleave_rows(data: np.ndarray, rows: int, group_bytes: int, n: int) -> np.ndarray:
    """Blocks of `rows` rows interleaved by group (pack_q8_0_quads, pack_q4_0) -> the first n rows, row by
    row."""
    n4, b = data.shape
    return np.ascontiguousarray(data.reshape(n4 // rows, b // group_bytes, rows, group_bytes)
                                .transpose(0, 2, 1, 3).reshape(n4, b)[:n])


def pad_scales(scales: np.ndarray, kp: int, num_rows: int | None = None) -> np.ndarray:
    # scales: [N, K // 32] uint16 -> [num_rows (default N), Kp // 32], padded blocks and rows with scale 0
    out = np.zeros((num_rows or scales.shape[0], kp // QK), np.uint16)
    out[:scales.shape[0], :scales.shape[1]] = scales
    return out


@njit(cache=True, nogil=True, parallel=True)
def unpack_int8_weights(packed, is_q4, quads, K, out):
    # the inverse of pack_q8_0 / pack_q8_0_quads (quads) / pack_q4_0 (is_q4) as values: packed -> out:
    # [N, K] int8 (q4_0: nibble - 8; q8_0 in quad order: byte - 128)
    for n in prange(packed.shape[0]):
        for k in range(K):
            if is_q4:
                g, r = divmod(_packed_index(k, QUADS), GROUP)
                j, m = divmod(r, 32)
                byte = np.int64(packed[n, g * (GROUP // 2) + (j // 2) * 32 + m])
                out[n, k] = ((byte >> (4 * (j % 2))) & 15) - 8
            elif quads:
                out[n, k] = np.int64(packed[n, _packed_index(k, QUADS)]) - 128
            else:
                out[n, k] = packed[n, _packed_index(k, PAIRS)]
